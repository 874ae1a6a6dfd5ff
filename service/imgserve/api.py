"""Your own Python around your own model: `ImageAPI`, a LitServe API class whose hooks imgserve runs where they scale.

- `setup(device)` runs in each inference worker: load the model (`self.load_model(device)` shares its weights).
- `decode_request(request)` runs in the HTTP front ends, in parallel and off the worker: it gets one `Request` and
  returns what `predict` needs, arrays (numpy or CPU torch) and small plain values. The arrays travel to the worker
  in shared memory, never through a queue.
- `batch(items)`, `predict(batch)` and `unbatch(output)` run in the worker, on a batch gathered from every front
  end and bounded by the memory the worker measured at start on `example_request()`.
- `encode_response(output, request)` runs in the front end again: a dict (JSON), bytes with a media type, or a
  Starlette `Response`; for the Open Inference Protocol a dict of the declared outputs.

An `ApiError` (or LitServe's `HTTPException`) raised in a hook answers that request with its status; any other
exception answers that request 500 and never stops the process. docs/custom-api.md has the whole contract.
"""

from __future__ import annotations

import inspect
import json
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import litserve as ls
import numpy as np
import torch
from PIL import Image
from pydantic import BaseModel

from imgserve import codec
from imgserve.config import Settings
from imgserve.errors import ApiError

DEFAULT_MAX_IMAGE_PIXELS: int = Settings.model_fields["max_image_pixels"].default  # --max-image-pixels
EXAMPLE_SIDE = 256
IMAGE_TYPES = ("image/", "application/octet-stream")
FORM_TYPES = ("multipart/form-data", "application/x-www-form-urlencoded")


@dataclass(frozen=True)
class UploadedFile:
    """A file of a multipart upload: its form field, the file name and type the client gave, and its bytes."""

    field: str
    filename: str | None
    content_type: str | None
    data: bytes


@dataclass(frozen=True)
class TensorSpec:
    """One input or output as the Open Inference Protocol's metadata shows it: a name, a datatype (BYTES, UINT8,
    FP32, ...) and the dimensions of one item, without the batch dimension (-1: any length). Items whose tensors
    differ in shape are stacked into one tensor padded with `pad`; with `pad` None their shapes must match.

    `format` says an image input's layout, "NCHW" or "NHWC" (Triton's model configuration shows it; None: NHWC is
    guessed from dims (H, W, 1|3)). `binary` says whether a BYTES tensor holds binary data, base64 in JSON, or text,
    a JSON string as it is (UTF-8); None: binary for a tensor named `image` (the encoded image `Request.image()`
    reads), text for any other."""

    name: str
    datatype: str
    dims: tuple[int, ...]
    pad: float | None = None
    format: Literal["NCHW", "NHWC"] | None = None
    binary: bool | None = None

    def __post_init__(self) -> None:
        if self.format not in (None, "NCHW", "NHWC"):
            raise ValueError(f"TensorSpec {self.name!r}: format is 'NCHW' or 'NHWC', not {self.format!r}")
        if self.format is not None and len(self.dims) != 3:
            raise ValueError(f"TensorSpec {self.name!r}: an image format needs 3 dims (C, H, W or H, W, C)")

    @property
    def holds_binary(self) -> bool:
        """BYTES elements that are binary data (base64 in JSON), not text."""
        return self.binary if self.binary is not None else self.name == "image"


