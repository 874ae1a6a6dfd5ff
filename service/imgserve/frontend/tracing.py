"""The front end's side of a request's trace, and its request id.

Every HTTP request gets an id (`RequestMiddleware`, the outermost): the caller's X-Request-ID when it is safe, else a
new one (tracing.request_id); over v2 the body's own `id`, once read and when safe, replaces it (`adopt`). The answer
echoes it in X-Request-ID and the access-log line (--access-log) ends with it. With tracing on, the middleware also
makes the request's server span, which continues the caller's trace from its `traceparent`/`tracestate` headers
(OpenTelemetry's propagators, OTEL_PROPAGATORS) or starts a new one; the steps below it are `step` spans: `admission`
(limits, the deadline, the body received; it takes the request's id when the server span ends), `read` (the body
parsed into the call), `infer` (the call's places in the pod's queue and its items), per item `decode_request`,
`hand-off` (queued to the workers until the answer came back: the worker's `queue` and `batch` spans hang under it)
and `encode_response`. A gRPC inference is the same under its own server span (`grpc_request`); the connection
layer's early 503 is a server span of its own that ends at once (`shed`). An error is recorded on the span where it
happened (a refusal's reason in `imgserve.refusal`) and on the server span.

With tracing off (tracing.enabled(): nothing set) `TRACER` stays None and no span is made, no context read or
written: `step` is one shared do-nothing context manager.
"""

from __future__ import annotations

import contextlib
import logging
import time
import urllib.parse
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from imgserve import tracing
from imgserve.errors import from_exception
from imgserve.frontend import telemetry

ACCESS = logging.getLogger("imgserve.access")
TRACER: Any = None  # this front end's tracer when tracing is on (start)
LOG_ACCESS = False
NO_SPAN = contextlib.nullcontext()
CARRIED = ("traceparent", "tracestate")  # the W3C Trace Context headers (and gRPC metadata keys)
MAX_CONTEXT = 512  # longer trace-context values are ignored (tracestate holds at most 512 characters)
Pairs = Iterable[tuple[str, Any]]  # headers as text, or a gRPC call's metadata


@dataclass
class _Request:
    """The request a span belongs to: its id, its server span (which learns every error of its steps; None with
    tracing off), and the spans held open until its id is settled (with the times they ended)."""

    id: str
    span: Any = None
    held: list[tuple[Any, int]] = field(default_factory=list)


_REQUEST: ContextVar[_Request | None] = ContextVar("imgserve_request", default=None)


def start(access_log: bool) -> None:
    """In a front-end process, as it starts: write the access log or not, and trace when the environment says so."""
    global TRACER, LOG_ACCESS
    LOG_ACCESS = access_log
    if tracing.enabled():
        TRACER = tracing.provider("frontend").get_tracer("imgserve")


def step(name: str, item: int | None = None, before_body: bool = False) -> contextlib.AbstractContextManager[Any]:
    """A span for one step of the current request, of its item `item` when given (the span, or None with tracing
    off). A step `before_body` that succeeds is ended (at the time it ended) with its server span, when the body can
    no longer change the request's id (`adopt`)."""
    if TRACER is None:
        return NO_SPAN
    return _span(name, {} if item is None else {tracing.ITEM: item}, before_body)


@contextlib.contextmanager
def _span(name: str, attributes: dict[str, Any], before_body: bool) -> Iterator[Any]:
    request = _REQUEST.get()
    with TRACER.start_as_current_span(
        name, attributes=attributes, record_exception=False, set_status_on_exception=False, end_on_exit=False
    ) as span:
        held = False
        try:
            yield span
            held = before_body
        except Exception as exc:
            failed(span, exc)
            if request is not None:
                failed(request.span, exc)
            raise
        finally:
            if held and request is not None:
                request.held.append((span, time.time_ns()))
            else:
                _end(span, request)


def _end(span: Any, request: _Request | None, end_ns: int | None = None) -> None:
    """End `span` with the request's id as it is now."""
    if request is not None:
        span.set_attribute(tracing.REQUEST_ID, request.id)
    span.end(end_ns)


def adopt(given: str | None) -> None:
    """The request's own id, read from its body (v2's `id`), when it is safe to echo, becomes the current request's
    id: echoed, logged, and on its spans, those that ended before it was read included."""
    request, found = _REQUEST.get(), tracing.safe_id(given)
    if request is None or found is None:
        return
    request.id = found
    if request.span is not None:
        request.span.set_attribute(tracing.REQUEST_ID, found)


def failed(span: Any, exc: BaseException) -> None:
    """Record `exc` on `span`: an ApiError as its code (and a refusal's reason), anything else as an exception."""
    error = from_exception(exc)
    if error is not None:
        return tracing.failed(span, error.status, error.code, error.message)
    span.record_exception(exc)
    tracing.failed(span, 500, type(exc).__name__, f"{type(exc).__name__}: {exc}"[:300])


def to_worker(span: Any) -> str:
    """What travels to the worker for a `hand-off` span: "" unless the span is sampled (the worker makes no span)."""
    if span is None:
        return ""
    context = span.get_span_context()
    request = _REQUEST.get()
    if not context.trace_flags.sampled or request is None:
        return ""
    parent = tracing.traceparent(context.trace_id, context.span_id, context.trace_flags)
    return tracing.carry(parent, request.id)


