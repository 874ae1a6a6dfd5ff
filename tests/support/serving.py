"""A real `imgserve serve` on 127.0.0.1 for the tests (imgserve.testing), and what the tests read from it."""

from __future__ import annotations

import contextlib
import io
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from imgserve import testing
from imgserve.handoff.directory import LOCK, SHM_ROOT
from imgserve.testing import RunningServer, free_port, serve_command, settings_environment, start, stop

SUPPORT = Path(__file__).parent
TESTS = SUPPORT.parent
REPO = TESTS.parent
SOURCE = REPO / "service"  # this worktree's imgserve, whatever is installed


@dataclass
class Server(RunningServer):
    """A running imgserve: its URL, process and log, and what the tests read from it."""

    grpc_port: int = 0

    @property
    def address(self) -> str:
        """host:port of the HTTP server, as tritonclient and kserve take it."""
        return self.url.removeprefix("http://")

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples called `name` whose labels include `labels` (0 if none)."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        return sum(
            sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
        )

    def wait_until_computing(self, timeout: float = 20) -> None:
        """Until a worker is in a batch: a request sent first may still reach a worker after one sent later, so a
        test that needs a busy worker waits for this rather than for a fixed time."""
        deadline = time.monotonic() + timeout
        while self.metric("imgserve_inflight_requests") == 0:
            assert time.monotonic() < deadline, "no worker started a batch"
            time.sleep(0.02)

    def slots_freed(self, timeout: float = 20) -> bool:
        """Wait until no shared-memory slot is held (every answer, even to given-up requests, came back)."""
        deadline = time.monotonic() + timeout
        while self.metric("imgserve_slots_in_use") != 0:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.2)
        return True

    @property
    def slot_directory(self) -> Path:
        """Where this server's request slots live in /dev/shm: in the private directory whose lock its main process
        holds open (the name is random)."""
        return self.private_directory / "slots"

    @property
    def private_directory(self) -> Path:
        """The server's private directory (handoff/directory.py), found through its main process's open files."""
        for opened in psutil.Process(self.process.pid).open_files():
            path = Path(opened.path)
            if path.name == LOCK and path.parent.parent == SHM_ROOT:
                return path.parent
        raise AssertionError(f"the server (pid {self.process.pid}) holds no lock file in {SHM_ROOT}")

    def descendants(self) -> set[int]:
        """PIDs of every process below the server's main process."""
        return {process.pid for process in self.tree()[1:]}

    def front_end_pids(self) -> dict[int, int]:
        """HTTP front ends by index, each found by the answer socket it binds once it is up (handoff/answers.py)."""
        return {int(path.rpartition("-")[2]): pid for pid, path in self._unix_sockets() if "/answers-" in path}

    def zombies(self) -> list[int]:
        """Processes below the server that died and were never reaped."""
        return [process.pid for process in self.tree()[1:] if _status(process) == psutil.STATUS_ZOMBIE]

    def _unix_sockets(self) -> list[tuple[int, str]]:
        found = []
        for process in self.tree():
            with contextlib.suppress(psutil.Error):
                found += [(process.pid, c.laddr) for c in sockets(process, "unix") if c.laddr]
        return found


def sockets(process: psutil.Process, kind: str) -> list:
    """A process's sockets of `kind` (psutil 6 renamed `connections` to `net_connections`; kserve holds psutil < 6)."""
    listed = getattr(process, "net_connections", None) or process.connections
    return listed(kind=kind)


def _status(process: psutil.Process) -> str:
    try:
        return process.status()
    except psutil.Error:
        return "gone"


def start_server(settings: dict[str, object], log_dir: Path) -> Server:
    """Launch `imgserve serve` with IMGSERVE_* settings (gRPC only when `grpc_port` is given), importing this
    checkout's imgserve and the tests' own modules (toy models, example APIs); returns once the process is started
    (not ready)."""
    settings = dict(settings)
    port = int(settings.pop("port", 0)) or free_port()  # a given port: a server in place of one that was there
    grpc_port = int(settings.pop("grpc_port", 0))
    env = settings_environment(settings)
    env["PYTHONPATH"] = os.pathsep.join([str(SUPPORT), str(SOURCE), str(REPO), env.get("PYTHONPATH", "")])
    running = start(serve_command(port, grpc_port), port, log_dir / f"imgserve-{port}.log", env)
    return Server(running.url, running.process, running.log_path, grpc_port)


@contextlib.contextmanager
def grpc_stub(server: Server) -> Iterator[Any]:
    """Triton's generated gRPC stub on the server's gRPC port (imported here only when a test asks for it)."""
    import grpc
    from tritonclient.grpc import service_pb2_grpc

    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
        yield service_pb2_grpc.GRPCInferenceServiceStub(channel)


def wait_ready(server: Server, timeout: float = 90) -> None:
    """Poll /health/ready until 200; fail with the server's log if it exits or takes too long."""
    testing.wait_ready(server, timeout)


stop_server = stop


def wait_until(condition: Callable[[], object], timeout_s: float, what: str, interval_s: float = 0.2) -> object:
    """Poll `condition` until it is truthy; fail the test after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(interval_s)
    pytest.fail(f"{what}: not within {timeout_s:.0f} s")


@contextlib.contextmanager
def running_server(log_dir: Path | None = None, **settings: object) -> Iterator[Server]:
    """A ready server with these settings for the duration of the block."""
    with contextlib.ExitStack() as stack:
        directory = log_dir or Path(stack.enter_context(tempfile.TemporaryDirectory()))
        server = start_server(settings, directory)
        stack.callback(stop_server, server)
        wait_ready(server)
        yield server


def image_bytes(width: int, height: int, fmt: str = "PNG", seed: int = 0, mode: str = "RGB") -> bytes:
    """A synthetic photo of the given size, encoded."""
    import numpy as np
    from PIL import Image

    from imgserve.models.synthetic import clean_image

    pixels = (clean_image(np.random.default_rng(seed), height, width) * 255).astype("uint8")
    buffer = io.BytesIO()
    Image.fromarray(pixels).convert(mode).save(buffer, format=fmt)
    return buffer.getvalue()
