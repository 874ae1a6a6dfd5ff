"""A real `imgserve serve` on 127.0.0.1 for the tests, on top of the load tests' server helpers."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
from imgserve.handoff.slots import server_directory
from prometheus_client.parser import text_string_to_metric_families

from loadtests.servers import RunningServer, free_port, imgserve_command, stop
from loadtests.servers import wait_ready as _wait_ready

TESTS = Path(__file__).parent
REPO = TESTS.parent
SOURCE = REPO / "service"  # this worktree's imgserve, whatever is installed


class Server(RunningServer):
    """A running imgserve: its URL, process and log, and what the tests read from it."""

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples called `name` whose labels include `labels` (0 if none)."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        return sum(
            sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
        )

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
        """Where this server's request slots live in /dev/shm."""
        return server_directory(self.process.pid)

    def descendants(self) -> set[int]:
        """PIDs of every process below the server's main process."""
        return {process.pid for process in self.tree()[1:]}


def start_server(settings: dict[str, object], log_dir: Path) -> Server:
    """Launch `imgserve serve` with IMGSERVE_* settings; returns once the process is started (not ready)."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("IMGSERVE_") and k != "PROMETHEUS_MULTIPROC_DIR"}
    env.update({f"IMGSERVE_{key.upper()}": str(value) for key, value in settings.items()})
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), str(SOURCE), str(REPO), env.get("PYTHONPATH", "")])
    log_path = log_dir / f"imgserve-{port}.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            imgserve_command(port), env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    return Server(f"http://127.0.0.1:{port}", process, log_path)


def wait_ready(server: Server, timeout: float = 90) -> None:
    """Poll /health/ready until 200; fail with the server's log if it exits or takes too long."""
    _wait_ready(server, "/health/ready", timeout)


stop_server = stop


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
    from imgserve.models.synthetic import clean_image
    from PIL import Image

    pixels = (clean_image(np.random.default_rng(seed), height, width) * 255).astype("uint8")
    buffer = io.BytesIO()
    Image.fromarray(pixels).convert(mode).save(buffer, format=fmt)
    return buffer.getvalue()
