"""The hand-off messages (handoff/wire.py): what the server's processes send round-trips; anything else, from seeded
mutations of real messages to pickles, is a WireError and never builds more than plain data."""

from __future__ import annotations

import pickle
import random

import msgpack
import numpy as np
import pytest

from imgserve.codec import EncodedImage
from imgserve.errors import ApiError
from imgserve.handoff import wire
from imgserve.handoff.items import BytesInSlot, InSlot

UPLOAD = EncodedImage(BytesInSlot(786432, 52000), "JPEG", 500, 375, (341, 256), (58, 16, 224, 224), "bicubic")
ITEM = {
    "image": InSlot(0, (512, 512, 3), "|u1"),
    "threshold": 0.5,
    "box": [1, 2, 3, 4],
    "name": "cat",
    "upload": UPLOAD,  # decoded in the worker
    "small": EncodedImage(b"\x89PNG...", "PNG", 4, 3),
}
TRACE = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01 req-42"  # tracing.carry's: traceparent, request id
REQUEST = wire.RequestMessage(1, "3f2a-uid", 3, 17, 2, 11.0, 42.0, ITEM, TRACE)
PLAIN = [1, "uid", 3, 17, 2, 11.0, 42.0, {"threshold": 0.5}, ""]  # a request plain msgpack can pack, to break by hand
OUTPUTS = [
    InSlot(0, (512, 512, 3), "|u1"),
    {"mask": InSlot(786432, (512, 512), "|u1"), "png": BytesInSlot(1048576, 40000), "scores": [0.1, 0.9]},
    ApiError(503, "overloaded", "the queue is full", 1),
    np.arange(12, dtype=np.float32).reshape(3, 4),
    [0.25, 0.75],
    {"count": 3},
    None,
]


def test_requests_and_answers_round_trip() -> None:
    assert wire.unpack_request(wire.pack_request(REQUEST)) == REQUEST
    untraced = wire.RequestMessage(1, "3f2a-uid", 3, 17, 2, 11.0, 42.0, ITEM)
    assert wire.unpack_request(wire.pack_request(untraced)).trace == ""
    for output in OUTPUTS:
        uid, got = wire.unpack_answer(wire.pack_answer("3f2a-uid", output))
        assert uid == "3f2a-uid"
        if isinstance(output, np.ndarray):
            assert got.dtype == output.dtype and (got == output).all()
        elif isinstance(output, ApiError):
            assert (got.status, got.code, got.message, got.retry_after) == (503, "overloaded", "the queue is full", 1)
        else:
            assert got == output


def test_a_value_the_wire_does_not_carry_is_refused_when_sent() -> None:
    for value in (object(), np.array(["text"], dtype=object), {1, 2}):
        with pytest.raises(TypeError):
            wire.pack_answer("uid", value)


BAD_UPLOADS = [  # an EncodedImage's fields: format, width, height, resize, crop, interpolation, bytes
    ["JPEG", 500, 375, None, None, "bilinear"],  # no bytes
    ["EXE", 500, 375, None, None, "bilinear", b"MZ"],  # not an accepted format
    ["JPEG", 0, 375, None, None, "bilinear", b"x"],  # no pixels
    ["JPEG", 500, 375, [0, 10], None, "bilinear", b"x"],  # resized to nothing
    ["JPEG", 500, 375, None, [400, 0, 200, 100], "bilinear", b"x"],  # cropped outside
    ["JPEG", 500, 375, None, None, "lanczos", b"x"],
    ["JPEG", 500, 375, None, None, "bilinear", "text"],
    ["JPEG", 500, 375, None, None, "bilinear", [1, 2]],
]


