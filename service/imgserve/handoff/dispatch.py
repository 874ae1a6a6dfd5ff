"""The front end's side of the hand-off to the inference workers: slots, small messages, answers.

The event loop sends each request to the workers' datagram socket itself, without blocking (a sender thread takes
over only while that socket's queue is full, every worker busy), and reads the answers from this front end's
datagram socket (`answers`) as the selector reports them: no thread hop on the way there or back. The pixels go through
the request's shared-memory slot (`slots`); a slot is reused only once its worker has answered (or died),
never while a worker may still read or write it, even when the client has long had its 504.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from imgserve import heap, metrics
from imgserve.errors import ApiError
from imgserve.handoff import items, wire
from imgserve.handoff.answers import FrontEndAnswers
from imgserve.handoff.requests import MAX_REQUEST_BYTES, ModelRequests
from imgserve.handoff.slots import SlotFiles
from imgserve.handoff.state import SharedState

log = logging.getLogger(__name__)
WORKER_CHECK_S = 0.25  # how often a waiting request looks for its worker's death
ORPHAN_GRACE_S = 10.0  # a slot whose request no worker ever took is freed this long after the deadline
INLINE_BYTES = 1024  # bytes up to this size travel in the request message, larger ones in the slot
IDLE_SLOT_S = 5.0  # a free slot unused this long gives its memory back (so a burst's /dev/shm use ends with it)
BUSY_TRIM_S = 60.0  # under a long load, a front end gives its free heap memory back this often


@dataclass
class _Pending:
    """A request handed to the workers whose answer has not come yet (its handler may have given up on it)."""

    uid: str
    slot: int
    ticket: int
    model: int
    submitted: float
    deadline: float
    message: bytes  # packed (wire.pack_request), kept to be sent again if its worker died holding it
    answer: asyncio.Future[Any] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    given_up: bool = False
    resent: bool = False


class Slot:
    """One request's slot while its handler holds it: place the item, submit it to its model, read the answer."""

    def __init__(self, dispatcher: Dispatcher, index: int, ticket: int, model: int, label: str) -> None:
        self.dispatcher, self.index, self.ticket = dispatcher, index, ticket
        self.model, self.label = model, label  # the model's index (the catalog's) and name
        self.pending: _Pending | None = None

    def place(self, item: Any) -> Any:
        """Write the item's arrays and large bytes into the slot (items.place); what remains travels in the
        message. TypeError for a value that cannot travel."""
        return items.place(item, self._write, inline_bytes=INLINE_BYTES)

    async def submit(self, item: Any, deadline: float, trace: str = "") -> Any:
        """Queue the placed item for a worker and wait for its answer, until the deadline or the worker's death;
        `trace` travels with it (wire.RequestMessage)."""
        return await self.dispatcher.submit(self, item, deadline, trace)

    def result(self, answer: Any) -> Any:
        """The worker's answer, with what lies in the slot read back."""
        return items.resolve(answer, self._read)

    def _write(self, array: np.ndarray, offset: int) -> None:
        self.dispatcher.files.write(self.index, array, offset)

    def _read(self, offset: int, shape: tuple[int, ...], dtype: str) -> np.ndarray:
        return self.dispatcher.files.read(self.index, shape, dtype, offset)


