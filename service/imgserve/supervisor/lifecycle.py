"""Shutdown: SIGTERM or Ctrl-C drains, then LitServe's own clean stop; only the main process acts on either.

A terminal's Ctrl-C sends SIGINT to every process of the server. Left to themselves, the inference workers would die
mid-batch and the front ends would shut down on their own while requests were in flight. So the children leave it to
the main process, which drains as on SIGTERM and then stops them itself (Triton's and uvicorn's convention). A second
Ctrl-C stops at once: the requests still in flight lose their connections."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from typing import Protocol

from imgserve.config import Settings
from imgserve.handoff.state import SharedState

log = logging.getLogger(__name__)
POLL_S = 0.2
FORCED_STOP_S = 1.0  # stopping with requests in flight: how long each front end gets before it is killed


class ManagedServer(Protocol):
    """What the shutdown needs of the server (so this module does not import it)."""

    settings: Settings
    state: SharedState
    uvicorn_graceful_timeout: float  # LitServe waits this long for each front end to stop before it kills it


def install_drain_on_signals(server: ManagedServer) -> None:
    """SIGTERM or Ctrl-C: turn not-ready, refuse new work (503), wait for in-flight requests, then shut down cleanly.
    Ctrl-C while draining stops at once."""

    main_pid = os.getpid()

    def start_draining() -> None:
        server.state.start_draining()
        drain = threading.Thread(
            target=drain_then_stop,
            args=(server, server.settings.drain_timeout_s),
            name="imgserve-drain",
            daemon=True,
        )
        drain.start()

    def on_sigterm(signum: int, frame: object) -> None:
        if os.getpid() != main_pid:  # a forked front end inherited this handler; LitServe is stopping it
            raise SystemExit(0)
        if not server.state.draining:
            start_draining()

    stopping = False

    def on_sigint(signum: int, frame: object) -> None:
        nonlocal stopping
        if os.getpid() != main_pid or stopping:  # a forked front end (before uvicorn took its signals), or too late
            return
        if server.state.draining:  # a second Ctrl-C, or the end of the drain (stop()): LitServe's shutdown, once
            if server.state.queue_depth:  # a second Ctrl-C, or a drain that timed out: its bound is the operator's
                log.warning("stopping now, with %d requests in flight", server.state.queue_depth)
                server.uvicorn_graceful_timeout = FORCED_STOP_S
            stopping = True
            raise KeyboardInterrupt
        log.info("Ctrl-C: draining (Ctrl-C again to stop now)")
        start_draining()

    signal.signal(signal.SIGTERM, on_sigterm)
    # This also takes SIGINT back where a shell started the server as a background job, with SIGINT ignored.
    signal.signal(signal.SIGINT, on_sigint)


def drain_then_stop(server: ManagedServer, timeout_s: float) -> None:
    """Wait up to `timeout_s` for the admitted requests to be answered (new ones get 503 draining), then stop."""
    deadline = time.monotonic() + timeout_s
    log.info("draining %d in-flight requests", server.state.queue_depth)
    while server.state.queue_depth > 0 and time.monotonic() < deadline:
        time.sleep(POLL_S)
    if server.state.queue_depth:
        log.warning("drain timeout: %d requests still in flight", server.state.queue_depth)
    stop(server)


def stop(server: ManagedServer) -> None:
    """Let LitServe's own clean shutdown run (it handles KeyboardInterrupt, not SIGTERM): SIGINT to this process
    while it drains."""
    os.kill(os.getpid(), signal.SIGINT)
