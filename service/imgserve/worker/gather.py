"""Gathering a batch: how an inference worker takes requests off the request socket, without polling it, into batches
that never mix models.

The worker blocks on the socket, and closes a batch when it is full, when its model's batch timeout has passed since
its oldest request was queued, or at once when no other admitted request of its model could join it (so a lone
request never waits for company). A request of another model taken meanwhile waits in the worker for the next batch
(it is this worker's already), so every model's requests keep their order. Each request taken is marked in shared
memory as this worker's, so its front end knows whose death to watch for.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from queue import Empty

from imgserve.handoff.requests import RequestSocket
from imgserve.handoff.state import SharedState
from imgserve.handoff.wire import RequestMessage

IDLE_WAIT_S = 0.05  # one socket wait per 50 ms while idle; a request wakes it at once


class Gatherer:
    """Takes batches of request messages off the request socket for worker `worker`."""

    def __init__(self, requests: RequestSocket, state: SharedState, worker: int) -> None:
        self.requests, self.state, self.worker = requests, state, worker
        self.waiting: collections.deque[RequestMessage] = collections.deque()  # taken, for a later batch

    def batch(self, max_size: Callable[[int], int], timeout_s: Callable[[int], float]) -> list[RequestMessage]:
        """Up to `max_size(model)` requests of one model, or none when none came within IDLE_WAIT_S (deadlines are
        checked by the caller, not here)."""
        first = self.waiting.popleft() if self.waiting else self._take(IDLE_WAIT_S)
        if first is None:
            return []
        model, size = first.model, max_size(first.model)
        batch = [first]
        for waiting in [one for one in self.waiting if one.model == model][: size - 1]:
            self.waiting.remove(waiting)
            batch.append(waiting)
        closes_at = first.queued + timeout_s(model)
        while len(batch) < size and self.state.model_queue_depth(model) > len(batch) + self._waiting_of(model):
            request = self._take(closes_at - time.monotonic())
            if request is None:
                break
            if request.model == model:
                batch.append(request)
            else:
                self.waiting.append(request)
        return batch

    def _waiting_of(self, model: int) -> int:
        return sum(request.model == model for request in self.waiting)

    def _take(self, wait_s: float) -> RequestMessage | None:
        """The next live request within `wait_s` (none waited for when <= 0), marked as taken by this worker."""
        until = time.monotonic() + wait_s
        while True:
            try:
                request = self.requests.get(timeout=wait_s) if wait_s > 0 else self.requests.get_nowait()
            except Empty:
                return None
            # So the front end knows which worker holds it, and fails it fast if that worker dies. A request whose
            # slot has moved on to another (its front end gave up on it long ago) is dropped unanswered.
            if self.state.mark_taken(request.slot, request.ticket, self.worker):
                return request
            wait_s = until - time.monotonic()
