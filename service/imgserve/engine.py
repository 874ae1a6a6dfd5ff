"""The seam over LitServe, pinned to 0.2.19: every private name of LitServe imgserve uses is touched here, nowhere else.

imgserve keeps LitServe's process model (the main process binds the port and watches; spawned inference workers
run the API's loop; forked uvicorn front ends share the socket; a Manager holds the workers' start-up status) and
replaces the pieces that fall short behind named hooks, which the composition root (server.py) fills in:
`add_routes` (its own routes instead of LitServe's), `hand_off` (the request and answer sockets instead of the
Manager's queues), `front_ends_started` and `stopping` (the supervisor). Front ends are forked one at a time
(`fork_front_end`), so a dead one can be replaced; LitServe's worker monitor is off (the supervisor answers for a
dead worker's requests). `PINNED` names each private symbol with the parameters it was written against, and
`pinned_problems` checks the installed LitServe against it (tests/unit/test_engine.py), so an upgrade fails one
readable test instead of a server at start.
"""

from __future__ import annotations

import copy
import gc
import inspect
import multiprocessing as mp
import signal
import socket
import threading
from dataclasses import dataclass
from importlib import import_module
from multiprocessing.process import BaseProcess
from types import FrameType
from typing import Any

import litserve as ls
import uvicorn
from litserve.server import _Server
from litserve.transport.base import MessageTransport
from litserve.utils import WorkerSetupStatus


@dataclass(frozen=True)
class Pinned:
    """A private symbol of LitServe (or of the standard library under it) that this module uses: where it is, and
    the parameters (a function) or the assignment in LitServer's source (an attribute) it was written against."""

    module: str
    name: str  # "Class.member" or a module-level name
    parameters: tuple[str, ...] | None = None
    assigned_in: str | None = None  # for an attribute: the method of LitServer whose source assigns it


PINNED = (
    Pinned("litserve.server", "LitServer._register_internal_endpoints", ("self",)),
    Pinned(
        "litserve.server", "LitServer._register_api_endpoints", ("self", "lit_api", "request_type", "response_type")
    ),
    Pinned("litserve.server", "LitServer._register_middleware", ("self",)),
    Pinned("litserve.server", "LitServer._init_manager", ("self", "num_api_servers")),
    Pinned(
        "litserve.server",
        "LitServer._start_server",
        ("self", "port", "num_uvicorn_servers", "log_level", "sockets", "uvicorn_worker_type", "kwargs"),
    ),
    Pinned(
        "litserve.server",
        "LitServer._perform_graceful_shutdown",
        ("self", "manager", "uvicorn_workers", "shutdown_reason"),
    ),
    Pinned("litserve.server", "LitServer._get_request_queue", ("self", "api_path")),
    Pinned("litserve.server", "LitServer._transport", assigned_in="_init_manager"),
    Pinned("litserve.server", "LitServer._shutdown_event", assigned_in="_init_manager"),
    Pinned("litserve.server", "LitServer._monitor_workers", assigned_in="__init__"),
    Pinned("litserve.server", "_Server.run", ("self", "worker_id", "sockets")),
    Pinned("multiprocessing.managers", "BaseManager._process", assigned_in="start"),
)


def pinned_problems(pinned: tuple[Pinned, ...] = PINNED) -> list[str]:
    """What the installed LitServe no longer has as `pinned` says (empty: every symbol is there as expected)."""
    problems = []
    for symbol in pinned:
        where = f"{symbol.module}.{symbol.name}"
        owner_name, _, member = symbol.name.rpartition(".")
        owner: Any = import_module(symbol.module)
        try:
            if owner_name:
                owner = getattr(owner, owner_name)
            if symbol.assigned_in is not None:
                source = inspect.getsource(getattr(owner, symbol.assigned_in))
                if f"self.{member} =" not in source:
                    problems.append(f"{where}: no longer assigned in {owner_name}.{symbol.assigned_in}")
                continue
            found = getattr(owner, member)
        except (AttributeError, OSError, TypeError) as exc:
            problems.append(f"{where}: missing ({exc})")
            continue
        if symbol.parameters is not None:
            parameters = tuple(inspect.signature(found).parameters)
            if parameters != symbol.parameters:
                problems.append(f"{where}: parameters are {parameters}, not {symbol.parameters}")
    return problems


class FrontEndServer(_Server):
    """LitServe's uvicorn server for one front end, leaving Ctrl-C to the main process: uvicorn would otherwise
    start its own shutdown on it, and raise KeyboardInterrupt after it."""

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig != signal.SIGINT:
            super().handle_exit(sig, frame)


