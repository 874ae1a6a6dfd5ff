"""The built-in API's answers for a model's result, by its output kind: over HTTP an encoded image, class scores, a
mask or detections on the upload; over the Open Inference Protocol the values of the kind's outputs (`TENSORS`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import numpy as np
from PIL import Image
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.responses import JSONResponse, Response

from imgserve import codec
from imgserve.api import TensorSpec
from imgserve.config import BuiltinModel
from imgserve.errors import ApiError
from imgserve.models.outputs import UNSEEN
from imgserve.models.preprocess import Geometry

MAX_LISTED_PROBLEMS = 5
OUTPUT_FORMATS = ("jpeg", "png", "webp")


class PredictParams(BaseModel):
    """The query parameters of POST /predict for the built-in model kinds."""

    model_config = ConfigDict(extra="forbid")

    format: Literal["jpeg", "png", "webp", "json"] | None = None
    quality: int | None = Field(None, ge=1, le=100)
    top_k: int = Field(5, ge=1, le=1000)
    score_threshold: float = Field(0.5, ge=0, le=1)

    @classmethod
    def parse(cls, query: Mapping[str, str]) -> PredictParams:
        """The parameters, or 422 naming each bad one."""
        try:
            return cls.model_validate(dict(query))
        except ValidationError as exc:
            errors = exc.errors()
            listed = errors[:MAX_LISTED_PROBLEMS]
            problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}"[:100] for e in listed)
            more = len(errors) - MAX_LISTED_PROBLEMS
            raise ApiError(422, "bad_parameters", problems + (f"; and {more} more" if more > 0 else "")) from None


# The Open Inference Protocol's outputs of each kind (the batch dimension comes first, before these dims).
TENSORS = {
    "image": (
        TensorSpec("output_image", "BYTES", (1,), binary=True),
        TensorSpec("output_pixels", "UINT8", (-1, -1, -1)),
    ),
    "classify": (TensorSpec("scores", "FP32", (-1,)),),
    "segment": (TensorSpec("mask", "UINT8", (-1, -1)),),
    "detect": (
        TensorSpec("boxes", "FP32", (-1, 4), pad=0.0),
        TensorSpec("scores", "FP32", (-1,), pad=0.0),
        TensorSpec("labels", "INT32", (-1,), pad=-1),
        TensorSpec("count", "INT32", (1,)),
    ),
}


def _palette() -> list[int]:
    """PASCAL VOC's colour map: class i's colour spreads i's bits over the high bits of R, G and B."""
    colours = []
    for index in range(256):
        red = green = blue = 0
        bits = index
        for shift in range(7, -1, -1):
            red |= (bits & 1) << shift
            green |= (bits >> 1 & 1) << shift
            blue |= (bits >> 2 & 1) << shift
            bits >>= 3
        colours += [red, green, blue]
    return colours


PALETTE = _palette()