@dataclass
class Request:
    """What one call carried, as `decode_request` sees it in the front end.

    Over HTTP (/predict): the raw `body`, its `content_type`, the `query` parameters and `headers`, and for a
    multipart or urlencoded body its `files` and `form` fields. Over the Open Inference Protocol (HTTP or gRPC), one
    item of the batch the call carried: `inputs` maps each input's name to this item's row (BYTES as an object
    array of bytes), `outputs` the outputs asked for by name (None: all), `parameters` the request's parameters.
    `context` stays in the front end, for `encode_response` to read what `decode_request` wrote there.
    """

    protocol: Literal["http", "v2"] = "http"
    body: bytes = b""
    content_type: str = ""
    query: Mapping[str, str] = field(default_factory=dict)
    headers: Mapping[str, str] = field(default_factory=dict)
    files: Sequence[UploadedFile] = ()
    form: Mapping[str, str] = field(default_factory=dict)
    inputs: Mapping[str, np.ndarray] = field(default_factory=dict)
    outputs: Sequence[str] | None = None
    parameters: Mapping[str, Any] = field(default_factory=dict)
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    context: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def for_image(cls, pixels: np.ndarray, fmt: str = "png") -> Request:
        """A request carrying one image as its raw body (what `example_request` usually returns)."""
        return cls(body=codec.encode_image(pixels, fmt, 95), content_type=codec.OUTPUT_TYPES[fmt])

    def json(self) -> Any:
        """The body parsed as JSON (400 when it is not JSON)."""
        try:
            return json.loads(self.body)
        except (ValueError, RecursionError) as exc:
            raise ApiError(400, "bad_json", f"the body is not JSON: {exc}"[:300]) from None

    def file(self, name: str = "file") -> UploadedFile | None:
        """The uploaded file of the multipart field `name`, if any."""
        return next((upload for upload in self.files if upload.field == name), None)

    def encoded_image(self, name: str = "file") -> codec.EncodedImage | None:
        """The request's image left encoded, to be decoded in the worker next to its batch: the same upload as
        `open_image` takes, its header read and checked here as `open_image` checks it (400, 413, 415, 422), nothing
        decoded. `batch` then gets it as a uint8 HxWx3 torch tensor on the device (batched on a GPU). None for a v2
        `pixels` input, which is decoded already: take `image()` then."""
        if self.protocol == "v2":
            if "pixels" in self.inputs and "image" not in self.inputs:
                return None
            return codec.read_header(self._input_bytes(), self.max_image_pixels)
        return codec.read_header(self._upload(name), self.max_image_pixels)

    def image(self, name: str = "file") -> np.ndarray:
        """The request's image as uint8 HxWx3 RGB pixels, decoded strictly under the pixel limit (`open_image`)."""
        return np.asarray(self.open_image(name))

    def open_image(self, name: str = "file", at_least: int | None = None) -> Image.Image:
        """The request's image as an RGB Pillow image: over HTTP the multipart file `name` or a raw image body;
        over the Open Inference Protocol the `image` input (encoded, BYTES) or the `pixels` input (UINT8 HxWx3).
        Whatever the bytes, a 4xx ApiError rather than a crash (400 corrupt, 413 over the limit, 415, 422). With
        `at_least` (for a caller that scales the image down), a JPEG may be decoded smaller, each side still at least
        that: `codec.full_size(image)` is then the upload's own size."""
        if self.protocol == "v2":
            if "pixels" in self.inputs and "image" not in self.inputs:
                return codec.from_pixels(self.inputs["pixels"], self.max_image_pixels)
            return codec.open_image(self._input_bytes(), self.max_image_pixels, at_least)
        return codec.open_image(self._upload(name), self.max_image_pixels, at_least)

    def _upload(self, name: str) -> bytes:
        """Over HTTP, the image's bytes: the multipart file `name`, or the raw body."""
        if self.files or self.content_type in FORM_TYPES:
            upload = self.file(name)
            if upload is None:
                fields = ", ".join([*(f.field for f in self.files), *self.form]) or "none"
                raise ApiError(422, "missing_file", f"expected a multipart file field named {name!r} (got: {fields})")
            return upload.data
        if self.content_type.startswith(IMAGE_TYPES):
            return self.body
        raise ApiError(
            415,
            "unsupported_media_type",
            f"Content-Type {self.content_type or 'none'} is not accepted: send multipart/form-data with a "
            f"{name!r} field or the raw image with an image/* Content-Type",
        )

    def _input_bytes(self) -> bytes:
        """Over the Open Inference Protocol, the encoded image of the `image` input (a 400 for anything else)."""
        if "image" in self.inputs and "pixels" in self.inputs:
            raise ApiError(400, "bad_request", "send one input, 'image' (BYTES) or 'pixels' (UINT8), not both")
        if "image" in self.inputs:
            elements = self.inputs["image"].reshape(-1)
            if elements.size != 1 or not isinstance(elements[0], bytes):
                raise ApiError(400, "bad_request", "input 'image' is BYTES [N, 1]: one encoded image per item")
            data: bytes = elements[0]
            return data
        given = ", ".join(repr(name[:100]) for name in self.inputs) or "none"
        raise ApiError(400, "bad_request", f"send the input 'image' (BYTES) or 'pixels' (UINT8); got {given}")


