"""The protocol's in-memory request and response (what both wire formats convert to), and its tensor encodings.

HTTP bodies are parsed here: a JSON inference header, optionally followed by binary tensors (Triton's binary tensor
data extension: `Inference-Header-Content-Length`, `binary_data_size`), or a raw binary body (header length 0).
Binary tensors are little-endian, row-major; each BYTES element is a uint32 little-endian length, then the bytes.
In JSON a BYTES element is a string, as the protocol writes it: text as it is (UTF-8), or base64 where the model
declares the tensor binary (an encoded image: JSON strings cannot carry arbitrary bytes).
"""

from __future__ import annotations

import base64
import json
import math
import re
import struct
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from imgserve.errors import ApiError

DTYPES: dict[str, np.dtype] = {
    name: np.dtype(kind).newbyteorder("<")
    for name, kind in {
        "BOOL": "?",
        "UINT8": "u1",
        "UINT16": "u2",
        "UINT32": "u4",
        "UINT64": "u8",
        "INT8": "i1",
        "INT16": "i2",
        "INT32": "i4",
        "INT64": "i8",
        "FP16": "f2",
        "FP32": "f4",
        "FP64": "f8",
    }.items()
}
MAX_TENSORS = 16
MAX_DIMENSIONS = 8
STRING_ALLOWANCE = 4096  # JSON strings a request may hold beside its BYTES elements: keys, names, parameters
_LENGTH = struct.Struct("<I")
# The shared-memory extensions (system and CUDA) are not served: a client's region is memory on the server's host
# that the server would map at a caller's word, and imgserve is served over the network from a pod.
NO_SHARED_MEMORY = "shared memory is not supported by this server: send the tensors in the request"
_DIGITS = re.compile(r"[0-9]{1,15}")


@dataclass
class Tensor:
    """A named tensor: numbers as a numpy array of its shape, BYTES as a flat list of bytes (row-major)."""

    name: str
    datatype: str
    shape: list[int]
    data: np.ndarray | list[bytes]
    text: bool = False  # BYTES that are text (classification): JSON carries them as strings, not base64


@dataclass
class RequestedOutput:
    """An output the client asked for, and how: binary or JSON, and the classification extension's top k."""

    name: str
    binary: bool
    classification: int | None = None


@dataclass
class InferRequest:
    """One inference request, whatever protocol carried it."""

    inputs: list[Tensor]
    outputs: list[RequestedOutput] | None = None  # None: the model's default outputs
    parameters: dict[str, Any] = field(default_factory=dict)
    id: str | None = None
    binary_outputs: bool = False  # binary_data_output: every output binary unless it says otherwise
    raw: bytes | None = None  # a raw binary request's body: the model's first input, one item (see from_raw)


class _InputModel(BaseModel):
    name: str = Field(max_length=256)
    shape: list[int] = Field(max_length=MAX_DIMENSIONS)
    datatype: str = Field(max_length=16)
    parameters: dict[str, Any] = {}
    data: Any = None


class _OutputModel(BaseModel):
    name: str = Field(max_length=256)
    parameters: dict[str, Any] = {}


class _RequestModel(BaseModel):
    """The JSON inference header; unknown top-level keys (KServe's client sends model_name) are ignored."""

    model_config = ConfigDict(extra="ignore")

    id: str | None = Field(None, max_length=256)
    parameters: dict[str, Any] = {}
    inputs: list[_InputModel] = Field(min_length=1, max_length=MAX_TENSORS)
    outputs: list[_OutputModel] | None = Field(None, max_length=MAX_TENSORS)


def bad(message: str) -> ApiError:
    """A 400 for a request the protocol cannot read."""
    return ApiError(400, "bad_request", message[:300])


def not_supported(message: str) -> ApiError:
    """A 501 (gRPC UNIMPLEMENTED): what Triton answers for an extension it does not serve."""
    return ApiError(501, "not_supported", message[:300])


def check_in_request(name: str, parameters: Mapping[str, Any]) -> None:
    """501 for a tensor whose data is said to lie in a shared-memory region (NO_SHARED_MEMORY says why)."""
    if "shared_memory_region" in parameters:
        raise not_supported(f"tensor {name[:100]!r}: {NO_SHARED_MEMORY}")


