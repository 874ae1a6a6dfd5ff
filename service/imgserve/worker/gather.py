"""Gathering a batch: how an inference worker takes requests off the request socket, without polling it.

The worker blocks on the socket, and closes a batch when it is full, when `batch_timeout_s` has passed since its
oldest request was queued, or at once when no other admitted request could join it (so a lone request never
waits for company). Each request it takes is marked in shared memory as this worker's, so its front end knows
whose death to watch for.
"""

from __future__ import annotations

import time
from queue import Empty

from imgserve.handoff.requests import RequestSocket
from imgserve.handoff.state import SharedState
from imgserve.handoff.wire import RequestMessage

IDLE_WAIT_S = 0.05  # one socket wait per 50 ms while idle; a request wakes it at once


class Gatherer:
    """Takes batches of request messages off the request socket for worker `worker`."""

    def __init__(self, requests: RequestSocket, state: SharedState, worker: int) -> None:
        self.requests, self.state, self.worker = requests, state, worker

    def batch(self, max_size: int, timeout_s: float) -> list[RequestMessage]:
        """Up to `max_size` requests, or none when none came within IDLE_WAIT_S (deadlines are checked by the
        caller, not here)."""
        first = self._take(IDLE_WAIT_S)
        if first is None:
            return []
        batch = [first]
        closes_at = first.queued + timeout_s
        while len(batch) < max_size and self.state.queue_depth > len(batch):
            request = self._take(closes_at - time.monotonic())
            if request is None:
                break
            batch.append(request)
        return batch

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