@dataclass(frozen=True)
class Encoded:
    """An answer's bytes and their media type, for `encode_response` to return instead of a Starlette Response."""

    data: bytes
    media_type: str


class ImageAPI(ls.LitAPI):  # type: ignore[misc]  # litserve ships no type information: LitAPI is Any
    """The hooks of one served model, LitServe's names where they mean the same; see the module docstring.

    Class attributes a subclass may set: `name` (the model's name in the Open Inference Protocol; default the class
    name), `inputs` and `outputs` (its TensorSpecs: by default one encoded image in and one BYTES output holding the
    /predict answer), `labels` (class names, for the protocol's classification extension), `model` and
    `model_factory` (a model file that imgserve loads once per device and shares among the workers, see
    `load_model`), `group_by_shape` (False when your `batch` pads items of different shapes itself), and
    `request_model` (a pydantic model of the fields `decode_request` reads beside the image, from the query string or
    the form: /openapi.json and /docs list them), `response_types` (the media types `encode_response` answers
    with, for /openapi.json) and `precision` (what /info and imgserve_model_info say the model runs in).
    """

    name: ClassVar[str | None] = None
    inputs: ClassVar[tuple[TensorSpec, ...]] = (TensorSpec("image", "BYTES", (1,)),)
    outputs: ClassVar[tuple[TensorSpec, ...]] = (TensorSpec("output", "BYTES", (1,), binary=True),)
    labels: ClassVar[Sequence[str]] = ()
    model: ClassVar[str | None] = None
    model_factory: ClassVar[str | None] = None
    group_by_shape: ClassVar[bool] = True
    request_model: ClassVar[type[BaseModel] | None] = None
    response_types: ClassVar[tuple[str, ...]] = ("application/json",)
    precision: ClassVar[str | None] = None

    def __init__(
        self,
        max_batch_size: int | Literal["auto"] | None = None,
        batch_timeout: float | None = None,
        api_path: str = "/predict",
    ) -> None:
        """`max_batch_size` (a count or "auto": the largest that fits the memory measured at start) and
        `batch_timeout` (seconds a batch may wait to fill): None leaves them to the server's settings. `api_path` is
        where it answers over HTTP, as in LitServe."""
        with warnings.catch_warnings():  # LitServe warns about batch/unbatch without a max_batch_size: ours are fine
            warnings.simplefilter("ignore", UserWarning)
            super().__init__(
                max_batch_size=max_batch_size if isinstance(max_batch_size, int) else 1,
                batch_timeout=batch_timeout or 0.0,
                api_path=api_path,
            )
        self.batching: tuple[int | Literal["auto"] | None, float | None] = (max_batch_size, batch_timeout)
        self.model_loader: Callable[[str], torch.nn.Module] | None = None  # set by imgserve in each worker

    def setup(self, device: str) -> None:
        """In each inference worker, once: load the model onto `device` ("cpu" or "cuda:N")."""

    def decode_request(self, request: Request) -> Any:
        """In a front end: the request -> what `predict` needs of it (default: its image as uint8 HxWx3)."""
        return request.image()

    def batch(self, inputs: list[Any]) -> Any:
        """In the worker: the decoded items -> one batch (default: arrays and tensors stacked, leaf by leaf through
        tuples, lists and dicts; anything else as the list it is). imgserve gives it items whose arrays share their
        shapes unless `group_by_shape` is False."""
        return stack(inputs)

    def unbatch(self, output: Any) -> list[Any]:
        """In the worker: `predict`'s output -> one output per item (default: arrays and tensors split along the
        first dimension, leaf by leaf through tuples and dicts; a list is taken as one output per item already)."""
        return split(output)

    def encode_response(self, output: Any, request: Request) -> Any:
        """In a front end: one item's output -> the answer: a dict or list (JSON; arrays become lists), `Encoded`
        bytes, or a Starlette Response; for the Open Inference Protocol a dict of the declared outputs' values (or
        one value, for a single declared output). Default: the output as JSON."""
        return output

    def example_request(self) -> Request | None:
        """A typical request, decoded and run at start to measure the memory a batch needs (default: a 256x256
        image); None when there is nothing to measure: the batches are then bounded by their size alone."""
        return Request.for_image(np.full((EXAMPLE_SIDE, EXAMPLE_SIDE, 3), 128, dtype=np.uint8))

    def load_model(self, device: str) -> torch.nn.Module:
        """The module `model` and `model_factory` name, in eval mode on `device`, built around the one copy of its
        weights that every worker of the device shares. Call it from `setup`."""
        if self.model_loader is None:
            raise RuntimeError("load_model() works inside an imgserve inference worker (call it from setup)")
        return self.model_loader(device)

    def release_memory(self) -> None:
        """The worker is idle: drop whatever buffers the hooks keep for reuse (optional)."""

    def describe(self) -> str:
        """What /info and imgserve_model_info call the served model: its model file, else its class."""
        return self.model or f"{type(self).__module__}.{type(self).__qualname__}"


