"""What the model's output is, decided once at warm-up: images, class scores, a segmentation mask or detections.

Each kind has two steps. In the worker, the model's output for one image becomes a small result: uint8 pixels
(image), a float score vector (classify), a uint8 class-index mask (segment), lists of boxes (detect). In the front
end, that result becomes the HTTP answer, mapped back onto the upload with its Geometry and the query parameters.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np
import torch
from PIL import Image
from starlette.responses import JSONResponse, Response

from service import codec
from service.config import Settings
from service.errors import ApiError
from service.models.loader import ModelLoadError
from service.preprocess import Geometry

IMAGE_CHANNELS = (1, 3, 4)
DETECTION_KEYS = ("boxes", "labels", "scores")
MAX_SEGMENT_CLASSES = 255  # class indices fit a PNG palette image; 255 marks pixels the model did not see
UNSEEN = 255
EXPECTED = {
    "image": "an N x C x H x W tensor with C = 1, 3 or 4",
    "classify": "an N x K tensor of class scores",
    "segment": f"N x K x H x W logits (2 <= K <= {MAX_SEGMENT_CLASSES}), or a dict with them under 'out'",
    "detect": "a list of N dicts with 'boxes', 'labels' and 'scores'",
}


class Params(Protocol):
    """The query parameters a rendering reads (routes.PredictParams)."""

    format: str | None
    quality: int | None
    top_k: int
    score_threshold: float


def describe(output: Any) -> str:
    """A short description of a model output, for error messages."""
    if isinstance(output, torch.Tensor):
        return f"a tensor of shape {tuple(output.shape)}"
    if isinstance(output, dict):
        return f"a dict with keys {sorted(map(str, output))}"
    if isinstance(output, list | tuple):
        inner = describe(output[0]) if output else "nothing"
        return f"a {type(output).__name__} of {len(output)} ({inner})"
    return f"a {type(output).__name__}"


def _fits(kind: str, output: Any) -> bool:
    if kind == "detect":
        return (
            isinstance(output, list | tuple)
            and len(output) > 0
            and all(isinstance(item, dict) and all(key in item for key in DETECTION_KEYS) for item in output)
        )
    if kind == "segment" and isinstance(output, dict):
        output = output.get("out")
    if not isinstance(output, torch.Tensor):
        return False
    if kind == "classify":
        return output.ndim == 2
    if kind == "image":
        return output.ndim == 4 and output.shape[1] in IMAGE_CHANNELS
    return output.ndim == 4 and 2 <= output.shape[1] <= MAX_SEGMENT_CLASSES  # argmax over K classes


def decide(output: Any, task: str) -> str:
    """The output kind from the warm-up output and --task (auto: guessed from type and shape), or ModelLoadError."""
    if task != "auto":
        if not _fits(task, output):
            raise ModelLoadError(f"--task {task} expects {EXPECTED[task]}, but the model returned {describe(output)}")
        return task
    for kind in ("detect", "classify", "image", "segment"):  # an N x 3 x H x W output is an image unless told
        if _fits(kind, output):
            return kind
    expected = "; ".join(f"{kind}: {text}" for kind, text in EXPECTED.items())
    raise ModelLoadError(f"the model returned {describe(output)}, which imgserve cannot answer (it serves {expected})")


def class_count(kind: str, output: Any) -> int | None:
    """How many classes the warm-up output has (None where the output does not say: images, detections)."""
    if kind == "classify":
        return int(output.shape[1])
    if kind == "segment":
        return int((output["out"] if isinstance(output, dict) else output).shape[1])
    return None


def read_labels(path: str | None) -> list[str]:
    """One label per line, in class-index order; a blank line is an error, not silently dropped."""
    if not path:
        return []
    try:
        with open(path, encoding="utf-8") as file:
            lines = file.read().splitlines()
    except OSError as exc:
        raise ModelLoadError(f"cannot read the labels file: {exc}") from None
    blank = [number for number, line in enumerate(lines, 1) if not line.strip()]
    if blank:
        raise ModelLoadError(
            f"{path}: line {blank[0]} is blank; every line is the label of one class index "
            "(write a placeholder such as N/A for an unused index)"
        )
    return [line.strip() for line in lines]


def check_labels(labels: list[str], classes: int | None, path: str | None) -> None:
    """A labels file must name every class the model outputs."""
    if labels and classes is not None and len(labels) < classes:
        raise ModelLoadError(f"{path} has {len(labels)} labels but the model outputs {classes} classes")


# Worker side: a batch's output -> one small result per image, computed on the device, brought back once.
def per_image(kind: str, output: Any, sizes: list[tuple[int, int]], padded: tuple[int, int]) -> list[Any]:
    """The answered part of a batch's output, one result per image: spatial results cropped off the padding
    (`sizes` are the images' heights and widths in a batch padded to `padded`), boxes clipped to the image."""
    if kind == "detect":
        if not isinstance(output, list | tuple) or len(output) != len(sizes):
            raise ApiError(500, "bad_model_output", f"the model returned {describe(output)} for {len(sizes)} images")
        return [_detections(found, size) for found, size in zip(output, sizes, strict=True)]
    if kind == "segment" and isinstance(output, dict):
        output = output["out"]  # a segmenter's "aux" head is not answered
    if not _fits(kind, output):
        raise ApiError(500, "bad_model_output", f"the model returned {describe(output)}, not {EXPECTED[kind]}")
    if kind == "classify":
        return list(output.float().cpu().numpy())
    # An image's pixels, or a segmentation's class index per pixel.
    batch = to_pixels(output) if kind == "image" else output.argmax(dim=1).to(torch.uint8).cpu().numpy()
    scale_h, scale_w = batch.shape[1] / padded[0], batch.shape[2] / padded[1]
    return [batch[i, : round(h * scale_h), : round(w * scale_w)] for i, (h, w) in enumerate(sizes)]


def to_pixels(output: torch.Tensor) -> np.ndarray:
    """A model's NxCxHxW output in [0, 1] -> uint8 NxHxWxC on the host, quantised on the device.

    The output is scaled in place (it is the batch's own; a broadcast view is copied first), then cast and laid out
    as NHWC in one copy.
    """
    with torch.inference_mode():
        output = output.detach()
        dense = output.is_contiguous() or output.is_contiguous(memory_format=torch.channels_last)
        scaled = (output if dense else output.clone()).clamp_(0, 1).mul_(255).round_().permute(0, 2, 3, 1)
        return scaled.to(torch.uint8, memory_format=torch.contiguous_format).cpu().numpy()


def _detections(found: dict[str, torch.Tensor], size: tuple[int, int]) -> dict[str, list]:
    height, width = size
    boxes = found["boxes"].detach().float().cpu().clone()
    boxes[:, 0::2] = boxes[:, 0::2].clamp(0, width)
    boxes[:, 1::2] = boxes[:, 1::2].clamp(0, height)
    return {
        "boxes": boxes.tolist(),
        "labels": found["labels"].int().tolist(),
        "scores": found["scores"].float().tolist(),
    }


# Front-end side: a result -> the HTTP answer.
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

    def scores(self, output: np.ndarray, params: Params) -> JSONResponse:
        if self.settings.scores == "logits":
            output = np.exp(output - output.max())
            output /= output.sum()
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
        answer = []
        for box, index, score in zip(found["boxes"], found["labels"], found["scores"], strict=True):
            if score < params.score_threshold:
                continue
            left, top = geometry.to_original(box[0], box[1])
            right, bottom = geometry.to_original(box[2], box[3])
            answer.append(
                {"box": [left, top, right, bottom], "index": index, "label": self.label(index), "score": score}
            )
        width, height = geometry.original
        return JSONResponse({"width": width, "height": height, "detections": answer})


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
