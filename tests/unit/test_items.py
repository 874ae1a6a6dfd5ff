"""An item between processes (handoff/items.py and its wire format): what `decode_request` returns, or an output of
`predict`, goes through a real slot file and a packed message and comes back equal; references are aligned and never
overlap; a value that cannot travel is a TypeError that says where it is; a request whose references are not ones the
server's processes write is a WireError."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import torch

from imgserve.api import split
from imgserve.errors import ApiError
from imgserve.handoff import items, wire
from imgserve.handoff.items import ALIGN, BytesInSlot, InSlot
from imgserve.handoff.slots import SlotFiles

SLOT = 2
RNG = np.random.default_rng(31)


class Slot:
    """One real slot file (handoff/slots.py), as `place` writes it and `resolve` reads it; each write recorded."""

    def __init__(self, directory: Path) -> None:
        self.files = SlotFiles(directory)
        self.writes: list[tuple[int, int]] = []  # (offset, bytes)

    def write(self, array: np.ndarray, offset: int) -> None:
        self.writes.append((offset, array.nbytes))
        self.files.write(SLOT, array, offset)

    def read(self, offset: int, shape: tuple[int, ...], dtype: str) -> np.ndarray:
        return self.files.read(SLOT, shape, dtype, offset)


@pytest.fixture
def slot(tmp_path: Path) -> Slot:
    return Slot(tmp_path)


def arrays() -> dict[str, Any]:
    """Arrays of every kind that travels, in the layouts a decode makes: contiguous, views, Fortran order."""
    image = RNG.integers(0, 256, (17, 23, 3), dtype=np.uint8)
    return {
        "image": image,
        "mask": RNG.random((5, 7)) > 0.5,
        "f16": RNG.random(9).astype(np.float16),
        "f32": RNG.random((3, 4), dtype=np.float32),
        "f64": RNG.random((2, 2, 2)),
        "i8": np.arange(-5, 5, dtype=np.int8),
        "i64": np.arange(6, dtype=np.int64).reshape(2, 3) * 10**12,
        "u16": np.arange(7, dtype=np.uint16) * 9000,
        "big_endian": np.arange(5, dtype=">i4"),
        "view": image[::2, 1::3, 1],  # not contiguous
        "fortran": np.asfortranarray(RNG.random((4, 6))),
        "zero_d": np.array(3.25),
        "empty": np.zeros((0, 3), dtype=np.float32),
    }


def tree() -> dict[str, Any]:
    """A decoded item as a user's `decode_request` might return it."""
    return {
        **arrays(),
        "tensor": torch.arange(12, dtype=torch.float32).reshape(3, 4),
        "tensor_i64": torch.tensor([[1, -2], [3, -4]]),
        "with_grad": torch.ones(2, 3, requires_grad=True) * 2,
        "small_bytes": b"abc",
        "large_bytes": RNG.bytes(5000),
        "bytearray": bytearray(b"\x00\x01" * 700),
        "memoryview": memoryview(b"xyz" * 600),
        "plain": [None, True, False, 0, -3, 2**62, 2.5, float("inf"), "text", ""],
        "scalars": [np.float32(0.25), np.int64(7), np.bool_(True), np.uint8(200)],
        "pair": (np.ones(3, dtype=np.float32), "label"),
        "nested": {"deep": [[{"a": np.arange(4, dtype=np.int16)}, ()], {}]},
    }


def expected(value: Any) -> Any:
    """What arrives for `value`: tensors as numpy arrays, tuples as lists, numpy scalars as Python numbers, any
    bytes-like as bytes; nothing else changes."""
    if isinstance(value, torch.Tensor):
        return value.detach().numpy()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, bytearray | memoryview):
        return bytes(value)
    if isinstance(value, list | tuple):
        return [expected(item) for item in value]
    if isinstance(value, dict):
        return {key: expected(item) for key, item in value.items()}
    return value