def hook_signature(hook: Callable[..., Any]) -> inspect.Signature:
    """A hook's signature with its annotations resolved where they are strings (a module with `from __future__ import
    annotations`): the types a plain LitAPI's route is registered with. Unresolvable ones stay strings."""
    try:
        return inspect.signature(hook, eval_str=True)
    except Exception:  # a name the hook's module cannot resolve at run time
        return inspect.signature(hook)


def encoder(api: ImageAPI) -> Callable[[Any, Request], Any]:
    """The API's `encode_response` called as `encode(output, request)`, whether it takes the request or not."""
    encode: Callable[..., Any] = api.encode_response
    parameters = [p for p in inspect.signature(encode).parameters.values() if p.kind != p.VAR_KEYWORD]
    if len(parameters) >= 2:
        return encode
    return lambda output, request: encode(output)


def stack(items: list[Any]) -> Any:
    """Items of the same structure -> one batch: arrays and tensors stacked along a new first dimension, leaf by
    leaf through tuples, lists and dicts; anything else as the list it is."""
    first = items[0]
    if isinstance(first, np.ndarray) and _same_shapes(items):
        return np.stack(items)
    if isinstance(first, torch.Tensor) and _same_shapes(items):
        return torch.stack(items)
    if isinstance(first, dict) and all(isinstance(item, dict) and item.keys() == first.keys() for item in items):
        return {key: stack([item[key] for item in items]) for key in first}
    if isinstance(first, tuple | list) and all(type(item) is type(first) and len(item) == len(first) for item in items):
        return type(first)(stack([item[index] for item in items]) for index in range(len(first)))
    return items


def split(output: Any) -> list[Any]:
    """A batch's output -> one output per item: arrays and tensors along their first dimension, tuples and dicts
    leaf by leaf; a list is already one output per item (LitServe's convention for `predict`)."""
    if isinstance(output, dict):
        columns = {key: split(value) for key, value in output.items()}
        lengths = {len(column) for column in columns.values()}
        if len(lengths) != 1:
            raise ValueError(f"the outputs in the dict have different batch sizes: {sorted(lengths)}")
        (length,) = lengths
        return [{key: column[index] for key, column in columns.items()} for index in range(length)]
    if isinstance(output, tuple):
        parts = [split(value) for value in output]
        return [tuple(part[index] for part in parts) for index in range(len(parts[0]))] if parts else []
    return list(output)


def _same_shapes(items: list[Any]) -> bool:
    shape = items[0].shape
    return all(type(item) is type(items[0]) and item.shape == shape for item in items)
