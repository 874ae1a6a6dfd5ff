"""An item between processes: what `decode_request` returned for one request (front end -> worker), or one output
of `predict` (worker -> front end).

An item is a tree of plain values (None, bool, int, float, str, bytes, lists, tuples, dicts with str keys), arrays
(numpy, or torch tensors, which become numpy on the CPU) and uploads to decode in the worker (codec.EncodedImage,
whose bytes travel as bytes do). `place` writes its arrays, and bytes of more than
`inline_bytes`, into the request's slot one after another and leaves a small reference (`InSlot`, `BytesInSlot`) in
their place; the tree that remains travels in the message, as msgpack (`wire`). `resolve` reads them back. Tuples
arrive as lists; nothing else is changed on the way.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch

from imgserve.codec import EncodedImage

Leaf = TypeVar("Leaf")

ALIGN = 64  # each array starts at a multiple of this many bytes in the slot
ARRAY_KINDS = "biuf"  # booleans, integers, floats: nothing that holds Python objects
PLAIN = (type(None), bool, int, float, str)


@dataclass(frozen=True)
class InSlot:
    """An array that lies in the request's slot: where, its shape and dtype."""

    offset: int
    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * np.dtype(self.dtype).itemsize


@dataclass(frozen=True)
class BytesInSlot:
    """Bytes that lie in the request's slot."""

    offset: int
    length: int


Write = Callable[[np.ndarray, int], None]  # write(array, offset)
Read = Callable[[int, tuple[int, ...], str], np.ndarray]  # read(offset, shape, dtype) -> a new array


def place(tree: Any, write: Write, inline_bytes: int = 0, inline_arrays: int = 0) -> Any:
    """The tree with its arrays over `inline_arrays` bytes and its bytes over `inline_bytes` written through `write`
    (at increasing offsets) and replaced by references; TypeError for a value that cannot travel."""
    end = 0

    def visit(value: Any, where: str) -> Any:
        nonlocal end
        if isinstance(value, torch.Tensor):
            value = value.detach().cpu()
            value = (value.float() if value.dtype == torch.bfloat16 else value).numpy()  # numpy has no bfloat16
        if isinstance(value, np.generic) and value.dtype.kind in ARRAY_KINDS:
            return value.item()
        if isinstance(value, np.ndarray):
            if value.dtype.kind not in ARRAY_KINDS:
                raise TypeError(f"{where} is an array of {value.dtype}: only numbers and booleans travel")
            if value.nbytes <= inline_arrays:
                return np.require(value, requirements="C")  # ascontiguousarray would make a 0-d array 1-d
            offset = _aligned(end)
            write(value, offset)
            end = offset + value.nbytes
            return InSlot(offset, tuple(value.shape), value.dtype.str)
        if isinstance(value, bytes | bytearray | memoryview):
            data = bytes(value)
            if len(data) <= inline_bytes:
                return data
            offset = _aligned(end)
            write(np.frombuffer(data, dtype=np.uint8), offset)
            end = offset + len(data)
            return BytesInSlot(offset, len(data))
        if isinstance(value, EncodedImage):
            return dataclasses.replace(value, data=visit(bytes(value.data), f"{where}'s bytes"))
        if isinstance(value, int) and not isinstance(value, bool) and not -(2**63) <= value < 2**64:
            raise TypeError(f"{where} is an integer beyond 64 bits")
        if isinstance(value, PLAIN):
            return value
        if isinstance(value, list | tuple):
            return [visit(item, f"{where}[{index}]") for index, item in enumerate(value)]
        if isinstance(value, dict):
            if not all(isinstance(key, str) for key in value):
                raise TypeError(f"{where} is a dict with keys that are not strings")
            return {key: visit(item, f"{where}[{key!r}]") for key, item in value.items()}
        raise TypeError(f"{where} is a {type(value).__name__}, which cannot travel between processes")

    return visit(tree, "the value")


def resolve(tree: Any, read: Read) -> Any:
    """The tree with every reference replaced by what it refers to, read through `read`."""
    if isinstance(tree, InSlot):
        return read(tree.offset, tree.shape, tree.dtype)
    if isinstance(tree, BytesInSlot):
        return read(tree.offset, (tree.length,), "|u1").tobytes()
    if isinstance(tree, EncodedImage):
        return dataclasses.replace(tree, data=resolve(tree.data, read))
    if isinstance(tree, list):
        return [resolve(item, read) for item in tree]
    if isinstance(tree, dict):
        return {key: resolve(item, read) for key, item in tree.items()}
    return tree


def arrays_of(tree: Any) -> list[np.ndarray]:
    """The arrays among a tree's leaves."""
    return leaves_of(tree, np.ndarray)


def leaves_of(tree: Any, kind: type[Leaf]) -> list[Leaf]:
    """The leaves of a tree (lists, tuples and dicts) that are of `kind`, in order."""
    if isinstance(tree, kind):
        return [tree]
    if isinstance(tree, list | tuple):
        return [leaf for item in tree for leaf in leaves_of(item, kind)]
    if isinstance(tree, dict):
        return [leaf for item in tree.values() for leaf in leaves_of(item, kind)]
    return []


def detached(tree: Any, inputs: list[np.ndarray]) -> Any:
    """The tree with each array or CPU tensor that may share memory with one of `inputs` replaced by a copy (an
    output that still lies in its request's slot, which placing the outputs would overwrite)."""
    if not inputs:
        return tree
    if isinstance(tree, torch.Tensor) and tree.device.type == "cpu" and tree.dtype != torch.bfloat16:
        shared = any(np.may_share_memory(tree.detach().numpy(), array) for array in inputs)
        return tree.clone() if shared else tree
    if isinstance(tree, np.ndarray):
        return tree.copy() if any(np.may_share_memory(tree, array) for array in inputs) else tree
    if isinstance(tree, list | tuple):  # a list, as `place` makes of both
        return [detached(item, inputs) for item in tree]
    if isinstance(tree, dict):
        return {key: detached(item, inputs) for key, item in tree.items()}
    return tree


def _aligned(offset: int) -> int:
    return -(-offset // ALIGN) * ALIGN
