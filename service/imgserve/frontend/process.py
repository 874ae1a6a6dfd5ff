"""An HTTP front-end process: forked by the main process, it serves the front end's application with uvicorn on the
listening socket the main process bound (every front end accepts from it), through imgserve's guarded connection
protocol, until the main process stops it (SIGTERM: uvicorn's graceful stop) or dies (the front end dies with it).

Ctrl-C reaches every process of the server; a front end leaves it to the main process, which drains first and then
stops the front ends itself.
"""

from __future__ import annotations

import signal
import socket
from types import FrameType
from typing import Any

import uvicorn

from imgserve.frontend.app import FrontEnd
from imgserve.lifetime import die_with_parent

GRACEFUL_STOP_S = 5  # a stopped front end's connections get this long to finish before uvicorn closes them


class FrontEndServer(uvicorn.Server):
    """uvicorn's server for one front end, leaving Ctrl-C to the main process: uvicorn would otherwise start its own
    shutdown on it."""

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig != signal.SIGINT:
            super().handle_exit(sig, frame)


def run(front_end: FrontEnd, index: int, listening: socket.socket, options: dict[str, Any], parent_pid: int) -> None:
    """The process's whole life: front end `index`, with uvicorn `options` (its protocol, logging, host, port)."""
    die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # until uvicorn takes it over, and leaves it alone
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not the main process's drain
    front_end.index = index
    config = uvicorn.Config(
        front_end.app, ws="none", lifespan="on", timeout_graceful_shutdown=GRACEFUL_STOP_S, **options
    )
    FrontEndServer(config).run(sockets=[listening])
