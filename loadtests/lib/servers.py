"""Servers under load: start any server command on loopback (imgserve.testing does the starting, waiting and
stopping), and watch what its process tree uses while the load runs (CPU, PSS, GPU memory)."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

import psutil

from imgserve.testing import RunningServer, start, stop, wait_ready

SOURCE = Path(__file__).resolve().parents[2] / "service"


@contextlib.contextmanager
def running_server(
    command: list[str],
    port: int,
    log_path: Path,
    ready_path: str,
    env: dict[str, str] | None = None,
    ready_timeout_s: float = 180,
    source: Path = SOURCE,
) -> Iterator[RunningServer]:
    """Run `command` (which must listen on 127.0.0.1:`port`) until the block ends; yields once it is ready. The
    server imports the imgserve in `source` (this checkout's by default), whichever one is installed; a `source`
    without one is refused, or the installed one would pass for it."""
    if not (source / "imgserve" / "__init__.py").is_file():
        raise FileNotFoundError(f"no imgserve package in {source}: --before names a checkout's root, with service/")
    environment = {**os.environ, **(env or {})}
    environment.pop("PROMETHEUS_MULTIPROC_DIR", None)  # each imgserve makes its own
    environment["PYTHONPATH"] = os.pathsep.join(filter(None, [str(source), environment.get("PYTHONPATH")]))
    server = start(command, port, log_path, environment)
    try:
        wait_ready(server, ready_timeout_s, ready_path)
        yield server
    finally:
        stop(server)


class Periodic:
    """Calls `sample()` every `interval_s` seconds in a thread from the start of the block to its end (at most
    `max_s`)."""

    def __init__(self, sample: Callable[[], None], interval_s: float, max_s: float = 24 * 3600) -> None:
        self.sample, self.interval_s, self.max_s = sample, interval_s, max_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        until = time.monotonic() + self.max_s
        while not self._stop.is_set() and time.monotonic() < until:
            self.sample()
            self._stop.wait(self.interval_s)


@dataclass
class ResourceSampler:
    """Samples a server's process-tree PSS (and its GPU memory, where nvidia-smi exists) until stopped; keeps peaks.
    PSS, not RSS: pages that workers share (the weights) count once."""

    server: RunningServer
    interval_s: float = 1.0  # reading every process's smaps_rollup costs the load generator's cores
    peak_pss_bytes: int = 0
    peak_gpu_bytes: int | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> ResourceSampler:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak_pss_bytes = max(self.peak_pss_bytes, self.server.tree_pss())
            gpu = gpu_memory_bytes({p.pid for p in self.server.tree()})
            if gpu is not None:
                self.peak_gpu_bytes = max(self.peak_gpu_bytes or 0, gpu)
            self._stop.wait(self.interval_s)


class CpuWindow:
    """The CPU that this process (the load generator), a server's process tree and its workers use in a cell's
    measured window, `start_s` after the block starts for `seconds`: not in the warm-up, nor in the tail of answers
    still coming after it (under a retry storm that tail is the held 503s, seconds of a server with little to do)."""

    def __init__(self, server: RunningServer, start_s: float, seconds: float) -> None:
        self.server = server
        self._client = psutil.Process()
        self._marks: list[tuple[float, ...]] = []  # (time, client, server, workers' CPU s) at start and end
        self._over = threading.Event()
        # One thread takes both marks, in order (two timers could append them swapped on a loaded machine).
        self._thread = threading.Thread(target=self._mark_window, args=(start_s, seconds), daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._over.set()
        self._thread.join()
        while len(self._marks) < 2:  # the block ended early: its end closes the window
            self._mark()

    def _mark_window(self, start_s: float, seconds: float) -> None:
        end = time.monotonic() + start_s + seconds
        if not self._over.wait(start_s):
            self._mark()
            if not self._over.wait(max(end - time.monotonic(), 0.0)):
                self._mark()

    def _mark(self) -> None:
        client = sum(self._client.cpu_times()[:2])
        self._marks.append((time.perf_counter(), client, self.server.tree_cpu_s(), self.server.workers_cpu_s()))

    def _cores(self, which: int) -> float:
        (start, *before), (end, *after) = self._marks[:2]
        return (after[which] - before[which]) / max(end - start, 1e-9)

    @property
    def client_cores(self) -> float:
        return self._cores(0)

    @property
    def server_cores(self) -> float:
        return self._cores(1)

    @property
    def worker_cores(self) -> float:
        """The inference workers' part of server_cores."""
        return self._cores(2)


def gpu_memory_bytes(pids: set[int]) -> int | None:
    """GPU memory the given processes hold, from nvidia-smi; None without a GPU."""
    if not shutil.which("nvidia-smi"):
        return None
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        ).stdout
    except (subprocess.SubprocessError, OSError):
        return None
    rows = [line.split(",") for line in out.splitlines() if line.strip()]
    ours = [int(used) for pid, used in rows if int(pid) in pids]
    if ours or not rows:
        return sum(ours) * 2**20
    # In a container nvidia-smi shows host PIDs: count every compute process (the device is ours alone).
    return sum(int(used) for _, used in rows) * 2**20