@pytest.mark.parametrize(
    "data",
    [
        pickle.dumps(REQUEST),
        msgpack.packb([*PLAIN[:7], {1: 2}, ""]),  # keys are strings
        msgpack.packb(PLAIN[:3]),
        msgpack.packb([*PLAIN[:5], float("nan"), *PLAIN[6:]]),
        msgpack.packb([True, *PLAIN[1:]]),
        msgpack.packb(PLAIN[:7]),  # neither item nor trace context
        msgpack.packb([*PLAIN[:2], [1], *PLAIN[3:]]),
        msgpack.packb([*PLAIN[:2], -1, *PLAIN[3:]]),
        msgpack.packb([*PLAIN[:4], -1, *PLAIN[5:]]),  # no such model
        msgpack.packb([*PLAIN[:4], 10**6, *PLAIN[5:]]),
        msgpack.packb([*PLAIN[:6], "soon", *PLAIN[7:]]),
        msgpack.packb(PLAIN[:8]),  # no trace context: a message of the code before it
        msgpack.packb([*PLAIN[:8], None]),
        msgpack.packb([*PLAIN[:8], TRACE + "x" * 200]),  # over the bound
        msgpack.packb([*PLAIN[:8], TRACE.replace("req-42", "req\r\nX-Evil: 1")]),  # control characters
        msgpack.packb([*PLAIN[:8], TRACE.replace("req-42", "r\u00e9q")]),  # not ASCII
        msgpack.packb([*PLAIN[:8], "00-" + "0" * 32 + "-b7ad6b7169203331-01 req"]),  # the invalid trace id
        msgpack.packb([*PLAIN[:8], "not a traceparent"]),
        b"",
        *(
            msgpack.packb([*PLAIN[:7], {"upload": msgpack.ExtType(wire.ENCODED_IMAGE, msgpack.packb(fields))}, ""])
            for fields in BAD_UPLOADS
        ),
    ],
)
def test_what_is_not_a_request_is_a_wire_error(data: bytes) -> None:
    with pytest.raises(wire.WireError):
        wire.unpack_request(data)


@pytest.mark.parametrize(
    ("code", "fields"),
    [
        (wire.ARRAY, ["|O", [1], b"\x00" * 8]),  # object arrays hold Python objects
        (wire.ARRAY, ["<f4", [3], b"\x00" * 8]),  # the size does not match the shape
        (wire.ERROR, [200, "ok", "not an error", None]),
        (wire.IN_SLOT, [0, [2, 2], "<U4"]),
        (wire.IN_SLOT, [[2, 2], "|u1"]),  # no offset
        (wire.BYTES_IN_SLOT, [0, -1]),
        (99, [1]),
    ],
)
def test_an_answer_with_a_bad_value_is_a_wire_error(code: int, fields: list) -> None:
    data = msgpack.packb(["uid", msgpack.ExtType(code, msgpack.packb(fields))])
    with pytest.raises(wire.WireError):
        wire.unpack_answer(data)


def test_seeded_mutations_of_real_messages_are_answers_or_wire_errors() -> None:
    """5000 mutations (flipped, cut, inserted, duplicated bytes): each parses to plain data or is a WireError."""
    rng = random.Random(29)
    seeds = [wire.pack_request(REQUEST)] + [wire.pack_answer("uid", output) for output in OUTPUTS]
    plain = (type(None), bool, int, float, str, bytes, list, dict, tuple, np.ndarray, InSlot, BytesInSlot, ApiError)
    for _ in range(5000):
        data = bytearray(rng.choice(seeds))
        for _ in range(rng.randrange(1, 4)):
            if not data:
                break
            where = rng.randrange(len(data))
            match rng.randrange(4):
                case 0:
                    data[where] = rng.randrange(256)
                case 1:
                    del data[where:]
                case 2:
                    data[where:where] = rng.randbytes(rng.randrange(1, 9))
                case _:
                    data[where:where] = data[where : where + rng.randrange(1, 16)]
        for unpack in (wire.unpack_request, wire.unpack_answer):
            try:
                message = unpack(bytes(data))
            except wire.WireError:
                continue
            parts = vars(message).values() if isinstance(message, wire.RequestMessage) else message
            assert all(isinstance(part, plain) for part in parts)
