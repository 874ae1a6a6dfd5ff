"""A process's C heap: an inference worker keeps the memory of freed batches while busy; every process gives its
free heap memory back once idle.

glibc serves every allocation over 32 MiB (a CPU batch, an activation) with a fresh mmap, so each batch pays a
page fault per 4 KiB: for a near-free model on 1 MP images that was 3/4 of the worker's CPU. With mmap off and
trimming deferred, freed batches are reused as they are; `trim` hands the memory back once the worker is idle.
An HTTP front end decodes on a thread pool, and glibc gives each thread an arena that keeps what was freed in it:
`trim` empties every arena once a burst is over. Other C libraries (musl) keep their own behaviour: both calls
then do nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util

M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8  # glibc's mallopt parameters
FRONT_END_ARENAS = 2
KEEP_FREE_BYTES = 1 << 40  # never trim while busy


def _glibc() -> ctypes.CDLL | None:
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim"):
            return libc
    return None


def hold_freed_memory() -> bool:
    """Serve big allocations from the heap and keep what is freed; True where the C library took it."""
    libc = _glibc()
    return bool(libc and libc.mallopt(M_MMAP_MAX, 0) and libc.mallopt(M_TRIM_THRESHOLD, KEEP_FREE_BYTES))


def few_arenas(count: int = FRONT_END_ARENAS) -> bool:
    """Threads started from now on share `count` arenas instead of getting one each (up to 8 per core), so what one
    decoding thread frees the next one reuses; True where the C library took it."""
    libc = _glibc()
    return bool(libc and libc.mallopt(M_ARENA_MAX, count))


def trim() -> None:
    """Give the heap's free pages back to the system."""
    libc = _glibc()
    if libc:
        libc.malloc_trim(0)
