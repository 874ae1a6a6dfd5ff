"""The main process's children and its watch over them: the inference workers and the HTTP front ends.

A dead inference worker has its requests answered 503 and is restarted (a few times in all). A dead front end has its
admitted requests written off and is replaced at once (its clients' connections died with it); one that keeps dying
ends the server. A worker that fails to set up before the server was ever ready ends it too: what the user named
cannot be served. Each ending is one reason, which the main process logs as its last line.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.process import BaseProcess

from prometheus_client import multiprocess

from imgserve import metrics
from imgserve.handoff.state import FAILED, SharedState

log = logging.getLogger(__name__)
MAX_WORKER_RESTARTS = 3  # in the server's lifetime
FRONT_END_DEATHS = 3  # this many deaths of front ends ...
FRONT_END_WINDOW_S = 60.0  # ... within this many seconds end the server
Start = Callable[[int], BaseProcess]  # starts the child of one kind with this index, and returns its process


@dataclass(frozen=True)
class Ending:
    """Why the server must end, and its exit code: 1 when its processes kept dying, 2 when what the user named
    cannot be served."""

    reason: str
    exit_code: int


class Children:
    """Every child process of the server, started and stopped from the main process's main thread (a child dies
    with its parent's starting thread: lifetime.py)."""

    def __init__(self, start_worker: Start, start_front_end: Start, workers: int, front_ends: int) -> None:
        self.start_worker, self.start_front_end = start_worker, start_front_end
        self.counts = (workers, front_ends)
        self.workers: list[BaseProcess] = []
        self.front_ends: dict[int, BaseProcess] = {}

    def start_workers(self) -> None:
        self.workers = [self.start_worker(index) for index in range(self.counts[0])]

    def start_front_ends(self) -> None:
        """Once the workers are ready: the port, bound since the start, is then served."""
        self.front_ends = {index: self.start_front_end(index) for index in range(self.counts[1])}

    def stop(self, grace_s: float) -> None:
        """Stop the front ends (uvicorn's graceful stop, at most `grace_s` each), then the workers, and reap all."""
        for process in self.front_ends.values():
            _signal(process.terminate)
        for process in self.front_ends.values():
            _reap(process, grace_s)
        for process in self.workers:
            _signal(process.terminate)
        for process in self.workers:
            _reap(process, grace_s)


class Supervisor:
    """Checks every child once per call of `check`, from the main process's loop."""

    def __init__(self, children: Children, state: SharedState) -> None:
        self.children, self.state = children, state
        self.worker_restarts = 0
        self.was_ready = False  # every worker has been ready once: a setup failure after that is a death
        self.front_end_deaths: collections.deque[float] = collections.deque(maxlen=FRONT_END_DEATHS)

    def check(self) -> Ending | None:
        """Replace what died; the Ending when the server cannot go on."""
        self.was_ready = self.was_ready or self.state.workers_ready
        return self._check_workers() or self._check_front_ends()

    def _check_front_ends(self) -> Ending | None:
        """A dead front end: write off what it had admitted and fork a new one, or end the server if it keeps dying."""
        for index, process in list(self.children.front_ends.items()):
            if process.is_alive():
                continue
            self.state.forget_front_end(index)
            multiprocess.mark_process_dead(process.pid)  # type: ignore[no-untyped-call]  # prometheus_client: untyped
            now = time.monotonic()
            self.front_end_deaths.append(now)
            if len(self.front_end_deaths) == FRONT_END_DEATHS and now - self.front_end_deaths[0] < FRONT_END_WINDOW_S:
                reason = (
                    f"HTTP front end {index} died (exit {process.exitcode}), {FRONT_END_DEATHS} front-end deaths "
                    f"in {FRONT_END_WINDOW_S:.0f} s; stopping"
                )
                return Ending(reason, 1)
            self.children.front_ends[index] = self.children.start_front_end(index)
            metrics.FRONT_END_RESTARTS.inc()
            log.error("HTTP front end %d died (exit %s); restarted it", index, process.exitcode)
        return None

    def _check_workers(self) -> Ending | None:
        """A dead worker: fail its requests fast (503) and restart it, or end the server when out of restarts, or
        when it failed to set up before the server was ever ready."""
        workers = self.children.workers
        for index, process in enumerate(workers):
            if process.is_alive():
                continue
            if self.state.worker_status(index) == FAILED and not self.was_ready:
                return Ending(self.state.setup_failure, 2)
            self.state.worker_lost(index)
            multiprocess.mark_process_dead(process.pid)  # type: ignore[no-untyped-call]  # prometheus_client: untyped
            if self.worker_restarts >= MAX_WORKER_RESTARTS:
                return Ending(f"inference worker {index} died (exit {process.exitcode}); out of restarts, stopping", 1)
            self.worker_restarts += 1
            metrics.WORKER_RESTARTS.inc()
            log.error("inference worker %d died (exit %s); restarting it", index, process.exitcode)
            workers[index] = self.children.start_worker(index)
        return None


def _signal(send: Callable[[], None]) -> None:
    with contextlib.suppress(OSError):  # already gone
        send()


def _reap(process: BaseProcess, grace_s: float) -> None:
    """Wait for `process` to end, up to `grace_s`; then kill it and wait for that."""
    process.join(grace_s)
    if process.is_alive():
        _signal(process.kill)
        process.join(5)
