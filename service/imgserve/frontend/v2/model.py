"""The served model as the Open Inference Protocol sees it: its tensors, metadata, configuration and inference.

Both wire formats (HTTP in http.py, gRPC in grpc_service.py) convert to and from tensors.InferRequest / Tensor and call
`ServedModel.infer`, which hands the images to the one inference core (frontend/inference.py).

Inputs (send one of them): `image` BYTES [N, 1], each element an encoded image (JPEG, PNG, WebP, BMP, GIF, TIFF;
decoded with the same codec and limits as /predict); or `pixels` UINT8 [N, H, W, 3], RGB, HWC.
Outputs by the model's kind (the batch dimension N first):
- image: `output_image` BYTES [N, 1] encoded (request parameter `format`: jpeg, png or webp; `quality`), the
  default; `output_pixels` UINT8 [N, H, W, C] when asked for by name (the images must share one size).
- classify: `scores` FP32 [N, K] probabilities; with the classification extension (output parameter
  `classification: k`) BYTES [N, k] of "score:index[:label]", best first.
- segment: `mask` UINT8 [N, H, W], each pixel's class index on the upload (255 where the model saw nothing).
- detect: `boxes` FP32 [N, D, 4] (left, top, right, bottom on the upload), `scores` FP32 [N, D], `labels` INT32
  [N, D] (class indices; -1 pads), `count` INT32 [N, 1] (detections per image, D the largest); request parameter
  `score_threshold` (default 0.5).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from imgserve import __version__
from imgserve.config import Settings
from imgserve.errors import ApiError
from imgserve.frontend import codec
from imgserve.frontend.inference import Image, Inference
from imgserve.frontend.render import Renderer, detections_on_original, mask_on_original
from imgserve.frontend.v2.tensors import DTYPES, InferRequest, RequestedOutput, Tensor, bad
from imgserve.handoff.state import SharedState
from imgserve.models.preprocess import Geometry

VERSION = "1"
PLATFORM = "pytorch_libtorch"
EXTENSIONS = ["binary_tensor_data", "model_configuration"]  # + classification for classifiers


@dataclass(frozen=True)
class Spec:
    """One tensor of the model's signature; `dims` leave out the batch dimension."""

    name: str
    datatype: str
    dims: tuple[int, ...]

    def metadata(self) -> dict[str, Any]:
        return {"name": self.name, "datatype": self.datatype, "shape": [-1, *self.dims]}

    def config(self, **extra: Any) -> dict[str, Any]:
        data_type = "TYPE_STRING" if self.datatype == "BYTES" else f"TYPE_{self.datatype}"
        return {"name": self.name, "data_type": data_type, "dims": list(self.dims), **extra}


INPUTS = (Spec("image", "BYTES", (1,)), Spec("pixels", "UINT8", (-1, -1, 3)))
OUTPUTS = {
    "image": (Spec("output_image", "BYTES", (1,)), Spec("output_pixels", "UINT8", (-1, -1, -1))),
    "classify": (Spec("scores", "FP32", (-1,)),),
    "segment": (Spec("mask", "UINT8", (-1, -1)),),
    "detect": (
        Spec("boxes", "FP32", (-1, 4)),
        Spec("scores", "FP32", (-1,)),
        Spec("labels", "INT32", (-1,)),
        Spec("count", "INT32", (1,)),
    ),
}
DEFAULT_OUTPUTS = {"image": ("output_image",)}  # the others answer every output by default
# A detection output: its place in (box, index, score), datatype, padding and the dimensions after [N, D].
DETECTION_FIELDS = {"boxes": (0, "FP32", 0.0, [4]), "labels": (1, "INT32", -1, []), "scores": (2, "FP32", 0.0, [])}
OUTPUT_FORMATS = ("jpeg", "png", "webp")


