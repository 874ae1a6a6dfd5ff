"""Process lifecycle in the main process: drain on SIGTERM, and answer for and restart dead inference workers."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from multiprocessing.process import BaseProcess
from typing import Protocol

from imgserve import metrics
from imgserve.config import Settings
from imgserve.handoff.state import SharedState
from prometheus_client import multiprocess

log = logging.getLogger(__name__)
POLL_S = 0.2


class ManagedServer(Protocol):
    """What the lifecycle needs of the server (so this module does not import it)."""

    settings: Settings
    state: SharedState
    inference_workers: list[BaseProcess]

    def restart_worker(self, index: int) -> BaseProcess:
        """Start a new inference worker in place of worker `index`."""

    def worker_starting(self, index: int) -> bool:
        """Is worker `index` still loading its model?"""


def install_drain_on_sigterm(server: ManagedServer) -> None:
    """SIGTERM: turn not-ready, refuse new work (503), wait for in-flight requests, then shut down cleanly."""

    main_pid = os.getpid()

    def on_sigterm(signum: int, frame: object) -> None:
        if os.getpid() != main_pid:  # a forked front end inherited this handler; LitServe is stopping it
            raise SystemExit(0)
        if not server.state.draining:
            server.state.start_draining()
            threading.Thread(target=_drain_then_stop, args=(server,), name="imgserve-drain", daemon=True).start()

    signal.signal(signal.SIGTERM, on_sigterm)
    # stop() delivers SIGINT; a shell's background job starts with it ignored, so take it back.
    signal.signal(signal.SIGINT, signal.default_int_handler)


def _drain_then_stop(server: ManagedServer) -> None:
    deadline = time.monotonic() + server.settings.drain_timeout_s
    log.info("SIGTERM: draining %d in-flight requests", server.state.queue_depth)
    while server.state.queue_depth > 0 and time.monotonic() < deadline:
        time.sleep(POLL_S)
    if server.state.queue_depth:
        log.warning("drain timeout: %d requests still in flight", server.state.queue_depth)
    stop(server)


def stop(server: ManagedServer) -> None:
    """Let LitServe's own clean shutdown run (it handles KeyboardInterrupt, not SIGTERM)."""
    os.kill(os.getpid(), signal.SIGINT)


def start_worker_monitor(server: ManagedServer, max_restarts: int) -> None:
    """Watch the inference workers; on a death, fail its requests fast (503) and restart it, or exit non-zero."""

    def watch() -> None:
        restarts = 0
        while not server.state.draining:
            for index, process in enumerate(server.inference_workers):
                if process.is_alive():
                    continue
                server.state.worker_lost(index)
                multiprocess.mark_process_dead(process.pid)
                process.join(timeout=0)
                if restarts >= max_restarts:
                    log.error(
                        "inference worker %d died (exit %s); out of restarts, exiting",
                        index,
                        process.exitcode,
                    )
                    server.state.start_draining(exit_code=1)
                    stop(server)
                    return
                restarts += 1
                metrics.WORKER_RESTARTS.inc()
                log.error("inference worker %d died (exit %s); restarting it", index, process.exitcode)
                server.inference_workers[index] = server.restart_worker(index)
                _wait_until_setup_ends(server, index)
                server.state.worker_back(index)
            time.sleep(POLL_S)

    threading.Thread(target=watch, name="imgserve-worker-monitor", daemon=True).start()


def _wait_until_setup_ends(server: ManagedServer, index: int) -> None:
    while server.worker_starting(index):
        if not server.inference_workers[index].is_alive():
            return
        time.sleep(POLL_S)