def assert_same(got: Any, want: Any, where: str = "item") -> None:
    """Equal, with the same types all the way down (arrays: same dtype, shape and elements)."""
    if isinstance(want, np.ndarray):
        assert isinstance(got, np.ndarray), where
        assert (got.dtype, got.shape) == (want.dtype, want.shape), where
        assert np.array_equal(got, want), where
        return
    assert type(got) is type(want), f"{where}: {type(got).__name__} is not {type(want).__name__}"
    if isinstance(want, dict):
        assert got.keys() == want.keys(), where
        for key in want:
            assert_same(got[key], want[key], f"{where}[{key!r}]")
    elif isinstance(want, list):
        assert len(got) == len(want), where
        for index, (a, b) in enumerate(zip(got, want, strict=True)):
            assert_same(a, b, f"{where}[{index}]")
    else:
        assert got == want, where


def references(value: Any) -> list[InSlot | BytesInSlot]:
    if isinstance(value, InSlot | BytesInSlot):
        return [value]
    if isinstance(value, list):
        return [ref for item in value for ref in references(item)]
    if isinstance(value, dict):
        return [ref for item in value.values() for ref in references(item)]
    return []


def span(reference: InSlot | BytesInSlot) -> tuple[int, int]:
    size = reference.nbytes if isinstance(reference, InSlot) else reference.length
    return reference.offset, reference.offset + size


def test_a_tree_comes_back_equal_through_a_slot(slot: Slot) -> None:
    """Arrays of every dtype that travels, tensors, bytes small and large, plain values, nested containers."""
    original = tree()
    placed = items.place(original, slot.write, inline_bytes=1024)
    assert_same(items.resolve(placed, slot.read), expected(original))


def test_what_is_placed_lies_in_the_slot_and_only_small_bytes_stay_in_the_tree(slot: Slot) -> None:
    placed = items.place(tree(), slot.write, inline_bytes=1024)
    assert isinstance(placed["image"], InSlot) and placed["image"].shape == (17, 23, 3)
    assert placed["big_endian"].dtype == ">i4"
    assert isinstance(placed["tensor"], InSlot) and placed["tensor"].dtype == "<f4"
    assert isinstance(placed["large_bytes"], BytesInSlot) and placed["large_bytes"].length == 5000
    assert placed["small_bytes"] == b"abc"
    assert placed["plain"] == tree()["plain"]
    assert isinstance(placed["empty"], np.ndarray), "an empty array has no bytes to write"
    assert len(slot.writes) == len(references(placed))


def test_offsets_are_aligned_and_do_not_overlap(slot: Slot) -> None:
    placed = items.place(tree(), slot.write, inline_bytes=1024)
    spans = sorted(span(reference) for reference in references(placed))
    assert len(spans) > 10
    assert spans == sorted((offset, offset + size) for offset, size in slot.writes), "each reference was written"
    assert all(start % ALIGN == 0 for start, _ in spans)
    assert all(end <= following for (_, end), (following, _) in zip(spans, spans[1:], strict=False))
    assert spans[0][0] == 0
    assert spans[-1][1] < sum(end - start for start, end in spans) + ALIGN * len(spans), "one after another"


def test_values_under_the_inline_limits_travel_in_the_message(slot: Slot) -> None:
    small = np.arange(8, dtype=np.float64)  # 64 bytes
    placed = items.place(
        {"small": small, "large": np.zeros(200), "at": b"x" * 64, "over": b"x" * 65},
        slot.write,
        inline_bytes=64,
        inline_arrays=64,
    )
    assert isinstance(placed["small"], np.ndarray) and np.array_equal(placed["small"], small)
    assert isinstance(placed["large"], InSlot)
    assert placed["at"] == b"x" * 64 and isinstance(placed["over"], BytesInSlot)
    assert len(slot.writes) == 2


class Custom:
    pass


