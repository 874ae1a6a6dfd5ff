"""Gathering a batch: how an inference worker takes requests off the queue, without polling it.

LitServe's BatchedLoop asks the queue for a request every millisecond, idle or not: an idle pod burns a third
of a core in its queue process and workers. This loop blocks on the queue instead, and closes a batch when it is
full, when `batch_timeout` has passed since its oldest request was queued, or at once when no other admitted
request could join it (so a lone request never waits for company). Each request it takes is marked in shared
memory as this worker's, where LitServe sends a START message through the queue process per request.

It also runs the batch itself (`run_batched_loop`): take the batch, predict, answer. LitServe's loop wraps each of
the API's six steps in `inspect.signature` and fires six callback events per batch, many times the cost of these
three (docs/architecture.md, "How a batch is gathered"); imgserve's API has no spec, no callbacks and no per-request
decode/encode steps in the worker, so these three are all its loop needs.
"""

from __future__ import annotations

import logging
import time
from queue import Empty, Queue
from typing import Any

from litserve import LitAPI
from litserve.callbacks import CallbackRunner
from litserve.loops import BatchedLoop
from litserve.specs.base import LitSpec
from litserve.transport.base import MessageTransport
from litserve.utils import LitAPIStatus, LoopResponseType

from imgserve.handoff.state import SharedState

log = logging.getLogger(__name__)


class QueueGone(Exception):
    """The request socket is gone: the server is stopping, and this worker's loop ends."""


IDLE_WAIT_S = 0.05  # one queue call per 50 ms while idle; a request or the stop sentinel wakes it at once
TRIM_AFTER_IDLE_S = 2.0  # a worker idle this long gives the memory of its last batches back


class GatheringLoop(BatchedLoop):
    """BatchedLoop whose batches are gathered by blocking queue reads, sized by what the pod has admitted."""

    def __init__(self, state: SharedState) -> None:
        super().__init__()
        self.state = state
        self._busy_at: float | None = None  # when the last batch was taken, until the heap is trimmed

    def run_batched_loop(
        self,
        lit_api: LitAPI,
        request_queue: Queue,
        transport: MessageTransport,
        callback_runner: CallbackRunner,
        lit_spec: LitSpec | None = None,
    ) -> None:
        """Until the request socket is gone: take a batch, predict it (one answer per request, errors included),
        send each answer to its front end. A predict that raises fails its whole batch: each is answered 500."""
        while True:
            try:
                batch = self.gather_batch(lit_api, request_queue)
            except QueueGone:
                return
            if not batch:
                continue
            try:
                answers, status = lit_api.predict([payload for _, _, payload in batch]), LitAPIStatus.OK
            except Exception:
                log.exception("the worker failed on a batch of %d", len(batch))
                answers, status = [None] * len(batch), LitAPIStatus.ERROR
            for (queue_id, uid, _), answer in zip(batch, answers, strict=True):
                self.put_response(transport, queue_id, uid, answer, status, LoopResponseType.REGULAR)

    def gather_batch(self, lit_api: LitAPI, request_queue: Queue) -> list[tuple[int, str, Any]]:
        """One batch of (response queue id, uid, payload), empty when none came while idle (deadlines are checked
        in predict, not here)."""
        first = self._take(request_queue, IDLE_WAIT_S)
        if first is None:
            if self._busy_at is not None and time.monotonic() - self._busy_at > TRIM_AFTER_IDLE_S:
                lit_api.release_memory()  # the ImageAPI's
                self._busy_at = None
            return []
        self._busy_at = time.monotonic()
        batch = [first]
        closes_at = first[2] + lit_api.batch_timeout  # [2]: when the front end queued it (monotonic clock)
        while len(batch) < lit_api.max_batch_size and self.state.queue_depth > len(batch):
            request = self._take(request_queue, closes_at - time.monotonic())
            if request is None:
                break
            batch.append(request)
        return [(queue_id, uid, payload) for queue_id, uid, _, payload in batch]

    def _take(self, request_queue: Queue, wait_s: float) -> tuple | None:
        """The next live request within `wait_s` (none waited for when <= 0), marked as taken by this worker."""
        until = time.monotonic() + wait_s
        while True:
            try:
                request = request_queue.get(timeout=wait_s) if wait_s > 0 else request_queue.get_nowait()
            except Empty:
                return None
            except (EOFError, OSError):  # the queue process died: the main process stops the server
                raise QueueGone() from None
            # So the front end knows which worker holds it, and fails it fast if that worker dies. A request whose
            # slot has moved on to another (its front end gave up on it long ago) is dropped unanswered.
            slot, ticket = request[3]["slot"]
            if self.state.mark_taken(slot, ticket, self.worker_id):
                return request
            wait_s = until - time.monotonic()
