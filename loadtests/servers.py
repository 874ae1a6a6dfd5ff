"""Start a server command on 127.0.0.1, wait until it is ready, watch its memory, and always kill its process tree."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

import httpx
import psutil

LOOPBACK = "127.0.0.1"
SOURCE = Path(__file__).resolve().parent.parent / "service"


def free_port() -> int:
    """A TCP port the OS says is free on loopback."""
    with socket.socket() as sock:
        sock.bind((LOOPBACK, 0))
        return sock.getsockname()[1]


def imgserve_command(port: int, grpc_port: int = 0) -> list[str]:
    """`imgserve serve` on loopback (gRPC off unless a port is given); other settings come from IMGSERVE_*."""
    command = [sys.executable, "-m", "imgserve", "serve", "--host", LOOPBACK, "--port", str(port)]
    return [*command, "--grpc-port", str(grpc_port)]


@dataclass
class RunningServer:
    """A server process started by `running_server`: its URL, process and log file."""

    url: str
    process: subprocess.Popen
    log_path: Path

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def tree(self) -> list[psutil.Process]:
        """The server's main process and every process below it."""
        with contextlib.suppress(psutil.NoSuchProcess):
            main = psutil.Process(self.process.pid)
            return [main, *main.children(recursive=True)]
        return []

    def worker_pids(self) -> list[int]:
        """Inference workers: the spawned children (spawn_main) of the server."""
        workers = []
        for process in self.tree()[1:]:
            with contextlib.suppress(psutil.Error):
                if "spawn_main" in " ".join(process.cmdline()):
                    workers.append(process.pid)
        return workers

    def replaced_worker(self, before: set[int], timeout_s: float = 90) -> int:
        """After one of the workers `before` was killed: the pid of the one started in its place, once the server
        is ready again."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            now = set(self.worker_pids())
            with contextlib.suppress(httpx.HTTPError):
                if (
                    len(now) == len(before)
                    and now != before
                    and httpx.get(self.url + "/health/ready").status_code == 200
                ):
                    (fresh,) = now - before
                    return fresh
            time.sleep(0.5)
        raise TimeoutError(f"no worker was started in place of the one killed:\n{self.log_tail()}")

    def tree_cpu_s(self) -> float:
        """CPU seconds (user + system) the whole process tree has used so far."""
        return self._tree_sum(lambda process: sum(process.cpu_times()[:2]))

    def tree_pss(self) -> int:
        """Proportional set size of the whole process tree, in bytes: each page is charged 1/k to each of the k
        processes that map it, so pages shared by every worker count once (RSS would count them once per worker)."""
        return int(self._tree_sum(lambda process: process.memory_full_info().pss))

    def _tree_sum(self, measure: Callable[[psutil.Process], float]) -> float:
        """`measure` summed over the process tree (a process that exits meanwhile counts for nothing)."""
        total = 0.0
        for process in self.tree():
            with contextlib.suppress(psutil.Error):
                total += measure(process)
        return total


def wait_ready(server: RunningServer, ready_path: str, timeout_s: float) -> None:
    """Poll `ready_path` until 200; raise with the server's log if it exits or takes longer than `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"server exited with {server.process.returncode}:\n{server.log_tail()}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(server.url + ready_path, timeout=2).status_code == 200:
                return
        time.sleep(0.2)
    raise TimeoutError(f"server not ready after {timeout_s:.0f}s:\n{server.log_tail()}")


def stop(server: RunningServer, grace_s: float = 15) -> None:
    """SIGINT (LitServe's clean shutdown), then SIGKILL whatever is left of the process tree."""
    tree = server.tree()
    if server.process.poll() is None:
        server.process.send_signal(signal.SIGINT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            server.process.wait(timeout=grace_s)
    for process in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
    with contextlib.suppress(ProcessLookupError):
        os.killpg(server.process.pid, signal.SIGKILL)
    server.process.wait(timeout=10)


@contextlib.contextmanager
def running_server(
    command: list[str],
    port: int,
    log_path: Path,
    ready_path: str,
    env: dict[str, str] | None = None,
    ready_timeout_s: float = 180,
) -> Iterator[RunningServer]:
    """Run `command` (which must listen on 127.0.0.1:`port`) until the block ends; yields once it is ready."""
    environment = {**os.environ, **(env or {})}
    environment.pop("PROMETHEUS_MULTIPROC_DIR", None)  # each imgserve makes and wipes its own
    # This checkout's imgserve, whichever one is installed.
    environment["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SOURCE), environment.get("PYTHONPATH")]))
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            command, env=environment, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    server = RunningServer(f"http://{LOOPBACK}:{port}", process, log_path)
    try:
        wait_ready(server, ready_path, ready_timeout_s)
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
    """The CPU that this process (the load generator) and a server's process tree use in a cell's measured window,
    `start_s` after the block starts for `seconds`: not in the warm-up, nor in the tail of answers still coming
    after it (under a retry storm that tail is the held 503s, seconds of a server with little to do)."""

    def __init__(self, server: RunningServer, start_s: float, seconds: float) -> None:
        self.server = server
        self._client = psutil.Process()
        self._marks: list[tuple[float, float, float]] = []  # (time, client CPU s, server CPU s) at start and end
        self._timers = [threading.Timer(start_s, self._mark), threading.Timer(start_s + seconds, self._mark)]

    def __enter__(self) -> Self:
        for timer in self._timers:
            timer.start()
        return self

    def __exit__(self, *exc: object) -> None:
        for timer in self._timers:
            timer.cancel()
        while len(self._marks) < 2:  # the block ended early: its end closes the window
            self._mark()

    def _mark(self) -> None:
        self._marks.append((time.perf_counter(), sum(self._client.cpu_times()[:2]), self.server.tree_cpu_s()))

    def _cores(self, which: int) -> float:
        (start, *before), (end, *after) = self._marks[:2]
        return (after[which] - before[which]) / max(end - start, 1e-9)

    @property
    def client_cores(self) -> float:
        return self._cores(0)

    @property
    def server_cores(self) -> float:
        return self._cores(1)


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