@pytest.mark.parametrize(
    ("value", "kind"),
    [
        ({"a": [1, np.array(["text", None], dtype=object)]}, "an array of object"),
        ({"a": [1, np.array(["text"])]}, "an array of <U4"),
        ({"a": [1, np.array([1 + 2j])]}, "an array of complex128"),
        ({"a": [1, {1, 2}]}, "a set"),
        ({"a": [1, {1: "one"}]}, "a dict with keys that are not strings"),
        ({"a": [1, Custom()]}, "a Custom"),
        ({"a": [1, 2 + 1j]}, "a complex"),
    ],
    ids=["object-array", "str-array", "complex-array", "set", "int-keys", "custom", "complex"],
)
def test_a_value_that_cannot_travel_is_a_type_error_that_says_where(slot: Slot, value: Any, kind: str) -> None:
    with pytest.raises(TypeError) as caught:
        items.place(value, slot.write)
    assert str(caught.value).startswith(f"the value['a'][1] is {kind}"), str(caught.value)


@pytest.mark.parametrize(
    "value", [torch.ones(3, dtype=torch.bfloat16), 2**64, -(2**63) - 1], ids=["bfloat16", "uint64+1", "int64-1"]
)
def test_a_value_place_accepts_also_travels_or_place_says_where(slot: Slot, value: Any) -> None:
    """What `place` accepts packs into a message and comes back equal (bfloat16, which numpy lacks, as float32);
    what it cannot carry is its TypeError, saying where."""
    try:
        placed = items.place({"a": [1, value]}, slot.write)
    except TypeError as exc:
        assert str(exc).startswith("the value['a'][1] is"), str(exc)
        return
    data = wire.pack_request(wire.RequestMessage(0, "uid", SLOT, 1, 0, 1.0, 2.0, placed))
    resolved = items.resolve(wire.unpack_request(data).item, slot.read)
    expected = value.float() if isinstance(value, torch.Tensor) else torch.as_tensor(value)
    assert resolved["a"][0] == 1 and torch.equal(torch.as_tensor(resolved["a"][1]), expected)


def test_a_placed_item_travels_in_a_request_message_and_resolves_in_the_worker(slot: Slot) -> None:
    """Front end: place into the slot, pack; worker: unpack the datagram, resolve from the same slot."""
    original = {key: value for key, value in tree().items() if key != "zero_d"}  # see the zero-dimensional test
    placed = items.place(original, slot.write, inline_bytes=1024, inline_arrays=64)
    assert isinstance(placed["i8"], np.ndarray), "a small array goes inline, as the wire's ARRAY value"
    data = wire.pack_request(wire.RequestMessage(0, "0.9", SLOT, 9, 0, 1.0, 10.0, placed))
    assert len(data) < 4096, "the large data stayed in the slot"
    received = wire.unpack_request(data)
    assert (received.front_end, received.uid, received.queued, received.slot) == (0, "0.9", 1.0, SLOT)
    assert references(received.item) == references(placed)
    resolved = items.resolve(received.item, slot.read)
    assert_same(resolved, expected(original))
    assert all(array.flags.writeable for array in resolved.values() if isinstance(array, np.ndarray)), (
        "predict may write into what it gets"
    )


def test_an_output_travels_in_an_answer_and_resolves_in_the_front_end(slot: Slot) -> None:
    output = {"boxes": RNG.random((300, 4), dtype=np.float32), "labels": ["cat", "dog"], "png": RNG.bytes(3000)}
    placed = items.place(output, slot.write, inline_bytes=1024, inline_arrays=1024)
    uid, answer = wire.unpack_answer(wire.pack_answer("uid", placed))
    assert_same(items.resolve(answer, slot.read), expected(output))