def parse_http(
    body: bytes, header_length: str | None, max_elements: int | None = None, base64_inputs: Collection[str] = ()
) -> InferRequest:
    """An HTTP infer body -> InferRequest; `header_length` is the Inference-Header-Content-Length header. Every BYTES
    input holds at most `max_elements` elements (413 beyond), checked from its shape before anything is unpacked.
    The BYTES inputs named in `base64_inputs` are base64 in JSON; any other is text."""
    if header_length is None:
        header, binary = body, b""
    else:
        length = _header_length(header_length, len(body))
        if length == 0:  # a raw binary request: the body is the model's first input, one item, answered binary
            return InferRequest([], binary_outputs=True, raw=body)
        header, binary = body[:length], body[length:]
    model = _header(header, max_elements)
    inputs, offset = [], 0
    for item in [*model.inputs, *(model.outputs or ())]:
        check_in_request(item.name, item.parameters)
    for item in model.inputs:
        check_elements(item.name, item.datatype, item.shape, max_elements)
        size = item.parameters.get("binary_data_size")
        if size is None:
            inputs.append(from_json(item.name, item.datatype, item.shape, item.data, item.name in base64_inputs))
            continue
        if not isinstance(size, int) or size < 0 or offset + size > len(binary):
            raise bad(f"input {item.name!r}: binary_data_size {size!r} runs past the body's binary data")
        inputs.append(from_binary(item.name, item.datatype, item.shape, binary[offset : offset + size]))
        offset += size
    if offset != len(binary):
        raise bad(f"{len(binary) - offset} bytes of binary data after the last binary input")
    outputs = None
    if model.outputs is not None:
        binary_default = model.parameters.get("binary_data_output") is True
        outputs = [
            RequestedOutput(o.name, o.parameters.get("binary_data", binary_default) is True, _top_k(o))
            for o in model.outputs
        ]
    return InferRequest(inputs, outputs, model.parameters, model.id, model.parameters.get("binary_data_output") is True)


def _header_length(value: str, body_length: int) -> int:
    """Inference-Header-Content-Length: ASCII digits only (str.isdigit() also takes '²' and '١'), within the body."""
    value = value.strip()
    if not _DIGITS.fullmatch(value) or int(value) > body_length:
        raise bad(f"Inference-Header-Content-Length {value[:20]!r} is not a length within the body")
    return int(value)


def json_length(body_length: int, header_length: str | None) -> int:
    """How many bytes of an HTTP infer body are JSON (what parsing it costs): what the header says, else all."""
    value = (header_length or "").strip()
    return min(int(value), body_length) if _DIGITS.fullmatch(value) else body_length


def _header(header: bytes, max_elements: int | None) -> _RequestModel:
    """The JSON inference header, validated; 413 before parsing when it holds more strings than any request whose
    BYTES inputs fit `max_elements` could (each BYTES element is one JSON string)."""
    if max_elements is not None and header.count(b'"') > 2 * (max_elements + STRING_ALLOWANCE):
        raise ApiError(413, "too_many_images", f"the inference request holds more strings than {max_elements} images")
    try:
        document = json.loads(header)
    except RecursionError:
        raise bad("the inference request is nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad(f"the inference request is not JSON: {exc}") from None
    try:
        return _RequestModel.model_validate(document)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()[:3])
        raise bad(f"the inference request is not valid: {problems}") from None
    except RecursionError:
        raise bad("the inference request is nested too deeply") from None


def check_elements(name: str, datatype: str, shape: list[int], max_elements: int | None) -> None:
    """413 when a BYTES tensor of `shape` has more than `max_elements` elements (None: no limit); call it before
    unpacking, so that the work a request causes is bounded by the limit, not by what its data claims."""
    if datatype != "BYTES" or max_elements is None:
        return
    count = elements(shape)
    if count > max_elements:
        message = f"input {name[:100]!r}: {count} BYTES elements are more than this server takes ({max_elements})"
        raise ApiError(413, "too_many_images", message)