class EngineServer(ls.LitServer):
    """LitServer with its private steps routed to the hooks below; `front_end_processes`, `queue_process`,
    `request_queue` and `answer_transport` are what the rest of imgserve reads of it."""

    front_end_processes: dict[int, BaseProcess]
    queue_process: BaseProcess
    front_end_host = "0.0.0.0"  # what the front ends' logs say they listen on (LitServe binds the socket itself)

    # The hooks a server fills in.
    def add_routes(self) -> None:
        """Add the server's routes to `self.app` (LitServe would add its own endpoints here)."""
        raise NotImplementedError

    def hand_off(self, front_ends: int) -> tuple[Any, MessageTransport]:
        """The workers' request queue and the answer transport to `front_ends` front ends."""
        raise NotImplementedError

    def front_ends_started(self) -> None:
        """Every front end has been forked (the supervisor starts here)."""

    def stopping(self) -> None:
        """LitServe's shutdown starts: stop watching the children it is about to stop."""

    # LitServe's private steps.
    def _register_internal_endpoints(self) -> None:
        self._monitor_workers = False  # the server's supervisor answers for a dead worker's requests

    def _register_api_endpoints(self, lit_api: ls.LitAPI, request_type: Any, response_type: Any) -> None:
        self.add_routes()

    def _register_middleware(self) -> None:
        """The middlewares given to LitServer, without LitServe's GZip (images do not compress; it costs CPU)."""
        for middleware, kwargs in [m if isinstance(m, tuple) else (m, {}) for m in self.middlewares]:
            if middleware.__name__ != "GZipMiddleware":
                self.app.add_middleware(middleware, **kwargs)

    def _init_manager(self, num_api_servers: int) -> Any:
        """LitServe's Manager (worker status), with requests and answers through `hand_off`."""
        # A forked child (this Manager, the front ends) shares the main process's Python objects until either
        # writes to their pages, and a full garbage collection writes to every one. So the garbage is collected
        # once, before the first fork, and the collector leaves the rest alone.
        gc.collect()
        gc.freeze()
        manager = super()._init_manager(num_api_servers)
        self.litapi_request_queues[self.lit_api.api_path], self._transport = self.hand_off(num_api_servers)
        self.queue_process = manager._process
        # run() blocks on this until it is stopped (by SIGINT): a Manager event would raise EOFError the moment the
        # queue process died, before the supervisor could answer anything.
        self._shutdown_event = threading.Event()
        return manager

    def _start_server(
        self,
        port: int,
        num_uvicorn_servers: int,
        log_level: str,
        sockets: list[socket.socket],
        uvicorn_worker_type: str,
        **kwargs: Any,
    ) -> dict[int, BaseProcess]:
        """Fork the front ends one at a time (always processes), then `front_ends_started`. LitServe stops the front
        ends in the returned dict at shutdown, replacements included."""
        self._front_end_sockets = sockets
        self._front_end_config = dict(port=port, log_level=log_level, **kwargs)
        self.front_end_processes = {index: self.fork_front_end(index) for index in range(num_uvicorn_servers)}
        self.front_ends_started()
        return self.front_end_processes

    def _perform_graceful_shutdown(self, *args: Any, **kwargs: Any) -> None:
        self.stopping()
        super()._perform_graceful_shutdown(*args, **kwargs)

    # What the server uses.
    def fork_front_end(self, index: int) -> BaseProcess:
        """Fork front end `index` on the listening socket (`self.app.response_queue_id` tells it which it is)."""
        self.app.response_queue_id = index
        app = copy.copy(self.app)
        config = uvicorn.Config(
            app,
            host=self.front_end_host,
            timeout_graceful_shutdown=self.uvicorn_graceful_timeout,
            **self._front_end_config,
        )
        process = mp.get_context("fork").Process(
            target=FrontEndServer(config=config).run, args=(index, self._front_end_sockets), name=f"LitServer-{index}"
        )
        gc.freeze()  # what was made since the Manager's fork too (see _init_manager)
        process.start()
        return process

    def restart_worker(self, index: int) -> BaseProcess:
        """Start a new inference worker in place of worker `index`."""
        return self.launch_single_inference_worker(self.lit_api, index)

    def worker_starting(self, index: int) -> bool:
        """Is worker `index` still loading its model?"""
        key = f"{self.lit_api.api_path.split('/')[-1]}_{index}"
        return self.workers_setup_status.get(key) == WorkerSetupStatus.STARTING

    def setup_status(self) -> dict[str, str]:
        """Each worker's start-up status (LitServe's Manager dict)."""
        return dict(self.workers_setup_status)

    @property
    def request_queue(self) -> Any:
        return self._get_request_queue(self.lit_api.api_path)

    @property
    def answer_transport(self) -> Any:
        return self._transport