class ServedModel:
    """The one model this server serves, under --model-name, version 1."""

    def __init__(
        self,
        settings: Settings,
        state: SharedState,
        inference: Inference,
        renderer: Renderer,
        not_ready_reason: Callable[[], str | None],
    ) -> None:
        self.settings, self.state, self.inference, self.renderer = settings, state, inference, renderer
        self.not_ready_reason = not_ready_reason
        self.name = settings.served_name

    def check(self, name: str, version: str | None = None) -> None:
        """404 unless `name` (and `version`, if given) is the served model."""
        if name != self.name:
            raise ApiError(404, "unknown_model", f"unknown model {name[:100]!r}; this server serves {self.name!r}")
        if version not in (None, "", VERSION):
            raise ApiError(404, "unknown_version", f"model {name!r} has only version {VERSION}, not {version[:20]!r}")

    def max_images(self) -> int:
        """The most images one request may carry (what the pod's queue holds): the parsers' bound on BYTES elements."""
        return self.inference.admission.limit()

    @property
    def kind(self) -> str:
        """The output kind the workers decided at warm-up (503 before the model is loaded)."""
        kind = self.state.task
        if kind is None:
            raise ApiError(503, "model_loading", "the model is still loading", self.settings.retry_after_s)
        return kind

    def server_metadata(self) -> dict[str, Any]:
        extensions = EXTENSIONS + (["classification"] if self.state.task == "classify" else [])
        return {"name": "imgserve", "version": __version__, "extensions": extensions}

    def metadata(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "versions": [VERSION],
            "platform": PLATFORM,
            "inputs": [spec.metadata() for spec in INPUTS],
            "outputs": [spec.metadata() for spec in OUTPUTS[self.kind]],
        }

    def config(self) -> dict[str, Any]:
        """The part of Triton's model configuration that clients (perf_analyzer, image_client) read."""
        configured = self.settings.max_batch_size
        batch = self.state.limits["max_batch_size"] or (configured if isinstance(configured, int) else 1)
        return {
            "name": self.name,
            "platform": PLATFORM,
            "max_batch_size": int(batch),
            "input": [
                INPUTS[0].config(format="FORMAT_NONE", optional=True),
                INPUTS[1].config(format="FORMAT_NHWC", optional=True),
            ],
            "output": [spec.config() for spec in OUTPUTS[self.kind]],
            "dynamic_batching": {"max_queue_delay_microseconds": int(self.settings.batch_timeout_ms * 1000)},
        }

    async def infer(
        self, request: InferRequest, deadline: float, started: float
    ) -> list[tuple[RequestedOutput, Tensor]]:
        """Each requested output with its tensor for the request's images; ApiError for anything wrong."""
        kind = self.kind
        wanted = self._outputs(kind, request.outputs, request.binary_outputs)
        images = _images(request.inputs)
        deadline = min(deadline, started + _timeout_s(request.parameters.get("timeout")))
        finish = self._finisher(kind, {output.name for output in wanted}, request.parameters)
        results = await self.inference.run(images, deadline, finish)
        return [(output, self._tensor(kind, output, results)) for output in wanted]

    def _outputs(self, kind: str, requested: list[RequestedOutput] | None, binary: bool) -> list[RequestedOutput]:
        names = [spec.name for spec in OUTPUTS[kind]]
        if requested is None:
            return [RequestedOutput(name, binary) for name in DEFAULT_OUTPUTS.get(kind, names)]
        for output in requested:
            if output.name not in names:
                raise bad(f"unknown output {output.name[:100]!r}; this model has {', '.join(names)}")
            if output.classification is not None and kind != "classify":
                raise bad(f"output {output.name!r}: classification applies only to a classifier's scores")
        return requested

    def _finisher(self, kind: str, names: set[str], parameters: dict[str, Any]) -> Callable[[Any, Geometry], Any]:
        """What becomes of one image's result, in the front end's codec threads."""
        if kind == "image":
            fmt, quality = self._output_format(parameters)

            def image(pixels: np.ndarray, geometry: Geometry) -> dict[str, Any]:
                encoded = codec.encode_image(pixels, fmt, quality) if "output_image" in names else None
                return {"output_image": encoded, "output_pixels": pixels}

            return image
        if kind == "classify":
            return lambda scores, geometry: self.renderer.probabilities(scores).astype(np.float32)
        if kind == "segment":
            return mask_on_original
        threshold = _number(parameters, "score_threshold", 0.5, 0.0, 1.0)
        return lambda found, geometry: detections_on_original(found, geometry, threshold)

    def _tensor(self, kind: str, output: RequestedOutput, results: list[Any]) -> Tensor:
        """The batch's tensor for one output."""
        name, count = output.name, len(results)
        if kind == "image" and name == "output_image":
            return Tensor(name, "BYTES", [count, 1], [result[name] for result in results])
        if kind == "image":
            return _stacked(name, "UINT8", [result[name] for result in results])
        if kind == "segment":
            return _stacked(name, "UINT8", results)
        if kind == "classify" and output.classification is not None:
            k = min(output.classification, len(results[0]))  # k is clamped to the class count: shape = data
            return Tensor(name, "BYTES", [count, k], self._top_k(results, k), True)
        if kind == "classify":
            return _stacked(name, "FP32", results)
        if name == "count":
            return Tensor(name, "INT32", [count, 1], np.array([[len(found)] for found in results], dtype=np.int32))
        column, datatype, fill, tail = DETECTION_FIELDS[name]
        most = max((len(found) for found in results), default=0)
        array = np.full([count, most, *tail], fill, dtype=DTYPES[datatype])
        for row, found in enumerate(results):
            for index, detection in enumerate(found):
                array[row, index] = detection[column]
        return Tensor(name, datatype, list(array.shape), array)

    def _output_format(self, parameters: dict[str, Any]) -> tuple[str, int]:
        fmt = parameters.get("format", self.settings.output_format)
        if fmt not in OUTPUT_FORMATS:
            raise bad(f"parameter format must be one of {', '.join(OUTPUT_FORMATS)}")
        return fmt, int(_number(parameters, "quality", self.settings.jpeg_quality, 1, 100))

    def _top_k(self, results: list[np.ndarray], k: int) -> list[bytes]:
        """Triton's classification strings "score:index[:label]", best first, k per image."""
        strings = []
        for scores in results:
            for index in np.argsort(-scores, kind="stable")[:k]:
                label = self.renderer.label(int(index))
                text = f"{scores[index]:f}:{index}" + (f":{label}" if label is not None else "")
                strings.append(text.encode())
        return strings