@contextlib.contextmanager
def _served(name: str, carrier: Pairs, request: _Request, attributes: dict[str, Any]) -> Iterator[Any]:
    """The server span of one request, the current span of its steps."""
    from opentelemetry import propagate
    from opentelemetry.trace import SpanKind

    found = {key: value for key, value in carrier if key in CARRIED and isinstance(value, str)}
    parent = propagate.extract({key: value for key, value in found.items() if len(value) <= MAX_CONTEXT})
    attributes[tracing.REQUEST_ID] = request.id
    with TRACER.start_as_current_span(
        name, context=parent, kind=SpanKind.SERVER, attributes=attributes, record_exception=False,
        set_status_on_exception=False,
    ) as span:  # fmt: skip
        request.span = span
        token = _REQUEST.set(request)
        try:
            yield span
        except Exception as exc:
            failed(span, exc)
            raise
        finally:
            _REQUEST.reset(token)
            for held, end_ns in request.held:
                _end(held, request, end_ns)


class RequestMiddleware:
    """Every HTTP request's id (echoed, logged) and, with tracing on, its server span."""

    def __init__(self, app: ASGIApp, model_of: Callable[[str], str]) -> None:
        self.app, self.model_of = app, model_of  # a path's model label

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        request = _Request(tracing.request_id(_header(scope, b"x-request-id")))
        status = 500

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message = {**message, "headers": [*message.get("headers", ()), (b"x-request-id", request.id.encode())]}
            await send(message)

        token = _REQUEST.set(request)
        try:
            if TRACER is None:
                return await self.app(scope, receive, send_with_id)
            route = telemetry.route(scope["path"])
            attributes = {
                "http.request.method": scope["method"],
                "http.route": route,
                tracing.MODEL: self.model_of(scope["path"]),
            }
            headers = ((key.decode("latin-1"), value.decode("latin-1")) for key, value in scope["headers"])
            with _served(f"{scope['method']} {route}", headers, request, attributes) as span:
                try:
                    await self.app(scope, receive, send_with_id)
                finally:
                    _answered(span, status)
        finally:
            _REQUEST.reset(token)
            if LOG_ACCESS:
                client, version = scope.get("client"), scope["http_version"]
                _log_access(client, scope["method"], _target(scope), version, status, request.id)


def _answered(span: Any, status: int) -> None:
    """The server span learns the status it answered with; a 5xx is an error (a 4xx is the client's)."""
    from opentelemetry.trace import StatusCode

    span.set_attribute("http.response.status_code", status)
    if status >= 500:
        span.set_status(StatusCode.ERROR)


def grpc_request(
    request_id: str, metadata: Pairs | None, model: str, codes: Mapping[int, int]
) -> contextlib.AbstractContextManager[Any]:
    """The server span of one gRPC inference (ModelInfer, or one request of a stream), with tracing on; `codes` maps
    an ApiError's HTTP status to the gRPC status code it answers with."""
    return NO_SPAN if TRACER is None else _grpc_served(request_id, metadata or (), model, codes)


@contextlib.contextmanager
def _grpc_served(request_id: str, metadata: Pairs, model: str, codes: Mapping[int, int]) -> Iterator[Any]:
    service, method = "inference.GRPCInferenceService", "ModelInfer"
    attributes = {"rpc.system": "grpc", "rpc.service": service, "rpc.method": method, tracing.MODEL: model}
    code = 0  # OK
    with _served(f"{service}/{method}", metadata, _Request(request_id), attributes) as span:
        try:
            yield span
        except BaseException as exc:
            error = from_exception(exc)
            code = 1 if not isinstance(exc, Exception) else 13 if error is None else codes.get(error.status, 13)
            raise  # CANCELLED, INTERNAL, or the error's own
        finally:
            span.set_attribute("rpc.grpc.status_code", code)


def grpc_request_id(given: str, metadata: Pairs | None) -> str:
    """A gRPC inference's request id: the request's own `id`, else the call's x-request-id metadata, when safe; else
    a new one."""
    if not given:
        given = next((value for key, value in metadata or () if key == "x-request-id" and isinstance(value, str)), "")
    return tracing.request_id(given or None)


def shed(headers: list[tuple[bytes, bytes]], path: str, reason: str, answer: bytes, client: Any) -> bytes:
    """The connection layer's 503 for a request it sheds before any ASGI work: `answer` with the request's id, its
    access-log line, and with tracing on its whole (one-span) trace."""
    request_id = tracing.request_id(_header({"headers": headers}, b"x-request-id"))
    if TRACER is not None:
        route = telemetry.route(path)
        attributes = {"http.request.method": "POST", "http.route": route, tracing.REFUSAL: reason}
        pairs = ((key.decode("latin-1"), value.decode("latin-1")) for key, value in headers)
        with _served(f"POST {route}", pairs, _Request(request_id), attributes) as span:
            span.set_attribute("error.type", reason)
            _answered(span, 503)
    if LOG_ACCESS:
        _log_access(client, "POST", urllib.parse.quote(path), "1.1", 503, request_id)
    status_line, _, rest = answer.partition(b"\r\n")
    return b"%s\r\nx-request-id: %s\r\n%s" % (status_line, request_id.encode(), rest)


def _log_access(client: Any, method: str, target: str, version: str, status: int, request_id: str) -> None:
    """uvicorn's access-log line, with the request id at its end."""
    where = f"{client[0]}:{client[1]}" if client else "-"
    ACCESS.info('%s - "%s %s HTTP/%s" %d request_id=%s', where, method, target, version, status, request_id)


def _target(scope: Scope) -> str:
    query = scope.get("query_string", b"")
    path = urllib.parse.quote(scope["path"])  # as uvicorn writes it: no control characters reach the log
    return path + (f"?{query.decode('ascii', 'replace')}" if query else "")


def _header(scope: Mapping[str, Any], name: bytes) -> str | None:
    headers: Iterable[tuple[bytes, bytes]] = scope["headers"]
    for key, value in headers:
        if key == name:
            return value.decode("latin-1")
    return None