def test_a_zero_dimensional_output_keeps_its_shape_inline(slot: Slot) -> None:
    """One item's share of a batch of scores (the default unbatch of an N tensor) is 0-d, and arrives 0-d."""
    (score, _) = split(torch.tensor([0.25, 0.75]))
    placed = items.place(score, slot.write, inline_bytes=1024, inline_arrays=1024)
    uid, answer = wire.unpack_answer(wire.pack_answer("uid", placed))
    assert_same(items.resolve(answer, slot.read), np.array(0.25, dtype=np.float32))


def test_a_reference_past_what_the_slot_holds_is_an_error_not_garbage(slot: Slot) -> None:
    placed = items.place({"image": np.ones((4, 4, 3), dtype=np.uint8)}, slot.write)
    for beyond in (InSlot(4096, (4, 4, 3), "|u1"), BytesInSlot(0, 10_000)):
        with pytest.raises(ApiError) as caught:
            items.resolve({"image": beyond}, slot.read)
        assert (caught.value.status, caught.value.code) == (500, "slot_short")
    assert_same(items.resolve(placed, slot.read), {"image": np.ones((4, 4, 3), dtype=np.uint8)})


def hostile(value: Any) -> bytes:
    """A request datagram whose item holds `value` (built by hand, not by `wire.pack_request`)."""
    return msgpack.packb([0, "uid", 0, 1, 0, 1.0, 2.0, {"x": [value]}])


def ext(code: int, *fields: Any) -> msgpack.ExtType:
    return msgpack.ExtType(code, msgpack.packb(list(fields)))


@pytest.mark.parametrize(
    "value",
    [
        ext(wire.IN_SLOT, -64, [2, 2], "|u1"),
        ext(wire.IN_SLOT, 2**40, [2, 2], "|u1"),
        ext(wire.IN_SLOT, 2**64 - 1, [2, 2], "|u1"),
        ext(wire.IN_SLOT, 1.5, [2, 2], "|u1"),
        ext(wire.IN_SLOT, True, [2, 2], "|u1"),
        ext(wire.IN_SLOT, 0, [2, 2], "|O"),
        ext(wire.IN_SLOT, 0, [2, 2], "O"),
        ext(wire.IN_SLOT, 0, [2, 2], "<U4"),
        ext(wire.IN_SLOT, 0, [2, 2], "V8"),
        ext(wire.IN_SLOT, 0, [2, 2], "M8[s]"),
        ext(wire.IN_SLOT, 0, [2, 2], "<c16"),
        ext(wire.IN_SLOT, 0, [2, 2], "i4,i4"),
        ext(wire.IN_SLOT, 0, [2, 2], "not a dtype"),
        ext(wire.IN_SLOT, 0, [2, 2], 4),
        ext(wire.IN_SLOT, 0, [1] * (wire.MAX_DIMENSIONS + 1), "|u1"),
        ext(wire.IN_SLOT, 0, [[2, 2]], "|u1"),
        ext(wire.IN_SLOT, 0, [2, -1], "|u1"),
        ext(wire.IN_SLOT, 0, [2, 2**31], "|u1"),
        ext(wire.IN_SLOT, 0, 4, "|u1"),
        ext(wire.IN_SLOT, 0, [2, 2]),
        ext(wire.IN_SLOT, 0, [2, 2], "|u1", "extra"),
        ext(wire.BYTES_IN_SLOT, -1, 10),
        ext(wire.BYTES_IN_SLOT, 0, -10),
        ext(wire.BYTES_IN_SLOT, 2**40, 10),
        ext(wire.BYTES_IN_SLOT, 0, 2**40),
        ext(wire.BYTES_IN_SLOT, 0),
        ext(wire.ARRAY, "|O", [1], b"\x00" * 8),
        ext(wire.ARRAY, "<f4", [3], b"\x00" * 8),
        ext(wire.ARRAY, "<f4", [1] * (wire.MAX_DIMENSIONS + 1), b"\x00" * 4),
        ext(wire.ARRAY, "<f4", [1], "text"),
        ext(wire.ERROR, 500, "internal_error", "an error is an answer, never a request's item", None),
        ext(99, 1),
        msgpack.ExtType(wire.IN_SLOT, b"\xc1"),  # not msgpack inside
        msgpack.ExtType(wire.IN_SLOT, msgpack.packb({"offset": 0})),
    ],
)
def test_a_request_with_a_reference_the_server_never_writes_is_a_wire_error(value: Any) -> None:
    with pytest.raises(wire.WireError):
        wire.unpack_request(hostile(value))


