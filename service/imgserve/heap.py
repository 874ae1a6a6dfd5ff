"""A process's C heap: an inference worker keeps the memory of freed batches while busy; every process gives its
free heap memory back once idle.

glibc serves every allocation over 32 MiB (a CPU batch, an activation) with a fresh mmap, so each batch pays a
page fault per 4 KiB, which can cost a light model more than its own work. With mmap off and
trimming deferred, freed batches are reused as they are; `trim` hands the memory back once the worker is idle, and
`BatchHeap` bounds what a busy worker keeps to what its recent batches need.
An HTTP front end decodes on a thread pool, and glibc gives each thread an arena that keeps what was freed in it:
`trim` empties every arena once a burst is over. Other C libraries (musl) keep their own behaviour: both calls
then do nothing.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import functools
import os
import time
from collections.abc import Callable

M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8  # glibc's mallopt parameters
FRONT_END_ARENAS = 2
KEEP_FREE_BYTES = 2**31 - 1  # the most mallopt takes (an int): BatchHeap and the idle trim decide below that
RECENT_S = 30.0  # a busy worker keeps what the largest batch of this window needs
SLACK = 1.5  # ... times this, room for fragmentation under a mix of sizes
FLOOR_BYTES = 256 << 20  # and never trims for less
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    """The C library the process already runs on, found in its own symbols: no search (ctypes.util.find_library
    runs `ldconfig -p`, a child process, at each call)."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None)
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


def anonymous_bytes() -> int:
    """This process's resident memory that no file backs (heap, stacks): weights mapped from /dev/shm and the
    libraries' code are not in it."""
    with open("/proc/self/statm") as statm:
        _, resident, shared, *_ = statm.read().split()
    return (int(resident) - int(shared)) * PAGE_BYTES


class BatchHeap:
    """What an inference worker's heap keeps of its batches. Reusing a freed batch saves its page faults, but a
    busy worker holds at most SLACK x what the largest batch of the last RECENT_S needed (and FLOOR_BYTES) beyond
    its idle size: without that bound one rare big batch is held for as long as the load lasts, and a heap
    fragmented by a mix of sizes keeps growing."""

    def __init__(
        self,
        release: Callable[[], None],
        recent_s: float = RECENT_S,
        slack: float = SLACK,
        floor_bytes: int = FLOOR_BYTES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.release, self.clock = release, clock
        self.recent_s, self.slack, self.floor_bytes = recent_s, slack, floor_bytes
        self._needs: collections.deque[tuple[float, int]] = collections.deque()  # (when, bytes), the largest first
        self.base_bytes = anonymous_bytes()  # what the worker holds with no batch memory kept

    def after_batch(self, need_bytes: int) -> bool:
        """Record a batch that needed `need_bytes`; give the memory back if more is held than the recent batches
        need (True then)."""
        now = self.clock()
        while self._needs and self._needs[-1][1] <= need_bytes:
            self._needs.pop()  # smaller and older than this batch: never the window's largest again
        self._needs.append((now, need_bytes))
        while self._needs[0][0] < now - self.recent_s:
            self._needs.popleft()
        if anonymous_bytes() - self.base_bytes <= max(self.slack * self._needs[0][1], self.floor_bytes):
            return False
        self.give_back()
        return True

    def give_back(self) -> None:
        """Let go of the batch buffers and give the heap's free pages back to the system."""
        self.release()
        trim()
        self.base_bytes = anonymous_bytes()


def trim() -> None:
    """Give the heap's free pages back to the system."""
    libc = _glibc()
    if libc:
        libc.malloc_trim(0)
