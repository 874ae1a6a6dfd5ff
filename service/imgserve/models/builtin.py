"""The built-in API: a model file (or the built-in denoiser) served as an ImageAPI, with the same public hooks as a
user's own API. What `--model` and its flags serve.

decode_request (front end): the upload, decoded strictly and resized/cropped as torchvision's weight transforms do
(models/preprocess.py), its geometry kept in the request's context. batch and predict (worker): the images in one
reused uint8 buffer, the model on the device (models/running.py), each image's result taken from the output by the
output kind decided at warm-up (models/outputs.py). encode_response (front end): the answer for that kind, over
HTTP or the Open Inference Protocol (models/render.py).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import numpy as np
import torch
from starlette.responses import Response

from imgserve.api import ImageAPI, Request, TensorSpec
from imgserve.codec import EncodedImage
from imgserve.config import BuiltinModel, served_name
from imgserve.errors import ApiError
from imgserve.models import outputs
from imgserve.models.loader import ModelLoadError
from imgserve.models.preprocess import Geometry, Preprocess
from imgserve.models.render import TENSORS, PredictParams, Renderer
from imgserve.models.running import ModelRunner

PROBE_SIDE = 256  # the warm-up image's side when the model has no fixed --input-size


class KindRecord(Protocol):
    """Where the workers publish the output kind they decided at warm-up, for the front ends to read."""

    @property
    def task(self) -> str | None: ...

    def set_task(self, kind: str) -> None: ...


class LocalKinds:
    """A kind record within one process: for the GPU probe's throwaway API, tests and the in-process limit."""

    task: str | None = None

    def set_task(self, kind: str) -> None:
        self.task = kind


@dataclass(frozen=True)
class Batch:
    """A chunk as the model takes it: the uint8 NxHxWx3 buffer, and each image's height and width in it."""

    pixels: torch.Tensor
    sizes: list[tuple[int, int]]


def pads(settings: BuiltinModel, device_type: str) -> bool:
    """Whether images of close sizes are padded into one batch: --pad-mixed-sizes, and auto on a GPU only."""
    return device_type == "cuda" if settings.pad_mixed_sizes == "auto" else bool(settings.pad_mixed_sizes)


def decodes_in_worker(settings: BuiltinModel, device_type: str) -> bool:
    """Whether uploads are decoded in the worker, next to their batch: --decode-in worker, and auto where the device
    is CUDA and torchvision (whose GPU JPEG decoder the worker uses) is installed."""
    if settings.decode_in == "auto":
        return device_type == "cuda" and importlib.util.find_spec("torchvision") is not None
    return settings.decode_in == "worker"