class Renderer:
    """Turns a worker's result into the HTTP answer for the kind the workers decided at warm-up."""

    def __init__(self, settings: BuiltinModel, labels: list[str]) -> None:
        self.settings, self.labels = settings, labels

    def __call__(self, kind: str, output: Any, geometry: Geometry, params: PredictParams, accept: str) -> Response:
        if kind == "image":
            return self.image(output, params, accept)
        if kind == "classify":
            return self.scores(output, params)
        if kind == "segment":
            return self.mask(output, geometry, params)
        return self.detections(output, geometry, params)

    def label(self, index: int) -> str | None:
        return self.labels[index] if 0 <= index < len(self.labels) else None

    def image(self, pixels: np.ndarray, params: PredictParams, accept: str) -> Response:
        fmt = codec.choose_format(params.format, accept, self.settings.output_format)
        if fmt == "json":
            raise ApiError(422, "bad_parameters", "format: this model answers images (jpeg, png or webp)")
        body = codec.encode_image(pixels, fmt, params.quality or self.settings.jpeg_quality)
        return Response(body, media_type=codec.OUTPUT_TYPES[fmt])

    def probabilities(self, output: np.ndarray) -> np.ndarray:
        """A classifier's scores as probabilities (softmax of logits, or as they are)."""
        if self.settings.scores == "logits":
            output = np.exp(output - output.max())
            output /= output.sum()
        return output

    def scores(self, output: np.ndarray, params: PredictParams) -> JSONResponse:
        output = self.probabilities(output)
        top = np.argsort(-output, kind="stable")[: params.top_k]
        return JSONResponse(
            {"top_k": [{"index": int(i), "label": self.label(int(i)), "score": float(output[i])} for i in top]}
        )

    def mask(self, mask: np.ndarray, geometry: Geometry, params: PredictParams) -> Response:
        if params.format not in (None, "png", "json"):
            raise ApiError(422, "bad_parameters", "format: a segmentation mask is answered as png or json")
        full = mask_on_original(mask, geometry)
        if params.format == "json":
            indices, counts = np.unique(full[full != UNSEEN], return_counts=True)
            total = full.size
            classes = [
                {"index": int(i), "label": self.label(int(i)), "pixels": int(n), "fraction": n / total}
                for i, n in sorted(zip(indices.tolist(), counts.tolist(), strict=True), key=lambda item: -item[1])
            ]
            return JSONResponse({"width": full.shape[1], "height": full.shape[0], "classes": classes})
        image = Image.fromarray(full)
        image.putpalette(PALETTE)
        return Response(codec.save(image, "png"), media_type=codec.OUTPUT_TYPES["png"])

    def detections(self, found: dict[str, list[Any]], geometry: Geometry, params: PredictParams) -> JSONResponse:
        answer = [
            {"box": box, "index": index, "label": self.label(index), "score": score}
            for box, index, score in detections_on_original(found, geometry, params.score_threshold)
        ]
        width, height = geometry.original
        return JSONResponse({"width": width, "height": height, "detections": answer})

    def tensors(
        self, kind: str, output: Any, geometry: Geometry, parameters: Mapping[str, Any], wanted: set[str]
    ) -> dict[str, Any]:
        """One image's values of the kind's Open Inference Protocol outputs (`TENSORS`), those `wanted` at least."""
        if kind == "image":
            fmt = parameters.get("format", self.settings.output_format)
            if fmt not in OUTPUT_FORMATS:
                raise ApiError(400, "bad_request", f"parameter format must be one of {', '.join(OUTPUT_FORMATS)}")
            quality = int(_number(parameters, "quality", self.settings.jpeg_quality, 1, 100))
            encoded = codec.encode_image(output, fmt, quality) if "output_image" in wanted else b""
            return {"output_image": encoded, "output_pixels": output}
        if kind == "classify":
            return {"scores": self.probabilities(output).astype(np.float32)}
        if kind == "segment":
            return {"mask": mask_on_original(output, geometry)}
        threshold = _number(parameters, "score_threshold", 0.5, 0.0, 1.0)
        kept = detections_on_original(output, geometry, threshold)
        return {
            "boxes": np.array([box for box, _, _ in kept], dtype=np.float32).reshape(-1, 4),
            "labels": np.array([index for _, index, _ in kept], dtype=np.int32),
            "scores": np.array([score for _, _, score in kept], dtype=np.float32),
            "count": np.array([len(kept)], dtype=np.int32),
        }


def _number(parameters: Mapping[str, Any], name: str, default: float, low: float, high: float) -> float:
    value = parameters.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise ApiError(400, "bad_request", f"parameter {name} must be a number from {low:g} to {high:g}")
    return value


def detections_on_original(
    found: dict[str, list[Any]], geometry: Geometry, threshold: float
) -> list[tuple[list[float], int, float]]:
    """(box on the upload as left, top, right, bottom; class index; score) of each detection scoring >= threshold."""
    kept = []
    for box, index, score in zip(found["boxes"], found["labels"], found["scores"], strict=True):
        if score >= threshold:
            left, top = geometry.to_original(box[0], box[1])
            right, bottom = geometry.to_original(box[2], box[3])
            kept.append(([left, top, right, bottom], index, score))
    return kept


def mask_on_original(mask: np.ndarray, geometry: Geometry) -> np.ndarray:
    """The model-input-sized class mask -> the upload's size (nearest); what the crop cut off is UNSEEN (255)."""
    left, top, width, height = geometry.crop
    if mask.shape != (height, width):
        mask = np.array(Image.fromarray(mask).resize((width, height), Image.Resampling.NEAREST))
    if (width, height) != geometry.resized:
        canvas = np.full(geometry.resized[::-1], UNSEEN, dtype=np.uint8)
        canvas[top : top + height, left : left + width] = mask
        mask = canvas
    if geometry.resized != geometry.original:
        mask = np.array(Image.fromarray(mask).resize(geometry.original, Image.Resampling.NEAREST))
    return mask