def _top_k(output: _OutputModel) -> int | None:
    k = output.parameters.get("classification")
    if k is None:
        return None
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise bad(f"output {output.name!r}: classification must be a positive integer")
    return k


def from_raw(name: str, datatype: str, dims: tuple[int, ...], body: bytes) -> Tensor:
    """A raw binary request's body as one item of the input declared `datatype` [N, *dims] (extension_binary_data.md,
    "Raw Binary Request"): BYTES is the one element [1, 1]; any other datatype has the declared dims, its one
    variable dimension, if any, deduced from the body's size (400 where the size cannot say the shape)."""
    if datatype == "BYTES":
        return Tensor(name, "BYTES", [1, 1], [_raw_element(body)])
    itemsize = _dtype(name, datatype).itemsize
    variable = [index for index, size in enumerate(dims) if size < 0]
    known = math.prod(size for size in dims if size >= 0) * itemsize
    shape = [1, *dims]
    if len(variable) > 1 or (variable and (known == 0 or len(body) % known)):
        declared = f"{datatype} {[-1, *dims]}"
        raise bad(f"input {name!r} is {declared}: a raw binary body of {len(body)} bytes cannot say its shape")
    if variable:
        shape[1 + variable[0]] = len(body) // known
    return from_binary(name, datatype, shape, body)


def _raw_element(body: bytes) -> bytes:
    """A raw binary body: one serialized BYTES element (length-prefixed), or the image's bytes as they are."""
    if len(body) >= 4 and _LENGTH.unpack_from(body)[0] == len(body) - 4:
        return body[4:]
    return body


def elements(shape: list[int]) -> int:
    """How many elements a tensor of `shape` has (400 for a negative dimension)."""
    if any(not isinstance(d, int) or d < 0 for d in shape):
        raise bad(f"shape {shape} has a negative dimension")
    return math.prod(shape)


def from_binary(name: str, datatype: str, shape: list[int], raw: bytes) -> Tensor:
    """A tensor from its binary form."""
    count = elements(shape)
    if datatype == "BYTES":
        return from_elements(name, shape, unpack_bytes(raw, name, count))
    dtype = _dtype(name, datatype)
    if len(raw) != count * dtype.itemsize:
        raise bad(f"input {name!r}: {len(raw)} bytes of data for shape {shape} of {datatype}")
    return Tensor(name, datatype, shape, np.frombuffer(raw, dtype=dtype).reshape(shape))


def from_json(name: str, datatype: str, shape: list[int], data: Any, binary: bool = False) -> Tensor:
    """A tensor from JSON `data` (flat or nested row-major lists). BYTES elements are strings: base64 when the input
    is `binary`, else text, taken as its UTF-8 bytes."""
    if data is None:
        raise bad(f"input {name!r} has neither data nor parameters.binary_data_size")
    flat = _flatten(data if isinstance(data, list) else [data])
    if datatype != "BYTES":
        if datatype == "FP16":
            raise bad(f"input {name!r}: FP16 cannot travel as JSON; send it as binary data")
        return from_numbers(name, datatype, shape, flat)
    if not all(isinstance(item, str) for item in flat):
        raise bad(f"input {name!r}: BYTES data must be strings")
    if not binary:
        try:
            return from_elements(name, shape, [item.encode() for item in flat])
        except UnicodeEncodeError:  # a lone surrogate, such as "\\ud800" in the JSON: no text
            raise bad(f"input {name!r}: a BYTES string is not valid Unicode text") from None
    try:
        values = [base64.b64decode(item, validate=True) for item in flat]
    except ValueError:  # binascii.Error, or a character outside ASCII
        raise bad(f"input {name!r} holds binary data: its BYTES strings must be base64 in JSON") from None
    return from_elements(name, shape, values)


def from_elements(name: str, shape: list[int], values: list[bytes]) -> Tensor:
    """A BYTES tensor from its elements."""
    return Tensor(name, "BYTES", shape, _check_count(name, shape, values))


