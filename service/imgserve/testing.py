"""imgserve for tests and benchmarks: `running`, a real `imgserve serve` (or any server command) started in its own
process on 127.0.0.1, waited for until ready, and always stopped with its whole process tree; and `InProcess`, an
ImageAPI's hooks run in the test's own process, as a worker batches them.

Nothing is mocked: the server is the one users run, so a test of a user's own API exercises admission, the
workers, deadlines and the drain as they will run in production::

    from imgserve.testing import running

    with running(api="my_api:MyAPI", max_batch_size=4) as server:
        assert httpx.post(f"{server.url}/predict", files={"file": data}).status_code == 200

Settings are passed as `IMGSERVE_<NAME>` environment variables, so every setting of `imgserve serve` works.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil
import torch

from imgserve.api import ImageAPI, Request, encoder
from imgserve.worker.batching import BatchRunner

LOOPBACK = "127.0.0.1"
READY_PATH = "/health/ready"
FORK_SERVER = "multiprocessing.forkserver"  # in the command line of the fork server and of each worker it forked


def free_port() -> int:
    """A TCP port the OS says is free on loopback."""
    with socket.socket() as sock:
        sock.bind((LOOPBACK, 0))
        port: int = sock.getsockname()[1]
        return port


def serve_command(port: int, grpc_port: int = 0) -> list[str]:
    """`imgserve serve` on loopback (gRPC off unless a port is given); other settings come from IMGSERVE_*."""
    command = [sys.executable, "-m", "imgserve", "serve", "--host", LOOPBACK, "--port", str(port)]
    return [*command, "--grpc-port", str(grpc_port)]


def settings_environment(settings: dict[str, object], base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for a server with `settings`: IMGSERVE_<NAME> for each, none inherited, and no
    PROMETHEUS_MULTIPROC_DIR (each server makes its own)."""
    env = {key: value for key, value in (base or os.environ).items() if not key.startswith("IMGSERVE_")}
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    env.update({f"IMGSERVE_{key.upper()}": str(value) for key, value in settings.items()})
    return env


@dataclass
class RunningServer:
    """A server process: its URL, process and log file, and what its process tree is and uses."""

    url: str
    process: subprocess.Popen[bytes]
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_tail(self, chars: int = 4000) -> str:
        return self.log()[-chars:]

    def tree(self) -> list[psutil.Process]:
        """The server's main process and every process below it."""
        with contextlib.suppress(psutil.NoSuchProcess):
            main = psutil.Process(self.process.pid)
            return [main, *main.children(recursive=True)]
        return []

    def worker_pids(self) -> list[int]:
        """Inference workers: the children of the server's fork server (supervisor/forkserver.py), or the spawned
        children of an imgserve that spawned them (the benchmarks compare with one)."""
        return [process.pid for process in self._workers()]

    def _workers(self) -> list[psutil.Process]:
        workers = []
        for process in self.tree()[1:]:
            with contextlib.suppress(psutil.Error):
                command = " ".join(process.cmdline())
                if "spawn_main" in command or process.ppid() != self.process.pid and FORK_SERVER in command:
                    workers.append(process)
        return workers

    def replaced_worker(self, before: set[int], timeout_s: float = 90) -> int:
        """After one of the workers `before` was killed: the pid of the one started in its place, once the server
        is ready again."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            now = set(self.worker_pids())
            with contextlib.suppress(httpx.HTTPError):
                ready = httpx.get(self.url + READY_PATH).status_code == 200
                if len(now) == len(before) and now != before and ready:
                    (fresh,) = now - before
                    return fresh
            time.sleep(0.5)
        raise TimeoutError(f"no worker was started in place of the one killed:\n{self.log_tail()}")

    def tree_cpu_s(self) -> float:
        """CPU seconds (user + system) the whole process tree has used so far."""
        return self._tree_sum(_cpu_s)

    def workers_cpu_s(self) -> float:
        """CPU seconds the inference workers have used so far (the rest of the tree's is the front ends' and the
        main process's)."""
        return self._tree_sum(_cpu_s, self._workers())

    def tree_pss(self) -> int:
        """Proportional set size of the whole process tree, in bytes: each page is charged 1/k to each of the k
        processes that map it, so pages shared by every worker count once (RSS would count them once per worker)."""
        return int(self._tree_sum(lambda process: process.memory_full_info().pss))

    def _tree_sum(
        self, measure: Callable[[psutil.Process], float], processes: list[psutil.Process] | None = None
    ) -> float:
        """`measure` summed over the process tree, or these `processes` of it (one that exits meanwhile counts for
        nothing)."""
        total = 0.0
        for process in self.tree() if processes is None else processes:
            with contextlib.suppress(psutil.Error):
                total += measure(process)
        return total


def _cpu_s(process: psutil.Process) -> float:
    return float(sum(process.cpu_times()[:2]))  # user + system


def start(command: list[str], port: int, log_path: Path, env: dict[str, str] | None = None) -> RunningServer:
    """Start `command` (which must listen on 127.0.0.1:`port`) in a session of its own, logging to `log_path`;
    returns at once (see `wait_ready`)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("wb") as log:
        process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return RunningServer(f"http://{LOOPBACK}:{port}", process, log_path)


def wait_ready(server: RunningServer, timeout_s: float = 180, ready_path: str = READY_PATH) -> None:
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
    """SIGINT (a clean drain and stop), then SIGKILL whatever is left of the process tree."""
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
def running(log_dir: Path | None = None, ready_timeout_s: float = 180, **settings: object) -> Iterator[RunningServer]:
    """A ready `imgserve serve` with these settings (as IMGSERVE_<NAME>) until the block ends; its log goes to
    `log_dir` (a temporary directory when None)."""
    with contextlib.ExitStack() as stack:
        directory = log_dir or Path(stack.enter_context(tempfile.TemporaryDirectory()))
        port = free_port()
        server = start(serve_command(port), port, directory / f"imgserve-{port}.log", settings_environment(settings))
        stack.callback(stop, server)
        wait_ready(server, ready_timeout_s)
        yield server


class InProcess:
    """An ImageAPI's hooks run in this process, in the order and the batches a worker runs them, without a server:
    for unit tests of an API, and the benchmarks' in-process limit. `run` takes requests and returns their answers
    (what `encode_response` returned); `predict` takes decoded items and returns one output (or ApiError) each."""

    def __init__(self, api: ImageAPI, device: str = "cpu") -> None:
        self.api, self.device = api, torch.device(device)
        self.encode = encoder(api)
        self.runner = BatchRunner(api, self.device)

    def setup(self, measure: bool = False) -> InProcess:
        """The API's `setup` on the device; with `measure`, the memory plan from its example request too."""
        self.api.setup(str(self.device))
        example = self.api.example_request()
        if measure and example is not None:
            self.runner.measure(self.api.decode_request(example))
        return self

    def predict(self, items: list[Any]) -> list[Any]:
        return self.runner(items)

    def run(self, requests: list[Request]) -> list[Any]:
        items = [self.api.decode_request(request) for request in requests]
        return [self.encode(output, request) for output, request in zip(self.predict(items), requests, strict=True)]
