"""Shared-memory slots: each in-flight request owns a file in /dev/shm that carries its pixels to the worker and the
result back, so LitServe's queues (pickled through its Manager process) carry only a few small fields.

One directory per server (`imgserve-<main pid>`), one file per slot, kept open by every process that uses it. Data
moves with one `pread`/`pwrite` each way, straight into the worker's batch buffer and out of its uint8 result: no
pickling, no mapping to keep in step. The main process removes the directory when the server stops; a server that
was killed leaves one behind, which the next server on the machine removes.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from imgserve.errors import ApiError

SHM_ROOT = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
PREFIX = "imgserve-"
KEEP_BYTES = 16 * 1024 * 1024  # a slot that carried more is emptied when freed, so a burst of huge images ends


@dataclass(frozen=True)
class InSlot:
    """A worker's answer that lies in the request's slot: its shape and dtype (the bytes do not travel)."""

    shape: tuple[int, ...]
    dtype: str

    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * np.dtype(self.dtype).itemsize


def server_directory(main_pid: int, purpose: str = "") -> Path:
    """Where the slots (or, with a `purpose` such as "weights", other files) of the server whose main process is
    `main_pid` live."""
    return SHM_ROOT / f"{PREFIX}{main_pid}{'.' + purpose if purpose else ''}"


def create_directory(main_pid: int, purpose: str = "") -> Path:
    """A fresh directory for this server; those of servers no longer running are removed first."""
    for stale in SHM_ROOT.glob(f"{PREFIX}*"):
        pid = stale.name.removeprefix(PREFIX).partition(".")[0]
        if pid.isdigit() and not _running(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)
    directory = server_directory(main_pid, purpose)
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(mode=0o700)
    return directory


def bytes_in_use(directory: Path) -> int:
    """Memory the slot files of a server hold (their allocated blocks, not their nominal sizes)."""
    total = 0
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(directory):
            with contextlib.suppress(FileNotFoundError):
                total += entry.stat().st_blocks * 512
    return total


def remove_directory(directory: Path) -> None:
    """Free the memory of every file in it (at shutdown, in the main process)."""
    shutil.rmtree(directory, ignore_errors=True)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class SlotFiles:
    """The slot files as one process sees them: opened on first use and kept open."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._fds: dict[int, int] = {}

    def _fd(self, slot: int) -> int:
        fd = self._fds.get(slot)
        if fd is None:
            fd = self._fds[slot] = os.open(self.directory / f"slot-{slot}", os.O_RDWR | os.O_CREAT, 0o600)
        return fd

    def write(self, slot: int, array: np.ndarray) -> None:
        """Put `array`'s bytes at the start of the slot (503 when /dev/shm is full)."""
        data = memoryview(np.ascontiguousarray(array)).cast("B")
        fd, done = self._fd(slot), 0
        try:
            while done < len(data):
                done += os.pwrite(fd, data[done:], done)
        except OSError as exc:
            raise ApiError(503, "no_shared_memory", f"cannot place the image in shared memory: {exc}", 1) from None

    def read_into(self, slot: int, out: np.ndarray) -> None:
        """Fill the contiguous array `out` from the start of the slot."""
        view = memoryview(out).cast("B")
        fd, done = self._fd(slot), 0
        while done < len(view):
            got = os.preadv(fd, [view[done:]], done)
            if got == 0:
                raise ApiError(500, "slot_short", f"slot {slot} holds {done} bytes, {len(view)} expected")
            done += got

    def read(self, slot: int, shape: tuple[int, ...], dtype: str = "uint8") -> np.ndarray:
        """A new array of `shape` and `dtype` read from the slot."""
        out = np.empty(shape, dtype=dtype)
        self.read_into(slot, out)
        return out

    def trim(self, slot: int, keep_bytes: int = KEEP_BYTES) -> None:
        """Give the memory of a freed slot back when it holds more than `keep_bytes`."""
        fd = self._fds.get(slot)
        if fd is not None and os.fstat(fd).st_size > keep_bytes:
            os.ftruncate(fd, 0)

    def close(self) -> None:
        for fd in self._fds.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds.clear()
