"""Answers from the inference workers to each front end: one Unix datagram socket per front end.

A datagram is sent without waiting for anyone (no round trip through a queue process), and is delivered whole or not
at all: a worker killed while sending cannot corrupt what the others send, and there is no shared lock for it to die
holding. Answers are msgpack (`wire`); each front end's socket is a file in the server's private directory, so only
the server's user can send to it. Requests travel the same way (handoff/requests.py).
"""

from __future__ import annotations

import logging
import socket
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from imgserve.errors import ApiError
from imgserve.handoff import wire

log = logging.getLogger(__name__)
BUFFER_BYTES = 4 * 1024 * 1024  # asked of the kernel for both ends (capped by net.core.[rw]mem_max)
MAX_ANSWER_BYTES = 192 * 1024  # more than any answer not written into its slot (worker/serving.py's INLINE_BYTES)
READ_AT_ONCE = 64  # answers read per wake-up of the front end's event loop, so requests get their turn too
SEND_TIMEOUT_S = 10  # a front end that reads nothing for this long gets its answer dropped (its client: 504)
TIMEVAL = struct.Struct("ll")  # struct timeval: seconds, microseconds


class FrontEndAnswers:
    """The receiving end, bound in a front-end process and read by its event loop when the selector says so."""

    def __init__(self, address: str) -> None:
        self._socket = wire.bound_socket(address, BUFFER_BYTES)
        self._socket.setblocking(False)

    def fileno(self) -> int:
        return self._socket.fileno()

    def receive_ready(self, most: int = READ_AT_ONCE) -> Iterator[tuple[str, Any]]:
        """The answers that have arrived (up to `most`): (uid, output) each. Nothing when none is there; a datagram
        that is not an answer is dropped."""
        for _ in range(most):
            try:
                data = self._socket.recv(MAX_ANSWER_BYTES)
            except (BlockingIOError, InterruptedError):
                return
            try:
                yield wire.unpack_answer(data)
            except wire.WireError as exc:
                log.warning("dropped a datagram on the answer socket that is not an answer (%s)", exc)


class AnswerSockets:
    """Where the workers send each front end's answers: a socket per front end in the server's private directory."""

    def __init__(self, directory: Path, front_ends: int) -> None:
        self.addresses = [str(directory / f"answers-{index}") for index in range(front_ends)]
        self._sender: socket.socket | None = None  # one per process, made on first use

    def __getstate__(self) -> dict[str, Any]:
        return {"addresses": self.addresses, "_sender": None}  # a worker makes its own socket

    def receiver(self, front_end: int) -> FrontEndAnswers:
        """Bind front end `front_end`'s socket (in its own process, before it takes any request)."""
        return FrontEndAnswers(self.addresses[front_end])

    def send(self, front_end: int, uid: str, output: Any) -> None:
        """Send one answer to its front end, without waiting for it; an output that cannot travel, or is too large
        for an answer, goes as the 500 that says so."""
        try:
            data, error = wire.pack_answer(uid, output), None
        except TypeError as exc:  # a value the wire does not carry (wire.pack_answer says which)
            error = ApiError(500, "bad_model_output", str(exc))
        if error is None and len(data) > MAX_ANSWER_BYTES:
            error = ApiError(500, "answer_too_large", f"the model's answer is {len(data)} bytes")
        if error is not None:
            data = wire.pack_answer(uid, error)
        try:
            self._socket().sendto(data, self.addresses[front_end])
        except OSError as exc:  # the front end is gone (shutdown) or read nothing for SEND_TIMEOUT_S
            log.warning("an answer to front end %d was dropped: %s", front_end, exc)

    def _socket(self) -> socket.socket:
        """A blocking socket with the kernel's own send timeout: a front end whose socket is full (the kernel queues
        net.unix.max_dgram_qlen datagrams, 10 by default) puts the worker to sleep until it reads. Python's timeout
        mode would poll instead, and poll calls an unconnected datagram socket always writable: the worker would spin
        on a core the front end needs to catch up."""
        if self._sender is None:
            self._sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            self._sender.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, BUFFER_BYTES)
            self._sender.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, TIMEVAL.pack(SEND_TIMEOUT_S, 0))
        return self._sender
