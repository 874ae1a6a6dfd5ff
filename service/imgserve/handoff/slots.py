"""Shared-memory slots: each in-flight request owns a file in /dev/shm that carries its pixels to the worker and the
result back, so the messages on the hand-off's sockets carry only a few small fields.

One directory per server (`slots` in its private directory, handoff/directory.py), one file per slot, kept open by
every process that uses it. The front end writes an item's arrays with one `pwrite` each and reads the outputs back
with one `pread`; the worker maps the slot (`view`), so the arrays it hands the API lie in the slot itself and the
API's `batch` makes the one copy into the batch. A worker's view is valid while its request is answered: the front
end reuses or empties a slot only once its answer came (or its worker died).
"""

from __future__ import annotations

import contextlib
import mmap
import os
from pathlib import Path

import numpy as np

from imgserve.errors import ApiError

KEEP_BYTES = 16 * 1024 * 1024  # a slot that carried more is emptied when freed, so a burst of huge images ends


def bytes_in_use(directory: Path) -> int:
    """Memory the slot files of a server hold (their allocated blocks, not their nominal sizes)."""
    total = 0
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(directory):
            with contextlib.suppress(FileNotFoundError):
                total += entry.stat().st_blocks * 512
    return total


class SlotFiles:
    """The slot files as one process sees them: opened on first use and kept open."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._fds: dict[int, int] = {}
        self._maps: dict[int, mmap.mmap] = {}  # the worker's mappings, by slot

    def _fd(self, slot: int) -> int:
        fd = self._fds.get(slot)
        if fd is None:
            fd = self._fds[slot] = os.open(
                self.directory / f"slot-{slot}", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600
            )
        return fd

    def write(self, slot: int, array: np.ndarray, offset: int = 0) -> None:
        """Put `array`'s bytes into the slot at `offset` (503 when /dev/shm is full, of bytes or of files)."""
        data = memoryview(np.ascontiguousarray(array).data).cast("B")
        done = 0
        try:
            fd = self._fd(slot)
            while done < len(data):
                done += os.pwrite(fd, data[done:], offset + done)
        except OSError as exc:
            raise ApiError(503, "no_shared_memory", f"cannot place the image in shared memory: {exc}", 1) from None

    def read_into(self, slot: int, out: np.ndarray, offset: int = 0) -> None:
        """Fill the contiguous array `out` from the slot, from `offset` on."""
        view = memoryview(out.data).cast("B")
        fd, done = self._fd(slot), 0
        while done < len(view):
            got = os.preadv(fd, [view[done:]], offset + done)
            if got == 0:
                raise ApiError(500, "slot_short", f"slot {slot} holds {done} bytes, {len(view)} expected")
            done += got

    def read(self, slot: int, shape: tuple[int, ...], dtype: str = "uint8", offset: int = 0) -> np.ndarray:
        """A new array of `shape` and `dtype` read from the slot at `offset`."""
        out = np.empty(shape, dtype=dtype)
        self.read_into(slot, out, offset)
        return out

    def view(self, slot: int, shape: tuple[int, ...], dtype: str = "uint8", offset: int = 0) -> np.ndarray:
        """The array of `shape` and `dtype` that lies in the slot at `offset`, without a copy (a shared mapping of
        the slot file, remade when the slot has grown past it)."""
        dtype_ = np.dtype(dtype)
        count = int(np.prod(shape))
        end = offset + count * dtype_.itemsize
        mapped = self._maps.get(slot)
        if mapped is None or len(mapped) < end:
            fd = self._fd(slot)
            size = os.fstat(fd).st_size
            if size < end:
                raise ApiError(500, "slot_short", f"slot {slot} holds {size} bytes, {end} expected")
            mapped = self._maps[slot] = mmap.mmap(fd, size)  # an old mapping lives on while arrays use it
        return np.frombuffer(mapped, dtype_, count, offset).reshape(shape)

    def trim(self, slot: int, keep_bytes: int = KEEP_BYTES) -> None:
        """Give the memory of a freed slot back when it holds more than `keep_bytes`."""
        fd = self._fds.get(slot)
        if fd is not None and os.fstat(fd).st_size > keep_bytes:
            os.ftruncate(fd, 0)

    def close(self) -> None:
        self._maps.clear()
        for fd in self._fds.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds.clear()