def from_numbers(name: str, datatype: str, shape: list[int], values: list[Any]) -> Tensor:
    """A numeric tensor from a flat list of numbers, each checked to fit the datatype: integer datatypes take
    integers only (not NaN, Inf or 1.5), within the datatype's range."""
    dtype = _dtype(name, datatype)
    integral = dtype.kind in "uib"
    kinds = int if integral else int | float
    if not all(isinstance(item, kinds) for item in values):
        raise bad(f"input {name!r}: {datatype} data must be {'integers' if integral else 'numbers'}")
    try:
        array = np.array(values, dtype=np.int64 if integral else np.float64)
    except OverflowError:
        raise bad(f"input {name!r}: a value is out of range for {datatype}") from None
    if dtype.kind in "ui" and array.size and (array.min() < np.iinfo(dtype).min or array.max() > np.iinfo(dtype).max):
        raise bad(f"input {name!r}: a value is out of range for {datatype}")
    return Tensor(name, datatype, shape, _check_count(name, shape, array.astype(dtype)).reshape(shape))


def _flatten(data: list[Any], depth: int = 0) -> list[Any]:
    if depth > MAX_DIMENSIONS:
        raise bad(f"data is nested deeper than {MAX_DIMENSIONS} dimensions")
    flat: list[Any] = []
    for item in data:
        if isinstance(item, list):
            flat.extend(_flatten(item, depth + 1))
        else:
            flat.append(item)
    return flat


def _dtype(name: str, datatype: str) -> np.dtype:
    if datatype not in DTYPES:
        raise bad(f"input {name!r}: unknown datatype {datatype[:16]!r}")
    return DTYPES[datatype]


def _check_count(name: str, shape: list[int], values: Any) -> Any:
    if len(values) != elements(shape):
        raise bad(f"input {name!r}: {len(values)} elements for shape {shape}")
    return values


def unpack_bytes(raw: bytes, name: str, count: int | None = None) -> list[bytes]:
    """Serialized BYTES (uint32 LE length, then the bytes, per element) -> the elements; with `count`, exactly that
    many (400 otherwise), and never more than `count` are unpacked."""
    values: list[bytes] = []
    offset = 0
    while offset < len(raw):
        if count is not None and len(values) == count:
            raise bad(f"input {name!r}: BYTES data holds more than the {count} elements of its shape")
        if offset + 4 > len(raw):
            raise bad(f"input {name!r}: BYTES data ends inside an element's length")
        (length,) = _LENGTH.unpack_from(raw, offset)
        offset += 4
        if offset + length > len(raw):
            raise bad(f"input {name!r}: a BYTES element of {length} bytes runs past the data")
        values.append(raw[offset : offset + length])
        offset += length
    return values


def pack_bytes(values: list[bytes]) -> bytes:
    """BYTES elements -> their serialized form."""
    return b"".join(_LENGTH.pack(len(value)) + value for value in values)


def raw(tensor: Tensor) -> bytes:
    """A tensor's binary form."""
    if tensor.datatype == "BYTES":
        return pack_bytes(tensor.data)  # type: ignore[arg-type]
    return np.ascontiguousarray(tensor.data, dtype=DTYPES[tensor.datatype]).tobytes()


def nbytes(tensor: Tensor) -> int:
    """The size of a tensor's data."""
    if tensor.datatype == "BYTES":
        return sum(map(len, tensor.data))
    return tensor.data.nbytes  # type: ignore[union-attr]


def json_data(tensor: Tensor) -> list[Any]:
    """A tensor's JSON `data`: flat, row-major; BYTES as text or base64 (500 for text that is not UTF-8)."""
    if tensor.datatype == "BYTES":
        if not tensor.text:
            return [base64.b64encode(value).decode("ascii") for value in tensor.data]
        try:
            return [value.decode("utf-8") for value in tensor.data]
        except UnicodeDecodeError:
            message = f"output {tensor.name!r} is declared text, but encode_response gave bytes that are not UTF-8"
            raise ApiError(500, "api_error", f"{message} (declare it TensorSpec(..., binary=True))") from None
    values: list[Any] = np.asarray(tensor.data).reshape(-1).tolist()
    return values