class Dispatcher:
    """Built in the main process, started in each forked front end (`start`), used by its request handlers."""

    def __init__(self, state: SharedState, directory: Path, slots_per_front_end: int, retry_after_s: int) -> None:
        self.state, self.directory, self.slots_per_front_end = state, directory, slots_per_front_end
        self.retry_after_s = retry_after_s

    def start(self, front_end: int, requests: ModelRequests, answers: FrontEndAnswers) -> None:
        """In the front-end process, on its event loop: claim its slot range, read answers on the loop, and start
        the sender thread (for when the workers' queue is full)."""
        self.files = SlotFiles(self.directory)
        first = front_end * self.slots_per_front_end
        self._free = list(range(first, first + self.slots_per_front_end))
        self._freed_at: dict[int, float] = {}  # free slots that still hold data, and since when
        self._burst_over = False  # slots went idle: the heap is trimmed once no request is pending
        self._trimmed_at = time.monotonic()
        # Tickets never repeat across front-end restarts: a request of this front end's dead predecessor still
        # queued for its slot must not pass for a new one (one ticket a microsecond is more than a process makes).
        self._tickets = itertools.count(time.monotonic_ns() // 1000)
        self._pending: dict[str, _Pending] = {}
        self._front_end, self._requests = front_end, requests
        self._outboxes: dict[int, queue.SimpleQueue[bytes]] = {}  # per model, with its sender thread, made when needed
        self._loop = asyncio.get_running_loop()
        self._answers = answers
        self._loop.add_reader(answers.fileno(), self._read_answers)
        self._sweeper = self._loop.create_task(self._sweep())

    @contextlib.asynccontextmanager
    async def slot(self, model: int, label: str) -> AsyncIterator[Slot]:
        """A free slot for one request of `model` (`label` its name); freed on the way out, or left to its worker's
        answer if one may come."""
        if not self._free:
            metrics.REJECTED.labels("queue_full", label).inc()
            raise ApiError(503, "queue_full", "every request slot of this front end is in use", self.retry_after_s)
        index = self._free.pop()  # last freed first: the slots in use stay few and warm
        self._freed_at.pop(index, None)
        metrics.SLOTS_IN_USE.inc()
        slot = Slot(self, index, next(self._tickets), model, label)
        self.state.set_owner(index, slot.ticket)
        try:
            yield slot
        finally:
            if slot.pending is None or slot.pending.answer.done():
                self._release(index)
            else:  # a worker has it or may still take it: the slot waits for that answer, or the worker's death
                slot.pending.given_up = True

    async def submit(self, slot: Slot, item: Any, deadline: float, trace: str = "") -> Any:
        uid, now = f"{self._front_end}.{slot.ticket:x}", time.monotonic()  # unique, and cheaper than a uuid4
        fields = (self._front_end, uid, slot.index, slot.ticket, slot.model, now, deadline, item, trace)
        request = wire.RequestMessage(*fields)
        message = wire.pack_request(request)
        if len(message) > MAX_REQUEST_BYTES:
            raise ApiError(
                500,
                "item_too_large",
                f"decode_request returned over {MAX_REQUEST_BYTES} bytes of plain values: return arrays or bytes "
                "for large data (they travel in shared memory)",
            )
        pending = _Pending(uid, slot.index, slot.ticket, slot.model, now, deadline, message)
        slot.pending = self._pending[uid] = pending
        self._send(slot.model, message)
        output = await self._wait(pending, slot.label)
        if isinstance(output, ApiError):
            if output.code == "deadline":  # the worker dropped it unrun before this front end's timer said so
                metrics.count_deadline(slot.label)
            raise output
        return output

    async def _wait(self, pending: _Pending, label: str) -> Any:
        while not pending.answer.done():
            remaining = pending.deadline - time.monotonic()
            if remaining <= 0:
                metrics.count_deadline(label)
                raise ApiError(504, "deadline", "no answer before the request's deadline")
            if self._lost(pending):
                metrics.REJECTED.labels("worker_lost", label).inc()
                raise ApiError(503, "worker_lost", "the inference worker died", self.retry_after_s)
            self._resend_if_lost_in_transit(pending)
            await asyncio.wait((pending.answer,), timeout=min(remaining, WORKER_CHECK_S))
        return pending.answer.result()

    def _resend_if_lost_in_transit(self, pending: _Pending) -> None:
        """A worker killed while it was being handed a request takes that request with it, untaken: once a worker
        has died since a request was queued, the request is queued again. If the first copy was still queued,
        whichever copy a worker takes first is run and the other is dropped (SharedState.mark_taken)."""
        if pending.resent or self.state.last_loss() <= pending.submitted:
            return
        if self.state.taken_by(pending.slot, pending.ticket) is None:
            pending.resent = True
            self._send(pending.model, pending.message)

    def _lost(self, pending: _Pending) -> bool:
        """Will no answer come? The worker process that took it died."""
        return self.state.taker_died(pending.slot, pending.ticket)

    def _release(self, index: int) -> None:
        self.files.trim(index)
        self._free.append(index)
        self._freed_at[index] = time.monotonic()
        metrics.SLOTS_IN_USE.dec()

    def _deliver(self, uid: str, output: Any) -> None:
        """Wake the request's handler, or free a given-up request's slot."""
        pending = self._pending.pop(uid, None)
        if pending is None:
            return  # an answer for a request whose slot was already freed (its worker was given up on)
        pending.answer.set_result(output)
        if pending.given_up:
            self._release(pending.slot)

    async def _sweep(self) -> None:
        """Once a second: free the slots of given-up requests whose answer will never come (their worker died, or
        none took it), and empty the free slots that have not been used for a while."""
        while True:
            await asyncio.sleep(1.0)
            now = time.monotonic()
            idle = [index for index, freed_at in self._freed_at.items() if now - freed_at > IDLE_SLOT_S]
            for index in idle:
                self.files.trim(index, keep_bytes=0)
                del self._freed_at[index]
            self._burst_over = self._burst_over or bool(idle)
            # The decoding threads' heap memory goes back once a burst is over, and once a minute under a long
            # load (their arenas fragment under a mix of image sizes).
            if (self._burst_over and not self._pending) or now - self._trimmed_at > BUSY_TRIM_S:
                heap.trim()
                self._burst_over, self._trimmed_at = False, now
            for pending in [p for p in self._pending.values() if p.given_up]:
                taken = self.state.taken_by(pending.slot, pending.ticket) is not None
                if self._lost(pending) or (not taken and now > pending.deadline + ORPHAN_GRACE_S):
                    del self._pending[pending.uid]
                    self._release(pending.slot)

    # The hand-off itself.
    def _send(self, model: int, message: bytes) -> None:
        """Queue a request for the workers on its model's socket from the event loop; that model's sender thread
        queues it (waiting for room) when the socket's queue is full, or while the model's earlier requests still
        wait for room (so each model's order holds, and one model's full queue holds back no other's)."""
        outbox = self._outboxes.get(model)
        with contextlib.suppress(OSError):  # the workers' socket is gone: the server is stopping (see _lost)
            if (outbox is None or outbox.empty()) and self._requests[model].put_nowait(message):
                return
        if outbox is None:
            outbox = self._outboxes[model] = queue.SimpleQueue()
            threading.Thread(
                target=self._send_forever, args=(model, outbox), name="imgserve-sender", daemon=True
            ).start()
        outbox.put(message)

    def _send_forever(self, model: int, outbox: queue.SimpleQueue[bytes]) -> None:
        while True:
            message = outbox.get()
            try:
                self._requests[model].put(message)
            except OSError:  # the workers' socket is gone: the server is stopping
                return

    def _read_answers(self) -> None:
        """On the event loop, when answers have arrived: deliver what is there (a bounded number per call)."""
        for uid, output in self._answers.receive_ready():
            self._deliver(uid, output)