def _images(inputs: list[Tensor]) -> list[Image]:
    """The images of the request's one input: encoded BYTES [N, 1] (or [N]), or UINT8 pixels [N, H, W, 3]."""
    names = [spec.name for spec in INPUTS]
    if len(inputs) != 1 or inputs[0].name not in names:
        given = ", ".join(repr(tensor.name[:100]) for tensor in inputs)
        raise bad(f"send exactly one input, 'image' (BYTES) or 'pixels' (UINT8); got {given}")
    (tensor,) = inputs
    if tensor.name == "image":
        if tensor.datatype != "BYTES" or len(tensor.shape) not in (1, 2) or tensor.shape[1:] not in ([], [1]):
            raise bad(f"input 'image' is BYTES [N, 1] (got {tensor.datatype[:16]} {tensor.shape})")
        return list(tensor.data)
    if tensor.datatype != "UINT8" or len(tensor.shape) != 4 or tensor.shape[3] != 3:
        raise bad(f"input 'pixels' is UINT8 [N, H, W, 3] (got {tensor.datatype[:16]} {tensor.shape})")
    return list(tensor.data)


def _stacked(name: str, datatype: str, arrays: list[np.ndarray]) -> Tensor:
    shapes = {array.shape for array in arrays}
    if len(shapes) > 1:
        raise bad(f"output {name!r} is one tensor: the images must share one size (got {len(shapes)} sizes)")
    array = np.stack(arrays)
    return Tensor(name, datatype, list(array.shape), array)


def _number(parameters: dict[str, Any], name: str, default: float, low: float, high: float) -> float:
    value = parameters.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise bad(f"parameter {name} must be a number from {low:g} to {high:g}")
    return value


def _timeout_s(value: Any) -> float:
    """Triton's `timeout` request parameter, in microseconds (none: no limit beyond the request's deadline)."""
    if value is None:
        return float("inf")
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ApiError(422, "bad_timeout", "parameter timeout must be a positive number of microseconds")
    return value / 1e6
