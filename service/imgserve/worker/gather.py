"""Gathering a batch: how an inference worker takes requests off the models' request sockets, without polling them,
into batches that never mix models.

Each model has its own socket (its own queue). The worker blocks until one has requests, takes the models with
requests waiting in turns (so a flood of one model delays another's requests by a batch at most), and closes a batch
when it is full, when its model's batch timeout has passed since its oldest request was queued, or at once when no
other admitted request of its model could join it (so a lone request never waits for company). Each request taken
is marked in shared memory as this worker's, so its front end knows whose death to watch for.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from queue import Empty

from imgserve.handoff.requests import ModelRequests, RequestSocket
from imgserve.handoff.state import SharedState
from imgserve.handoff.wire import RequestMessage

IDLE_WAIT_S = 0.05  # one wait per 50 ms while idle; a request wakes it at once


class Gatherer:
    """Takes batches of request messages off the models' sockets for worker `worker`."""

    def __init__(self, requests: ModelRequests, state: SharedState, worker: int) -> None:
        self.requests, self.state, self.worker = requests, state, worker
        self.turn = 0  # the model whose requests are taken first, when several have some

    def batch(self, max_size: Callable[[int], int], timeout_s: Callable[[int], float]) -> list[RequestMessage]:
        """Up to `max_size(model)` requests of one model, or none when none came within IDLE_WAIT_S (deadlines are
        checked by the caller, not here)."""
        ready = self.requests.ready(IDLE_WAIT_S)
        if not ready:
            return []
        count = len(self.requests.sockets)
        model = min(ready, key=lambda index: (index - self.turn) % count)
        self.turn = (model + 1) % count
        socket = self.requests[model]
        first = self._take(socket, 0.0)
        if first is None:  # another worker took it first
            return []
        batch, size = [first], max_size(model)
        closes_at = first.queued + timeout_s(model)
        while len(batch) < size and self.state.model_queue_depth(model) > len(batch):
            request = self._take(socket, closes_at - time.monotonic())
            if request is None:
                break
            batch.append(request)
        return batch

    def _take(self, socket: RequestSocket, wait_s: float) -> RequestMessage | None:
        """The next live request within `wait_s` (none waited for when <= 0), marked as taken by this worker."""
        until = time.monotonic() + wait_s
        while True:
            try:
                request = socket.get(timeout=wait_s) if wait_s > 0 else socket.get_nowait()
            except Empty:
                return None
            # So the front end knows which worker holds it, and fails it fast if that worker dies. A request whose
            # slot has moved on to another (its front end gave up on it long ago) is dropped unanswered.
            if self.state.mark_taken(request.slot, request.ticket, self.worker):
                return request
            wait_s = until - time.monotonic()
