"""Shutdown in the main process: drain on SIGTERM, then LitServe's own clean stop."""

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


class ManagedServer(Protocol):
    """What the shutdown needs of the server (so this module does not import it)."""

    settings: Settings
    state: SharedState


def install_drain_on_sigterm(server: ManagedServer) -> None:
    """SIGTERM: turn not-ready, refuse new work (503), wait for in-flight requests, then shut down cleanly."""

    main_pid = os.getpid()

    def on_sigterm(signum: int, frame: object) -> None:
        if os.getpid() != main_pid:  # a forked front end inherited this handler; LitServe is stopping it
            raise SystemExit(0)
        if not server.state.draining:
            server.state.start_draining()
            drain = threading.Thread(
                target=drain_then_stop,
                args=(server, server.settings.drain_timeout_s),
                name="imgserve-drain",
                daemon=True,
            )
            drain.start()

    signal.signal(signal.SIGTERM, on_sigterm)
    # stop() delivers SIGINT; a shell's background job starts with it ignored, so take it back.
    signal.signal(signal.SIGINT, signal.default_int_handler)


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
    """Let LitServe's own clean shutdown run (it handles KeyboardInterrupt, not SIGTERM)."""
    os.kill(os.getpid(), signal.SIGINT)