def test_seeded_mutations_of_a_request_with_references_stay_in_bounds() -> None:
    """3000 mutations of a real request: each is a WireError, or every reference in it is one the worker can
    follow safely (offset and sizes bounded, at most MAX_DIMENSIONS, a dtype of numbers)."""
    rng = random.Random(31)
    placed = items.place(tree(), lambda array, offset: None, inline_bytes=1024, inline_arrays=64)
    seed = wire.pack_request(wire.RequestMessage(0, "uid", 0, 1, 0, 1.0, 2.0, placed))
    for _ in range(3000):
        data = bytearray(seed)
        for _ in range(rng.randrange(1, 4)):
            where = rng.randrange(len(data))
            data[where] = rng.randrange(256)
        try:
            received = wire.unpack_request(bytes(data))
        except wire.WireError:
            continue
        for reference in references(received.item):
            assert 0 <= reference.offset < 2**40
            if isinstance(reference, InSlot):
                assert len(reference.shape) <= wire.MAX_DIMENSIONS and min(reference.shape, default=0) >= 0
                assert np.dtype(reference.dtype).kind in items.ARRAY_KINDS
            else:
                assert 0 <= reference.length < 2**40


def test_the_worker_reads_an_item_as_views_of_its_slot_without_a_copy(slot: Slot) -> None:
    """The worker's arrays lie in the slot itself: what the front end writes there is what they hold, and a write
    to one lands in the slot (no second copy between the slot and the batch)."""
    original = {"image": RNG.integers(0, 256, (64, 48, 3), dtype=np.uint8), "scale": np.arange(10.0)}
    placed = items.place(original, slot.write)
    views = items.resolve(placed, lambda offset, shape, dtype: slot.files.view(SLOT, shape, dtype, offset))
    assert_same(views, original)
    views["image"][0, 0] = (1, 2, 3)
    assert (slot.read(placed["image"].offset, (64, 48, 3), "|u1")[0, 0] == (1, 2, 3)).all()
    grown = RNG.integers(0, 256, (512, 512, 3), dtype=np.uint8)  # a later request in the same slot, larger
    again = items.resolve(items.place(grown, slot.write), lambda o, s, d: slot.files.view(SLOT, s, d, o))
    assert_same(again, grown)


def test_an_output_that_still_lies_in_the_slot_is_copied_before_the_outputs_are_placed(slot: Slot) -> None:
    """An API that answers with (part of) its input: placing the outputs from offset 0 would overwrite that input
    while it is still being read, so `detached` copies exactly the outputs that share the slot's memory."""
    image = RNG.integers(0, 256, (32, 32, 3), dtype=np.uint8)
    placed = items.place({"scores": np.zeros(4096, np.float32), "image": image}, slot.write)
    views = items.resolve(placed, lambda offset, shape, dtype: slot.files.view(SLOT, shape, dtype, offset))
    fresh = np.ones(8000, dtype=np.float32)  # written first, over where the input's image lies
    output = [fresh, views["image"], torch.from_numpy(views["image"][::2])]
    own = items.detached(output, items.arrays_of(views))
    assert own[0] is fresh, "an output of its own is not copied"
    assert not np.may_share_memory(own[1], views["image"]) and not np.may_share_memory(own[2].numpy(), views["image"])
    answer = items.resolve(items.place(own, slot.write), slot.read)
    assert_same(answer[1], image)
    assert_same(answer[2], image[::2])
