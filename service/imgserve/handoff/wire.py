"""The messages between the server's processes, as msgpack: data, never code; and the sockets that carry them.

A request (front end -> workers) and an answer (worker -> front end) are small msgpack arrays carrying an item
(handoff/items.py): plain values, and as msgpack extension types an `InSlot` or `BytesInSlot` (the data lies in the
request's slot), a small numeric array (dtype, shape, raw bytes), an upload to decode in the worker (its header's
facts, what to cut of it, its bytes), and in answers an `ApiError`. Decoding checks
every field's type and bound, and anything else is a `WireError`: a datagram the receiver drops with a warning,
whoever sent it. Nothing is unpickled. The sockets are files in the server's private directory (0700), so no other
user can reach them.
"""

from __future__ import annotations

import contextlib
import math
import os
import socket
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

from imgserve import codec, tracing
from imgserve.codec import EncodedImage
from imgserve.errors import ApiError
from imgserve.handoff.items import ARRAY_KINDS, BytesInSlot, InSlot

ERROR, IN_SLOT, ARRAY, BYTES_IN_SLOT, ENCODED_IMAGE = 1, 2, 3, 4, 5  # the extension type codes
MAX_DIMENSIONS = 8
MAX_MODELS = 4096  # a model index is below this (the catalog checks its size against it)


class WireError(ValueError):
    """A message that is not one the server's own processes send."""


