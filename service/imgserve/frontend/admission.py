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
from collections.abc import Callable, Iterable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from imgserve.config import ServerSettings
from imgserve.errors import ApiError
from imgserve.frontend import tracing
from imgserve.frontend.telemetry import INFER_ROUTES, route, v2_model_name
from imgserve.handoff.model_state import LOADING, READY
from imgserve.handoff.state import SharedState
from imgserve.metrics import REJECTED, count_deadline
from imgserve.served import Catalog

SHED_MESSAGES = {"draining": "the server is shutting down", "queue_full": "the queue is full"}
SECONDS = re.compile(r"\d+(\.\d*)?|\.\d+")


class Admission:
    """Whether a request for a model may come in at all (draining, the model not loaded, the pod's queue or the
    model's full), and its places in the queue. `bounds(model)` gives the pod's queue bound and the model's (pod.py's
    rules, at the batch sizes the models settled on)."""

    def __init__(
        self, state: SharedState, catalog: Catalog, retry_after_s: int, bounds: Callable[[int], tuple[int, int]]
    ) -> None:
        self.state, self.catalog, self.retry_after_s, self.bounds = state, catalog, retry_after_s, bounds

    def model_of(self, path: str) -> int | None:
        """The model an inference route's path is for (its own path, or the Open Inference Protocol's infer)."""
        served = self.catalog.by_path.get(path)
        if served is None and (name := v2_model_name(path)) is not None:
            served = self.catalog.by_name.get(name)
        return None if served is None else served.index

    def shed_reason(self, model: int | None) -> str | None:
        """draining or queue_full (counted as rejected), or None when there is room; allocates nothing."""
        if self.state.draining:
            reason = "draining"
        elif model is not None and self._full(model, 1):
            reason = "queue_full"
        else:
            return None
        REJECTED.labels(reason, self.label(model)).inc()
        return reason

    def refusal(self, model: int | None) -> ApiError | None:
        """The 503 for shed_reason(model), or None."""
        reason = self.shed_reason(model)
        return None if reason is None else ApiError(503, reason, SHED_MESSAGES[reason], self.retry_after_s)

    def label(self, model: int | None) -> str:
        """The model label of a request for `model` (None: a request for no model of this server)."""
        return "" if model is None else self.catalog[model].name

    def admit(self, count: int, model: int) -> None:
        """Take `count` places in the pod's queue and the model's, all or none (release() gives them back), or raise:
        503 draining, loading or queue_full; 404 for a model not loaded; 413 when even an empty queue could not hold
        them."""
        name = self.catalog[model].name
        if self.state.draining:
            REJECTED.labels("draining", name).inc()
            raise ApiError(503, "draining", SHED_MESSAGES["draining"], self.retry_after_s)
        self._check_loaded(model, name)
        pod, own = self.bounds(model)
        if count > own:
            raise ApiError(413, "too_many_images", f"{count} images are more than this server's queue holds ({own})")
        if not self.state.try_admit(pod, count, model, own):
            REJECTED.labels("queue_full", name).inc()
            raise ApiError(503, "queue_full", f"{SHED_MESSAGES['queue_full']} ({own} requests)", self.retry_after_s)

    def release(self, count: int, model: int) -> None:
        self.state.release(count, model)

    def _full(self, model: int, count: int) -> bool:
        pod, own = self.bounds(model)
        return self.state.queue_depth + count > pod or self.state.model_queue_depth(model) + count > own

    def _check_loaded(self, model: int, name: str) -> None:
        state = self.state.models.state(model)
        if state == LOADING:
            raise ApiError(503, "model_loading", f"model {name!r} is loading", self.retry_after_s)
        if state != READY:
            raise ApiError(404, "model_unavailable", f"model {name!r} is not loaded")


class AdmissionMiddleware:
    """Receive an inference request's body under the upload bound and its deadline, unless the pod is full."""

    def __init__(self, app: ASGIApp, admission: Admission, settings: ServerSettings) -> None:
        self.app, self.admission, self.settings = app, admission, settings
        self.uploads = 0  # bodies being received by this front-end process

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or route(scope["path"]) not in INFER_ROUTES:
            return await self.app(scope, receive, send)
        state = scope.setdefault("state", {})
        model = self.admission.model_of(scope["path"])
        try:
            with tracing.step("admission", before_body=True):
                deadline = self._deadline(scope, state.get("first_byte", time.monotonic()))
                self._check_declared_size(scope)
                refusal = self.admission.refusal(model)
                if refusal is not None:
                    raise refusal
                body = await self._receive_body(receive, deadline, self.admission.label(model))
                if body is None:  # the client left, or the connection layer cut a too-slow upload
                    raise state.get("refusal") or ApiError(499, "client_disconnected", "the client left mid-upload")
        except ApiError as error:
            return await error.response(scope["path"])(scope, receive, send)
        state["deadline"] = deadline
        await self.app(scope, _replay(body, receive), send)

    async def _receive_body(self, receive: Receive, deadline: float, model: str) -> bytes | None:
        """The whole body (None if the client disconnected), held to max_uploads, max_body_bytes and the deadline."""
        if self.uploads >= self.settings.max_uploads:
            REJECTED.labels("too_many_uploads", model).inc()
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
                    count_deadline(model)
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
    headers: Iterable[tuple[bytes, bytes]] = scope["headers"]
    for key, value in headers:
        if key == name:
            return value.decode("latin-1")
    return None
