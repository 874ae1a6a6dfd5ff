"""Admission: drain refusal, the upload bound, body-size limit, each request's deadline and the per-pod queue bound.

Two separate bounds, so that slow uploads cannot hold the capacity complete requests need: at most `max_uploads`
bodies are being received at once (per front-end process), and a request's images take their places in the pod's
queue (`max_queue_depth`, what `imgserve_queue_depth` counts) only once its whole body is in and parsed
(frontend/inference.py, one place per image). A pod already full or draining answers 503 before reading the body
(the connection layer does it even earlier, see connections.py). This holds for every inference route: /predict
and the Open Inference Protocol's HTTP infer (gRPC goes straight to frontend/inference.py).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from imgserve.config import ServerSettings
from imgserve.errors import ApiError
from imgserve.frontend import tracing
from imgserve.frontend.telemetry import INFER_ROUTES, route
from imgserve.handoff.state import SharedState
from imgserve.metrics import REJECTED

SHED_MESSAGES = {"draining": "the server is shutting down", "queue_full": "the queue is full"}
SECONDS = re.compile(r"\d+(\.\d*)?|\.\d+")


class Admission:
    """The pod-wide decision whether a new request may come in at all (draining, queue full)."""

    def __init__(self, state: SharedState, settings: ServerSettings, limit: Callable[[], int]) -> None:
        self.state, self.settings, self.limit = state, settings, limit
        self._rejected = {reason: REJECTED.labels(reason) for reason in SHED_MESSAGES}

    def shed_reason(self) -> str | None:
        """draining or queue_full (counted as rejected), or None when there is room; allocates nothing."""
        if self.state.draining:
            reason = "draining"
        elif self.state.queue_depth >= self.limit():
            reason = "queue_full"
        else:
            return None
        self._rejected[reason].inc()
        return reason

    def refusal(self) -> ApiError | None:
        """The 503 for shed_reason(), or None."""
        reason = self.shed_reason()
        return None if reason is None else ApiError(503, reason, SHED_MESSAGES[reason], self.settings.retry_after_s)

    def admit(self, count: int = 1) -> None:
        """Take `count` places in the pod's queue, all or none (release() gives them back), or raise 503 (draining,
        queue_full; 413 when even an empty queue could not hold them)."""
        refusal = self.refusal()
        if refusal is not None:
            raise refusal
        limit = self.limit()
        if count > limit:
            raise ApiError(413, "too_many_images", f"{count} images are more than this server's queue holds ({limit})")
        if not self.state.try_admit(limit, count):
            self._rejected["queue_full"].inc()
            message = f"{SHED_MESSAGES['queue_full']} ({limit} requests)"
            raise ApiError(503, "queue_full", message, self.settings.retry_after_s)

    def release(self, count: int = 1) -> None:
        self.state.release(count)


class AdmissionMiddleware:
    """Receive an inference request's body under the upload bound and its deadline, unless the pod is full."""

    def __init__(self, app: ASGIApp, admission: Admission, settings: ServerSettings) -> None:
        self.app, self.admission, self.settings = app, admission, settings
        self.uploads = 0  # bodies being received by this front-end process

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or route(scope["path"]) not in INFER_ROUTES:
            return await self.app(scope, receive, send)
        state = scope.setdefault("state", {})
        try:
            with tracing.step("admission"):
                deadline = self._deadline(scope, state.get("first_byte", time.monotonic()))
                self._check_declared_size(scope)
                refusal = self.admission.refusal()
                if refusal is not None:
                    raise refusal
                body = await self._receive_body(receive, deadline)
                if body is None:  # the client left, or the connection layer cut a too-slow upload
                    raise state.get("refusal") or ApiError(499, "client_disconnected", "the client left mid-upload")
        except ApiError as error:
            return await error.response(scope["path"])(scope, receive, send)
        state["deadline"] = deadline
        await self.app(scope, _replay(body, receive), send)

    async def _receive_body(self, receive: Receive, deadline: float) -> bytes | None:
        """The whole body (None if the client disconnected), held to max_uploads, max_body_bytes and the deadline."""
        if self.uploads >= self.settings.max_uploads:
            REJECTED.labels("too_many_uploads").inc()
            raise ApiError(503, "too_many_uploads", "too many uploads in progress", self.settings.retry_after_s)
        self.uploads += 1
        try:
            chunks, seen, more = [], 0, True
            while more:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return None
                chunk, more = message.get("body", b""), message.get("more_body", False)
                seen += len(chunk)
                if seen > self.settings.max_body_bytes:
                    raise _too_large(self.settings.max_body_bytes)
                if more and time.monotonic() > deadline:
                    REJECTED.labels("deadline").inc()
                    raise ApiError(504, "deadline", "the upload did not end before the request's deadline")
                chunks.append(chunk)
            return b"".join(chunks)
        finally:
            self.uploads -= 1

    def _deadline(self, scope: Scope, start: float) -> float:
        """Monotonic time by which the answer is due, from the request's first byte: X-Request-Timeout or default."""
        timeout = self.settings.request_timeout_s
        raw = _header(scope, b"x-request-timeout")
        if raw is not None:
            timeout = float(raw) if SECONDS.fullmatch(raw.strip()) else 0.0
            if not 0 < timeout < float("inf"):
                raise ApiError(422, "bad_timeout", "X-Request-Timeout must be a positive number of seconds")
            timeout = min(timeout, self.settings.max_request_timeout_s)
        return start + timeout

    def _check_declared_size(self, scope: Scope) -> None:
        raw = _header(scope, b"content-length")
        if raw is not None and raw.isdigit() and int(raw) > self.settings.max_body_bytes:
            raise _too_large(self.settings.max_body_bytes)


def _replay(body: bytes, receive: Receive) -> Receive:
    """The body, already received, as one message; after it, the connection's own events (disconnect)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay


def _too_large(limit: int) -> ApiError:
    return ApiError(413, "body_too_large", f"the request body is over the limit of {limit} bytes")


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return None