def bound_socket(address: str, receive_buffer: int) -> socket.socket:
    """A datagram socket bound at `address` (a path in the server's own directory, where a dead predecessor's socket
    file may still lie)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(address)
    receiver = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    receiver.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    receiver.bind(address)
    return receiver


@dataclass(frozen=True)
class RequestMessage:
    """One request as it travels to the workers: who queued it (front end and its uid for it), the slot that holds
    its data (index and the ticket of this use of it), its model (the catalog's index), when it was handed to the
    workers (decoded, queued) and by when it must be answered (time.monotonic(), the same clock in every process of
    the host), its item (handoff/items.py), and for a traced request its trace context and request id (tracing.carry;
    "" when it is not traced)."""

    front_end: int
    uid: str
    slot: int
    ticket: int
    model: int
    queued: float
    deadline: float
    item: Any
    trace: str = ""


def pack_request(message: RequestMessage) -> bytes:
    """[front end, uid, slot, ticket, model, queued, deadline, item, trace]; TypeError for an item value that cannot
    travel."""
    fields = [message.front_end, message.uid, message.slot, message.ticket, message.model]
    fields += [message.queued, message.deadline]
    packed: bytes = msgpack.packb([*fields, message.item, message.trace], default=_pack_value)
    return packed


def unpack_request(data: bytes) -> RequestMessage:
    """The request as the front end queued it (lists where it sent tuples), or WireError."""
    message = _unpack(data, ext_hook=_unpack_item_value)
    if not (isinstance(message, list) and len(message) == 9):
        raise WireError("a request is an array of 9")
    front_end, uid, slot, ticket, model, queued, deadline, item, trace = message
    _check(_is_int(front_end) and front_end >= 0 and isinstance(uid, str), "request header")
    _check(_is_int(slot) and slot >= 0 and _is_int(ticket) and ticket >= 0, "slot")
    _check(_is_int(model) and 0 <= model < MAX_MODELS, "model")
    _check(_is_time(queued) and _is_time(deadline), "deadline")
    _check(isinstance(trace, str) and (not trace or _is_carried(trace)), "trace context")
    return RequestMessage(front_end, uid, slot, ticket, model, queued, deadline, item, trace)


def pack_answer(uid: str, output: Any) -> bytes:
    """[uid, output]: an item (arrays and bytes in the slot) or an ApiError; TypeError for what cannot travel."""
    packed: bytes = msgpack.packb([uid, output], default=_pack_value)
    return packed


def unpack_answer(data: bytes) -> tuple[str, Any]:
    """(uid, output) as the worker sent them, or WireError."""
    message = _unpack(data, ext_hook=_unpack_value)
    if not (isinstance(message, list) and len(message) == 2 and isinstance(message[0], str)):
        raise WireError("an answer is an array of 2: uid, output")
    return message[0], message[1]


def _pack_value(value: Any) -> msgpack.ExtType:
    if isinstance(value, ApiError):
        return msgpack.ExtType(ERROR, msgpack.packb([value.status, value.code, value.message, value.retry_after]))
    if isinstance(value, InSlot):
        return msgpack.ExtType(IN_SLOT, msgpack.packb([value.offset, list(value.shape), value.dtype]))
    if isinstance(value, BytesInSlot):
        return msgpack.ExtType(BYTES_IN_SLOT, msgpack.packb([value.offset, value.length]))
    if isinstance(value, np.ndarray) and value.dtype.kind in ARRAY_KINDS:
        array = np.require(value, requirements="C")
        return msgpack.ExtType(ARRAY, msgpack.packb([array.dtype.str, list(array.shape), array.tobytes()]))
    if isinstance(value, np.generic) and value.dtype.kind in ARRAY_KINDS:
        return value.item()
    if isinstance(value, EncodedImage):
        facts = [value.format, value.width, value.height, value.resize, value.crop, value.interpolation]
        return msgpack.ExtType(ENCODED_IMAGE, msgpack.packb([*facts, value.data], default=_pack_value))
    raise TypeError(f"cannot send a {type(value).__name__} between processes")


def _unpack_value(code: int, data: bytes) -> Any:
    """An extension value of an answer: an item's, or an ApiError."""
    if code != ERROR:
        return _unpack_item_value(code, data)
    fields = _unpack(data, ext_hook=None)
    _check(isinstance(fields, list) and len(fields) == 4, "error")
    status, error_code, message, retry_after = fields
    _check(_is_int(status) and 400 <= status <= 599 and isinstance(error_code, str), "error")
    _check(isinstance(message, str) and (retry_after is None or _is_int(retry_after)), "error")
    return ApiError(status, error_code, message, retry_after)


def _unpack_item_value(code: int, data: bytes) -> Any:
    """An extension value of an item: where in the slot an array or bytes lie, or a small array."""
    if code == ENCODED_IMAGE:
        return _encoded_image(_unpack(data, ext_hook=_unpack_item_value))
    fields = _unpack(data, ext_hook=None)
    _check(isinstance(fields, list), "extension value")
    if code == IN_SLOT and len(fields) == 3:
        offset, shape, dtype = fields
        _check(_is_int(offset) and 0 <= offset < 2**40 and _is_shape(shape), "slot reference")
        return InSlot(offset, tuple(shape), _dtype(dtype).str)
    if code == BYTES_IN_SLOT and len(fields) == 2:
        _check(all(_is_int(value) and 0 <= value < 2**40 for value in fields), "slot reference")
        return BytesInSlot(*fields)
    if code == ARRAY and len(fields) == 3:
        dtype, shape, raw = _dtype(fields[0]), fields[1], fields[2]
        _check(_is_shape(shape) and isinstance(raw, bytes), "array")
        _check(math.prod(shape) * dtype.itemsize == len(raw), "array size")
        return np.frombuffer(bytearray(raw), dtype).reshape(shape)
    raise WireError(f"extension type {code}")


def _encoded_image(fields: Any) -> EncodedImage:
    """An upload to decode in the worker, every fact checked as `EncodedImage.cut` checks it."""
    _check(isinstance(fields, list) and len(fields) == 7, "encoded image")
    fmt, width, height, resize, crop, interpolation, data = fields
    _check(fmt in codec.ACCEPTED_FORMATS and _is_shape([width, height]) and width * height > 0, "encoded image")
    _check(resize is None or (_is_shape(resize) and len(resize) == 2 and 0 not in resize), "encoded image resize")
    _check(crop is None or (_is_shape(crop) and len(crop) == 4), "encoded image crop")
    _check(isinstance(data, bytes | BytesInSlot), "encoded image bytes")
    image = EncodedImage(data, fmt, width, height)
    try:
        return image.cut(tuple(resize) if resize else None, tuple(crop) if crop else None, interpolation)
    except ValueError:
        raise WireError("bad encoded image cut") from None


def _unpack(data: bytes, ext_hook: Any) -> Any:
    try:
        if ext_hook is None:
            return msgpack.unpackb(data, raw=False, strict_map_key=True)
        return msgpack.unpackb(data, raw=False, strict_map_key=True, ext_hook=ext_hook)
    except WireError:
        raise
    except Exception as exc:  # msgpack's own errors, and ValueError/TypeError from what it builds
        raise WireError(f"not a message: {type(exc).__name__}") from None


def _dtype(name: Any) -> np.dtype:
    _check(isinstance(name, str) and len(name) <= 8, "dtype")
    try:
        dtype: np.dtype = np.dtype(name)
    except TypeError:
        raise WireError("dtype") from None
    _check(dtype.kind in ARRAY_KINDS, "dtype")
    return dtype


def _is_carried(value: str) -> bool:
    """A trace context as tracing.carry writes it, and no longer."""
    return len(value) <= tracing.MAX_CARRIED and tracing.carried(value) is not None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_time(value: Any) -> bool:
    return isinstance(value, float) and math.isfinite(value)


def _is_shape(value: Any) -> bool:
    return (
        isinstance(value, list)
        and len(value) <= MAX_DIMENSIONS
        and all(_is_int(side) and 0 <= side < 2**31 for side in value)
    )


def _check(condition: bool, what: str) -> None:
    if not condition:
        raise WireError(f"bad {what}")