class ModelAPI(ImageAPI):
    """The built-in API over a model file: it answers by the model's output kind (`task` in GET /info): an image
    (`format`, else the `Accept` header's first image type, else the server's default), class scores (`top_k`), a
    mask (PNG, or JSON with `format=json`) or detections (`score_threshold`).

    Built from the built-in model's settings (--model, --preprocess, --task, --labels, --precision, ...).
    """

    inputs = (TensorSpec("image", "BYTES", (1,)), TensorSpec("pixels", "UINT8", (-1, -1, 3)))
    request_model = PredictParams
    response_types = ("image/jpeg", "image/png", "image/webp", "application/json")

    def __init__(
        self,
        settings: BuiltinModel,
        kinds: KindRecord,
        pad: bool,
        retry_after_s: int = 1,
        decode_in_worker: bool = False,
        max_batch_size: int | Literal["auto"] = "auto",
    ) -> None:
        super().__init__(max_batch_size)  # the largest batch a compiled model is warmed up on
        self.settings, self.kinds, self.retry_after_s = settings, kinds, retry_after_s
        self.decode_in_worker = decode_in_worker  # uploads left encoded, decoded and cut next to the batch
        self.model, self.model_factory = settings.model[0], settings.model_factory  # type: ignore[misc]
        self.name = served_name(settings.model[0])  # type: ignore[misc]
        self.precision = settings.precision  # type: ignore[misc]
        self.labels = outputs.read_labels(settings.labels)  # type: ignore[misc]
        self.group_by_shape = not pad  # type: ignore[misc]  # images of close sizes are padded together
        self.preprocess = Preprocess.from_settings(settings)
        self.renderer = Renderer(settings, list(self.labels))
        self.probe_side = settings.input_size or PROBE_SIDE

    @property
    def outputs(self) -> tuple[TensorSpec, ...]:  # type: ignore[override]  # by the kind decided at warm-up
        """The outputs of the kind the workers decided at warm-up (503 before the model is loaded)."""
        return TENSORS[self.kind]

    @property
    def kind(self) -> str:
        kind = self.kinds.task
        if kind is None:
            raise ApiError(503, "model_loading", "the model is still loading", self.retry_after_s)
        return kind

    # In each inference worker.
    def setup(self, device: str) -> None:
        """Load the model (its weights shared among the device's workers), warm it up on a probe image (compiled:
        at every batch size it can run), and decide from that output what the model answers (image, classify,
        segment or detect); the labels must name every class."""
        model, threads = self.load_model(device), self.thread_counts(device)
        self.runner = ModelRunner.for_settings(
            model, torch.device(device), self.settings, self.batching[0] or "auto", threads
        )
        side = self.probe_side
        probe = torch.randint(0, 256, (1, side, side, 3), dtype=torch.uint8)
        try:
            warmup = self.runner.warm_up(probe, self.batch_sizes(), threads)
        except Exception as exc:
            failure = f"the model failed warm-up on {device} with a {side}x{side} image: {type(exc).__name__}: {exc}"
            raise ModelLoadError(failure) from None
        self.worker_kind = outputs.decide(warmup, self.settings.task)
        outputs.check_labels(list(self.labels), outputs.class_count(self.worker_kind, warmup), self.settings.labels)
        self.kinds.set_task(self.worker_kind)

    def batch_sizes(self) -> list[int]:
        """The batch sizes a compiled model is warmed up on: every size up to max_batch_size (torch compiles a graph
        for a batch of one and one for larger batches, but a kernel choice of its own can split those further). With
        max_batch_size auto, which is measured after this, 1 and 2."""
        largest = self.batching[0]
        return [1, *range(largest if isinstance(largest, int) else 2, 1, -1)]

    @staticmethod
    def thread_counts(device: str) -> list[int]:
        """The torch thread counts a compiled model is warmed up on: the worker's, and on a CPU half of it too, which
        the worker runs its batches on while other requests are in flight (pod.py's rule)."""
        threads = torch.get_num_threads()
        return [threads] if device != "cpu" else sorted({threads, max(1, threads // 2)}, reverse=True)

    def batch(self, inputs: list[Any]) -> Batch:
        return Batch(self.runner.pixel_batch(inputs), [(image.shape[0], image.shape[1]) for image in inputs])

    def predict(self, batch: Batch) -> list[Any]:
        """One result per image, taken from the output on the device: pixels, a mask, scores or detections."""
        output = self.runner.forward(batch.pixels)
        padded = (batch.pixels.shape[1], batch.pixels.shape[2])
        with self.runner.conversion_threads(batch.pixels):
            return outputs.per_image(self.worker_kind, output, batch.sizes, padded)

    def unbatch(self, output: list[Any]) -> list[Any]:
        return output

    def example_request(self) -> Request:
        rng = np.random.default_rng(0)
        return Request.for_image(rng.integers(0, 256, (self.probe_side, self.probe_side, 3), dtype=np.uint8))

    def release_memory(self) -> None:
        self.runner.release()

    # In the front ends.
    def decode_request(self, request: Request) -> np.ndarray | EncodedImage:
        """The upload as the model's uint8 HxWx3 input, or (decoding in the worker) the upload with its header checked
        and how to cut it; the query parameters and how the input was cut from the upload stay in the request's
        context for the answer."""
        if request.protocol == "http":
            request.context["params"] = PredictParams.parse({**request.form, **request.query})
        encoded = request.encoded_image() if self.decode_in_worker else None
        if encoded is None:
            image = request.open_image(at_least=self.preprocess.least_side)  # a JPEG decoded no larger than needed
            pixels, request.context["geometry"] = self.preprocess(image)
            return pixels
        geometry = request.context["geometry"] = self.preprocess.geometry(encoded.width, encoded.height)
        return encoded.cut(geometry.resized, geometry.crop, self.preprocess.interpolation)

    def encode_response(self, output: Any, request: Request) -> Response | dict[str, Any]:
        geometry: Geometry = request.context["geometry"]
        if request.protocol == "v2":
            wanted = set(request.outputs) if request.outputs is not None else {spec.name for spec in self.outputs}
            return self.renderer.tensors(self.kind, output, geometry, request.parameters, wanted)
        params = request.context["params"]
        return self.renderer(self.kind, output, geometry, params, request.headers.get("accept", ""))
