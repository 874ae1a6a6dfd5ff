"""What the model's output is, decided once at warm-up: images, class scores, a segmentation mask or detections.

Each kind has two steps. In the worker, the model's output for one image becomes a small result (this module):
uint8 pixels (image), a float score vector (classify), a uint8 class-index mask (segment), lists of boxes (detect).
In the front end, that result becomes the HTTP answer (models/render.py).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from imgserve.errors import ApiError
from imgserve.models.loader import ModelLoadError

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
    as NHWC in one copy. A channels-last output on the CPU is cast by numpy, whose float -> uint8 cast of dense memory
    is the faster one there (docs/architecture.md, "How the model runs"); a strided one is cast faster by torch.
    """
    with torch.inference_mode():
        output = output.detach()
        dense = output.is_contiguous() or output.is_contiguous(memory_format=torch.channels_last)
        scaled = (output if dense else output.clone()).clamp_(0, 1).mul_(255).round_().permute(0, 2, 3, 1)
        if scaled.device.type == "cpu" and scaled.is_contiguous():
            return scaled.numpy().astype(np.uint8)
        return scaled.to(torch.uint8, memory_format=torch.contiguous_format).cpu().numpy()


def _detections(found: dict[str, torch.Tensor], size: tuple[int, int]) -> dict[str, list[Any]]:
    height, width = size
    boxes = found["boxes"].detach().float().cpu().clone()
    boxes[:, 0::2] = boxes[:, 0::2].clamp(0, width)
    boxes[:, 1::2] = boxes[:, 1::2].clamp(0, height)
    return {
        "boxes": boxes.tolist(),
        "labels": found["labels"].int().tolist(),
        "scores": found["scores"].float().tolist(),
    }
