"""Requests from the front ends to the inference workers: one Unix datagram socket that every worker reads.

The main process binds one datagram socket before it starts the workers, and every worker receives on its own
inherited copy of it: the kernel hands each request, whole, to exactly one of them, with no queue process in between
(no round trip for the front end's `put` nor for the worker's `get`). There is no lock a killed worker could die
holding (a `multiprocessing.Queue` would leave its reader lock taken), and a request a killed worker had received
but not yet marked taken is queued again by its front end (`dispatch`). Only the small message travels (slot,
deadline, the item's small values), as msgpack (`wire`); the pixels are in the request's slot. The socket is a file
in the server's private directory, so only the server's user can send to it.
"""

from __future__ import annotations

import logging
import select
import socket
import time
from pathlib import Path
from queue import Empty
from typing import Any

from imgserve.handoff import wire
from imgserve.handoff.wire import RequestMessage

log = logging.getLogger(__name__)
BUFFER_BYTES = 1024 * 1024  # asked of the kernel (capped by net.core.rmem_max); the datagram count has its own cap
MAX_REQUEST_BYTES = 16 * 1024  # a request message is about 300 bytes
FOREVER_S = 24 * 3600.0


class RequestSocket:
    """The workers' shared request queue. Bound in the main process; a worker inherits the receiving
    socket (multiprocessing passes its descriptor), a forked front end sends from a socket of its own."""

    def __init__(self, directory: Path, name: str = "requests") -> None:
        self.address = str(directory / name)
        self._receiver = wire.bound_socket(self.address, BUFFER_BYTES)
        self._sender: socket.socket | None = None  # one per process, made on first use
        self._nowait_sender: socket.socket | None = None  # the same, never blocking (for an event loop)

    def __getstate__(self) -> dict[str, Any]:
        return {"address": self.address, "_receiver": self._receiver, "_sender": None, "_nowait_sender": None}

    def put(self, message: bytes) -> None:
        """Queue one request (packed by wire.pack_request); blocks while every worker is busy and the socket's queue
        is full."""
        if self._sender is None:
            self._sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sender.sendto(message, self.address)

    def put_nowait(self, message: bytes) -> bool:
        """Queue one packed request if the socket's queue has room now; False (nothing sent) when it is full."""
        if self._nowait_sender is None:
            self._nowait_sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            self._nowait_sender.setblocking(False)
        try:
            self._nowait_sender.sendto(message, self.address)
        except (BlockingIOError, InterruptedError):
            return False
        return True

    def get(self, block: bool = True, timeout: float | None = None) -> RequestMessage:
        """The next request, as `queue.Queue.get`: raises `queue.Empty` when none comes within `timeout`.

        The socket is always in timeout mode (non-blocking underneath, which every worker's copy shares): a worker
        woken for a datagram another worker took first goes back to waiting instead of blocking in `recv`. A datagram
        that is not a request is dropped."""
        until = time.monotonic() + (FOREVER_S if timeout is None else timeout)
        while True:
            self._receiver.settimeout(max(until - time.monotonic(), 0.0) if block else 0.0)
            try:
                data = self._receiver.recv(MAX_REQUEST_BYTES)
            except (TimeoutError, BlockingIOError):
                raise Empty from None
            try:
                return wire.unpack_request(data)
            except wire.WireError as exc:
                log.warning("dropped a datagram on the request socket that is not a request (%s)", exc)

    def fileno(self) -> int:
        return self._receiver.fileno()

    def get_nowait(self) -> RequestMessage:
        return self.get(block=False)


class ModelRequests:
    """One request socket per model, so each model has its own queue: a worker takes its next batch from the models
    with requests waiting in turns (`ready`), and a flood of one model never stands in front of another's requests."""

    def __init__(self, directory: Path, models: int) -> None:
        self.sockets = [self.socket(directory, model) for model in range(models)]

    @staticmethod
    def socket(directory: Path, model: int) -> RequestSocket:
        return RequestSocket(directory, f"requests-{model}")

    def __getitem__(self, model: int) -> RequestSocket:
        return self.sockets[model]

    def ready(self, timeout_s: float) -> list[int]:
        """The models with requests waiting, once one has some (none after `timeout_s`). Every worker is woken; those
        that find the request taken by another wait again."""
        try:
            readable, _, _ = select.select(self.sockets, [], [], timeout_s)
        except InterruptedError:
            return []
        models = {socket.fileno(): model for model, socket in enumerate(self.sockets)}  # this process's descriptors
        return [models[found.fileno()] for found in readable]
