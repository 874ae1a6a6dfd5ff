"""The HTTP answer for a worker's result: an encoded image, class scores, a mask or detections on the upload."""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np
from PIL import Image
from starlette.responses import JSONResponse, Response

from imgserve.config import Settings
from imgserve.errors import ApiError
from imgserve.frontend import codec
from imgserve.models.outputs import UNSEEN
from imgserve.models.preprocess import Geometry


class Params(Protocol):
    """The query parameters a rendering reads (routes.PredictParams)."""

    @property
    def format(self) -> str | None: ...
    @property
    def quality(self) -> int | None: ...
    @property
    def top_k(self) -> int: ...
    @property
    def score_threshold(self) -> float: ...


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

    def __init__(self, settings: Settings, labels: list[str]) -> None:
        self.settings, self.labels = settings, labels

    def __call__(self, kind: str, output: Any, geometry: Geometry, params: Params, accept: str) -> Response:
        if kind == "image":
            return self.image(output, params, accept)
        if kind == "classify":
            return self.scores(output, params)
        if kind == "segment":
            return self.mask(output, geometry, params)
        return self.detections(output, geometry, params)

    def label(self, index: int) -> str | None:
        return self.labels[index] if 0 <= index < len(self.labels) else None

    def image(self, pixels: np.ndarray, params: Params, accept: str) -> Response:
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

    def scores(self, output: np.ndarray, params: Params) -> JSONResponse:
        output = self.probabilities(output)
        top = np.argsort(-output, kind="stable")[: params.top_k]
        return JSONResponse(
            {"top_k": [{"index": int(i), "label": self.label(int(i)), "score": float(output[i])} for i in top]}
        )

    def mask(self, mask: np.ndarray, geometry: Geometry, params: Params) -> Response:
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

    def detections(self, found: dict[str, list], geometry: Geometry, params: Params) -> JSONResponse:
        answer = [
            {"box": box, "index": index, "label": self.label(index), "score": score}
            for box, index, score in detections_on_original(found, geometry, params.score_threshold)
        ]
        width, height = geometry.original
        return JSONResponse({"width": width, "height": height, "detections": answer})


def detections_on_original(
    found: dict[str, list], geometry: Geometry, threshold: float
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
