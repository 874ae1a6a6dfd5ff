"""Admission: the per-pod queue bound, drain refusal, body-size limit and each request's deadline.

It runs before the body is read, so an overloaded pod answers 503 at once instead of queueing without limit.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.config import Settings
from service.errors import ApiError
from service.metrics import REJECTED
from service.state import SharedState

PREDICT_PATHS = ("/predict", "/v1/images:predict")


def queue_bound(settings: Settings, workers: int, batch_size: int) -> int:
    """max_queue_depth, or max batch size x workers x 4 when it is 0 (four batches per worker of headroom)."""
    return settings.max_queue_depth or batch_size * workers * 4


class AdmissionMiddleware:
    """Admit a predict request only while the pod has room; stamp its deadline; count it out when answered."""

    def __init__(self, app: ASGIApp, state: SharedState, settings: Settings, limit: Callable[[], int]) -> None:
        self.app, self.state, self.settings, self.limit = app, state, settings, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in PREDICT_PATHS:
            return await self.app(scope, receive, send)
        try:
            deadline = self._deadline(scope)
            self._check_declared_size(scope)
        except ApiError as error:
            return await error.response()(scope, receive, send)
        if self.state.draining:
            return await self._shed(scope, receive, send, "draining", "the server is shutting down")
        limit = self.limit()
        if not self.state.try_admit(limit):
            return await self._shed(scope, receive, send, "queue_full", f"the queue is full ({limit} requests)")
        scope.setdefault("state", {})["deadline"] = deadline
        try:
            await self.app(scope, self._limited(receive), send)
        finally:
            self.state.release()

    async def _shed(self, scope: Scope, receive: Receive, send: Send, reason: str, message: str) -> None:
        REJECTED.labels(reason).inc()
        error = ApiError(503, reason, message, retry_after=self.settings.retry_after_s)
        await error.response()(scope, receive, send)

    def _deadline(self, scope: Scope) -> float:
        """Monotonic time by which the answer is due: X-Request-Timeout (capped) or the default."""
        timeout = self.settings.request_timeout_s
        raw = _header(scope, b"x-request-timeout")
        if raw is not None:
            try:
                timeout = float(raw)
            except ValueError:
                timeout = -1.0
            if not 0 < timeout < float("inf"):
                raise ApiError(422, "bad_timeout", "X-Request-Timeout must be a positive number of seconds")
            timeout = min(timeout, self.settings.max_request_timeout_s)
        return time.monotonic() + timeout

    def _check_declared_size(self, scope: Scope) -> None:
        raw = _header(scope, b"content-length")
        if raw is not None and raw.isdigit() and int(raw) > self.settings.max_body_bytes:
            raise _too_large(self.settings.max_body_bytes)

    def _limited(self, receive: Receive) -> Receive:
        """The body as it streams in, cut off at max_body_bytes (chunked uploads declare no length)."""
        seen = 0

        async def receive_limited() -> Message:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.settings.max_body_bytes:
                raise _too_large(self.settings.max_body_bytes)
            return message

        return receive_limited


def _too_large(limit: int) -> ApiError:
    return ApiError(413, "body_too_large", f"the request body is over the limit of {limit} bytes")


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return None
