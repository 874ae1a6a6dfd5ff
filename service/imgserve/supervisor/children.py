"""The main process's watch over every child: the inference workers, the HTTP front ends and LitServe's queue process.

A dead inference worker has its requests answered 503 and is restarted (a few times in all). A dead front end has its
admitted requests written off and is replaced at once (its clients' connections died with it); one that keeps dying
ends the server. A dead queue process cannot be replaced (every queued request and LitServe's shared status died with
it): the waiting requests are answered 503 and the server ends. Each ending is one log line and exit code 1.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from multiprocessing.process import BaseProcess
from typing import Protocol

from prometheus_client import multiprocess

from imgserve import metrics
from imgserve.supervisor.lifecycle import POLL_S, ManagedServer, drain_then_stop

log = logging.getLogger(__name__)
MAX_WORKER_RESTARTS = 3  # in the server's lifetime
FRONT_END_DEATHS = 3  # this many deaths of front ends ...
FRONT_END_WINDOW_S = 60.0  # ... within this many seconds end the server
FATAL_DRAIN_S = 3.0  # on a fatal failure, how long the surviving processes get to answer what they hold


class SupervisedServer(ManagedServer, Protocol):
    """What the supervisor needs of the server: its children and how to start each kind again."""

    inference_workers: list[BaseProcess]
    front_end_processes: dict[int, BaseProcess]
    queue_process: BaseProcess

    def restart_worker(self, index: int) -> BaseProcess:
        """Start a new inference worker in place of worker `index`."""

    def worker_starting(self, index: int) -> bool:
        """Is worker `index` still loading its model?"""

    def restart_front_end(self, index: int) -> BaseProcess:
        """Fork a new HTTP front end in place of front end `index`, on the same listening socket."""


class Supervisor:
    """Polls the children from a thread of the main process until the server drains."""

    def __init__(self, server: SupervisedServer) -> None:
        self.server = server
        self.worker_restarts = 0
        self.warming: set[int] = set()  # restarted workers still loading their model
        self.front_end_deaths: collections.deque[float] = collections.deque(maxlen=FRONT_END_DEATHS)
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self.watch, name="imgserve-supervisor", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop watching before the children are stopped on purpose (Ctrl-C): their exits are not deaths."""
        self._stopping.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5 * POLL_S)

    def watch(self) -> None:
        """Check every child each POLL_S; returns when the server drains or stops, or a failure ends it."""
        while not (self.server.state.draining or self._stopping.is_set()):
            try:
                if not (self.queue_alive() and self.check_front_ends() and self.check_workers()):
                    return
            except (EOFError, ConnectionError):  # the queue process died mid-check: the next round ends the server
                pass
            self._stopping.wait(POLL_S)

    def queue_alive(self) -> bool:
        """LitServe's queue process (its Manager) is irreplaceable: without it, answer what waits with 503 and end."""
        queue = self.server.queue_process
        if queue.is_alive():
            return True
        self.server.state.lose_queue()
        self.fail(f"LitServe's queue process died (exit {queue.exitcode}); stopping")
        return False

    def check_front_ends(self) -> bool:
        """A dead front end: write off what it had admitted and fork a new one, or end the server if it keeps dying."""
        for index, process in list(self.server.front_end_processes.items()):
            if process.is_alive():
                continue
            self.server.state.forget_front_end(index)
            multiprocess.mark_process_dead(process.pid)
            now = time.monotonic()
            self.front_end_deaths.append(now)
            if len(self.front_end_deaths) == FRONT_END_DEATHS and now - self.front_end_deaths[0] < FRONT_END_WINDOW_S:
                self.fail(
                    f"HTTP front end {index} died (exit {process.exitcode}), {FRONT_END_DEATHS} front-end deaths "
                    f"in {FRONT_END_WINDOW_S:.0f} s; stopping"
                )
                return False
            self.server.front_end_processes[index] = self.server.restart_front_end(index)
            metrics.FRONT_END_RESTARTS.inc()
            log.error("HTTP front end %d died (exit %s); restarted it", index, process.exitcode)
        return True

    def check_workers(self) -> bool:
        """A dead worker: fail its requests fast (503) and restart it, or end the server when out of restarts."""
        workers = self.server.inference_workers
        for index in [i for i in self.warming if not (workers[i].is_alive() and self.server.worker_starting(i))]:
            self.warming.discard(index)
            self.server.state.worker_back(index)
        for index, process in enumerate(workers):
            if process.is_alive() or index in self.warming:
                continue
            if not self.queue_alive():  # a worker stops by itself when the queue process is gone
                return False
            self.server.state.worker_lost(index)
            multiprocess.mark_process_dead(process.pid)
            if self.worker_restarts >= MAX_WORKER_RESTARTS:
                self.fail(f"inference worker {index} died (exit {process.exitcode}); out of restarts, stopping")
                return False
            self.worker_restarts += 1
            metrics.WORKER_RESTARTS.inc()
            log.error("inference worker %d died (exit %s); restarting it", index, process.exitcode)
            workers[index] = self.server.restart_worker(index)
            self.warming.add(index)
        return True

    def fail(self, reason: str) -> None:
        """End the server with exit code 1 and one line saying why, after a short drain."""
        log.error("imgserve: %s", reason)
        self.server.state.start_draining(exit_code=1)
        drain_then_stop(self.server, FATAL_DRAIN_S)
