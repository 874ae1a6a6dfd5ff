"""The connection layer: uvicorn's httptools protocol with the limits that stop one client from starving the others.

httptools bounds neither headers nor time, so each connection here is held to: `max_connections` open at once (503),
`header_timeout_s` for the request line and headers (408), `max_header_bytes` / `max_headers` (431), `body_timeout_s` of
silence and `min_upload_rate` within a body (408). Each refusal is a pre-built JSON error with `Connection: close`, then
a lingering close (our side shut, the client's late bytes read and dropped for a moment) so that a client still sending
reads its answer instead of a reset. An answer sent before the body is in always carries `Connection: close`. An
inference request (/predict, v2 HTTP infer, a plain LitAPI's path) that the pod cannot take (queue full, draining) is
answered 503 here, before any ASGI work, and its body is skipped, keeping the connection for the client's retry (on /v2
routes in the protocol's envelope); that answer still echoes the request's id, and with tracing on it is a trace of one
span (frontend/tracing.py). A client that comes back on the same connection sooner than the Retry-After it was
given gets its next 503 only once that time is up, plus a random part of up to as much again, and each time it comes
back that early again it waits twice as long (up to 4x Retry-After): a retry storm of clients that resend at once costs
the pod one answer per client per few Retry-Afters, not as many as the clients can send (and the clients' own CPU, where
they share the machine), and its clients come back spread out instead of all together every Retry-After. A client that
waits as it is told is never held.

The one module built on uvicorn's internals (its HttpToolsProtocol, request cycle and flow control): `PINNED` names each
one used here with what it was written against; tests/unit/test_uvicorn_seam.py checks the installed uvicorn against it,
and that no other module reaches past uvicorn's public names. What names cannot show (which callback fires when; the
request cycle writes through `protocol.transport`) the connection tests hold (integration/test_hostile).
"""

from __future__ import annotations

import asyncio
import http
import json
import random
import time
from typing import Any, ClassVar

import httptools
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from imgserve import metrics
from imgserve.config import ServerSettings
from imgserve.errors import ApiError
from imgserve.frontend import telemetry, tracing
from imgserve.frontend.admission import SHED_MESSAGES, Admission
from imgserve.pins import Pinned

HOLD_JITTER = 1.0  # a held 503 waits up to this share of Retry-After more than Retry-After itself
MAX_HOLD_DOUBLINGS = 2  # a client back early again and again waits 1, 2, then 4x Retry-After (plus the jitter)
LINGER_S = 2.0  # how long a refused client's late bytes are read and dropped before the socket closes
_IDLE, _HEADERS, _BODY = 0, 1, 2

HTTPTOOLS, FLOW_CONTROL = "uvicorn.protocols.http.httptools_impl", "uvicorn.protocols.http.flow_control"
PINNED = (
    # HttpToolsProtocol's methods overridden or called here.
    Pinned(HTTPTOOLS, "HttpToolsProtocol.__init__", ("self", "config", "server_state", "app_state", "_loop")),
    Pinned(HTTPTOOLS, "HttpToolsProtocol.connection_made", ("self", "transport")),
    Pinned(HTTPTOOLS, "HttpToolsProtocol.connection_lost", ("self", "exc")),
    Pinned(HTTPTOOLS, "HttpToolsProtocol.shutdown", ("self",)),
    Pinned(HTTPTOOLS, "HttpToolsProtocol.data_received", ("self", "data")),
    Pinned(HTTPTOOLS, "HttpToolsProtocol.send_400_response", ("self", "msg")),
    Pinned(HTTPTOOLS, "HttpToolsProtocol.on_message_begin", ("self",)),
    Pinned(HTTPTOOLS, "HttpToolsProtocol.on_url", ("self", "url")),
    Pinned(HTTPTOOLS, "HttpToolsProtocol.on_header", ("self", "name", "value")),
    Pinned(HTTPTOOLS, "HttpToolsProtocol.on_headers_complete", ("self",)),
    Pinned(HTTPTOOLS, "HttpToolsProtocol.on_body", ("self", "body")),
    Pinned(HTTPTOOLS, "HttpToolsProtocol.on_message_complete", ("self",)),
    Pinned(HTTPTOOLS, "HttpToolsProtocol.on_response_complete", ("self",)),
    Pinned(HTTPTOOLS, "HttpToolsProtocol._unset_keepalive_if_required", ("self",)),
    # Its attributes read or written here, each where uvicorn assigns it.
    Pinned(HTTPTOOLS, "HttpToolsProtocol.loop", assigned_in="__init__"),
    Pinned(HTTPTOOLS, "HttpToolsProtocol.logger", assigned_in="__init__"),
    Pinned(HTTPTOOLS, "HttpToolsProtocol.parser", assigned_in="__init__"),
    Pinned(HTTPTOOLS, "HttpToolsProtocol.connections", assigned_in="__init__"),
    Pinned(HTTPTOOLS, "HttpToolsProtocol.transport", assigned_in="connection_made"),
    Pinned(HTTPTOOLS, "HttpToolsProtocol.flow", assigned_in="connection_made"),
    Pinned(HTTPTOOLS, "HttpToolsProtocol.url", assigned_in="on_message_begin"),
    Pinned(HTTPTOOLS, "HttpToolsProtocol.headers", assigned_in="on_message_begin"),
    Pinned(HTTPTOOLS, "HttpToolsProtocol.scope", assigned_in="on_message_begin"),
    Pinned(HTTPTOOLS, "HttpToolsProtocol.expect_100_continue", assigned_in="on_header"),
    Pinned(HTTPTOOLS, "HttpToolsProtocol.cycle", assigned_in="on_headers_complete"),
    # The request cycle's state and the flow control, read or written here.
    Pinned(HTTPTOOLS, "RequestResponseCycle.keep_alive", assigned_in="__init__"),
    Pinned(HTTPTOOLS, "RequestResponseCycle.response_started", assigned_in="__init__"),
    Pinned(HTTPTOOLS, "RequestResponseCycle.response_complete", assigned_in="__init__"),
    Pinned(HTTPTOOLS, "RequestResponseCycle.disconnected", assigned_in="__init__"),
    Pinned(HTTPTOOLS, "RequestResponseCycle.message_event", assigned_in="__init__"),
    Pinned(FLOW_CONTROL, "FlowControl.read_paused", assigned_in="__init__"),
    Pinned(FLOW_CONTROL, "FlowControl.pause_reading", ("self",)),
    Pinned(FLOW_CONTROL, "FlowControl.resume_reading", ("self",)),
)


def raw_response(error: ApiError, close: bool = True, v2: bool = False) -> bytes:
    """The whole HTTP/1.1 answer for `error`, as bytes written straight to the socket (in the Open Inference
    Protocol's envelope for a request on its /v2 routes)."""
    envelope = {"error": error.message} if v2 else {"error": {"code": error.code, "message": error.message}}
    body = json.dumps(envelope).encode()
    lines = [
        f"HTTP/1.1 {error.status} {http.HTTPStatus(error.status).phrase}",
        "content-type: application/json",
        f"content-length: {len(body)}",
    ]
    if error.retry_after is not None:
        lines.append(f"retry-after: {error.retry_after}")
    if close:
        lines.append("connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


class _Refused(Exception):
    """Raised from a parser callback to stop parsing a request that broke a limit."""


class _Transport:
    """The socket as uvicorn's request cycle sees it: its close() becomes the protocol's lingering close."""

    def __init__(self, transport: asyncio.Transport, protocol: GuardedHttpToolsProtocol) -> None:
        self._socket_transport = transport
        self.write = transport.write
        self.close = protocol.close_connection
        self.is_closing = protocol.is_closing

    def __getattr__(self, name: str) -> Any:
        return getattr(self._socket_transport, name)


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """HttpToolsProtocol with connection, header, time and upload-rate limits; see the module docstring."""

    settings: ClassVar[ServerSettings]
    admission: ClassVar[Admission]
    refusals: ClassVar[dict[str, tuple[ApiError, bytes]]]  # pre-built answers by name
    shed_counts: ClassVar[dict[tuple[str, str], Any]]  # imgserve_requests_total{route, code="503", model}, as used

    @classmethod
    def configured(cls, settings: ServerSettings, admission: Admission) -> type[GuardedHttpToolsProtocol]:
        """The protocol class for uvicorn's `http=` option, bound to this server's settings and admission."""
        retry = settings.retry_after_s
        errors = [
            ApiError(503, "too_many_connections", "too many open connections", retry),
            ApiError(408, "header_timeout", f"the headers did not arrive within {settings.header_timeout_s} s"),
            ApiError(431, "headers_too_large", f"the headers are over {settings.max_header_bytes} bytes"),
            ApiError(431, "too_many_headers", f"more than {settings.max_headers} header fields"),
            ApiError(408, "body_timeout", f"no upload bytes for {settings.body_timeout_s} s"),
            ApiError(408, "upload_too_slow", f"the upload is slower than {settings.min_upload_rate} bytes/s"),
            ApiError(400, "bad_request", "the request is not valid HTTP/1.1"),
        ]
        for reason in ("queue_full", "draining"):
            errors.append(ApiError(503, reason, SHED_MESSAGES[reason], retry))
        refusals = {error.code: (error, raw_response(error)) for error in errors}
        refusals |= {f"{e.code}+keep-alive": (e, raw_response(e, close=False)) for e in errors if e.status == 503}
        refusals |= {
            f"{key}+v2": (e, raw_response(e, "keep-alive" not in key, v2=True)) for key, (e, _) in refusals.items()
        }
        shed_counts: dict[tuple[str, str], Any] = {}
        attributes = {"settings": settings, "admission": admission, "refusals": refusals, "shed_counts": shed_counts}
        return type(cls.__name__, (cls,), attributes)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._phase = _IDLE
        self._timer: asyncio.TimerHandle | None = None
        self._header_stream = self._header_bytes = self._header_fields = 0  # bytes received, parsed; fields
        self._body_bytes, self._body_started, self._body_seen = 0, 0.0, 0.0
        self._keep_alive = True  # what the client asked for, while uvicorn's cycle is told to close
        self._shed = False  # the current request was answered here; its body is skipped
        self._lingering = False
        self._refusal: str | None = None
        self._last_shed = -float("inf")  # when this connection's last 503 was sent
        self._early_returns = 0  # how many times in a row this connection came back before its Retry-After
        self._hold: asyncio.TimerHandle | None = None  # a 503 waiting for the client's Retry-After to pass
        self._done_while_held = False

    # Connection.
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._socket = transport
        self.transport = _Transport(transport, self)  # type: ignore[assignment]
        if len(self.connections) > self.settings.max_connections:
            return self._refuse("too_many_connections", "too_many_connections")
        self._timer = self.loop.call_later(self.settings.header_timeout_s, self._header_timeout)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timer()
        if self._hold is not None:
            self._hold.cancel()
        super().connection_lost(exc)

    def is_closing(self) -> bool:
        return self._lingering or self._socket.is_closing()

    def close_connection(self, linger: bool | None = None) -> None:
        """Close; if the client may still be sending, shut our side first and drop its bytes for LINGER_S."""
        if self.is_closing():
            return
        self._cancel_timer()
        if linger is None:
            linger = self._phase != _IDLE  # within a request: the client may still be sending it
        if not linger or not self._socket.can_write_eof():
            return self._socket.close()
        self._lingering = True
        self.flow.resume_reading()
        self._socket.write_eof()
        self._timer = self.loop.call_later(LINGER_S, self._socket.close)

    def shutdown(self) -> None:
        self._keep_alive = False
        super().shutdown()

    def data_received(self, data: bytes) -> None:
        if self._lingering:
            return
        if self._phase != _BODY:
            self._header_stream += len(data)
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            pass  # no upgrades (websockets are off): the request goes on as plain HTTP, like uvicorn's
        except httptools.HttpParserError as exc:
            if self._refusal is None:
                self.logger.debug("invalid HTTP request: %s", exc, exc_info=exc.__context__)
            return self._refuse(self._refusal or "bad_request", self._refusal)
        if self._phase == _HEADERS:
            if self._header_stream > self.settings.max_header_bytes:  # headers that never end
                self._refuse("headers_too_large", "headers_too_large")
        elif self._phase == _BODY and self._timer is None:
            self._timer = self.loop.call_later(self._check_every, self._check_upload)

    def send_400_response(self, msg: str) -> None:
        self._refuse("bad_request")

    # Parser callbacks.
    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.scope["state"]["first_byte"] = time.monotonic()  # the request's deadline counts from here
        self._phase, self._header_bytes, self._header_fields, self._shed = _HEADERS, 0, 0, False
        if self._timer is None:
            self._timer = self.loop.call_later(self.settings.header_timeout_s, self._header_timeout)

    def on_url(self, url: bytes) -> None:
        self._count_header_bytes(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_fields += 1
        if self._header_fields > self.settings.max_headers:
            self._refusal = "too_many_headers"
            raise _Refused
        self._count_header_bytes(len(name) + len(value) + 4)
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._cancel_timer()
        self._phase, self._header_stream = _BODY, 0
        self._body_bytes, self._body_started = 0, self.loop.time()
        self._body_seen = self._body_started
        if self._shed_here():
            return
        super().on_headers_complete()
        self._keep_alive = self.cycle.keep_alive
        self.cycle.keep_alive = False  # until the body is in: an answer before that closes the connection

    def on_body(self, body: bytes) -> None:
        self._body_bytes += len(body)
        self._body_seen = self.loop.time()
        if not self._shed:
            super().on_body(body)

    def on_message_complete(self) -> None:
        self._cancel_timer()
        self._phase = _IDLE
        if self._shed:
            if self._hold is not None:  # the 503 is still held: go on once it is sent
                self._done_while_held = True
                return None
            return self.on_response_complete()  # the 503 went out at the headers: arm keep-alive, go on
        if not self.cycle.response_started:
            self.cycle.keep_alive = self._keep_alive
        super().on_message_complete()

    # Limits.
    def _count_header_bytes(self, size: int) -> None:
        self._header_bytes += size
        if self._header_bytes > self.settings.max_header_bytes:
            self._refusal = "headers_too_large"
            raise _Refused

    def _shed_here(self) -> bool:
        """Answer 503 now, without ASGI, if this is an inference request the pod cannot take."""
        path = self.url.partition(b"?")[0].decode("latin-1")
        route = telemetry.route(path)
        if route not in telemetry.INFER_ROUTES or self.parser.get_method() != b"POST":
            return False
        if self.cycle and not self.cycle.response_complete:  # pipelined: answers must keep their order
            return False
        model = self.admission.model_of(path)
        reason = self.admission.shed_reason(model)
        if reason is None:
            return False
        counted = (route, self.admission.label(model))
        if counted not in self.shed_counts:
            self.shed_counts[counted] = metrics.REQUESTS.labels(route, "503", counted[1])
        self.shed_counts[counted].inc()
        self._shed = True
        # Skip the body and keep the connection, unless the body is unbounded or will never come (Expect: 100).
        keep = not self.expect_100_continue and self._declared_length() <= self.settings.max_body_bytes
        key = reason + ("+keep-alive" if keep else "") + ("+v2" if route == telemetry.V2_INFER else "")
        answer = tracing.shed(self.headers, path, reason, self.refusals[key][1], self.scope.get("client"))
        if keep:
            self._shed_keeping_connection(answer)
        else:
            self._socket.write(answer)
            self.close_connection(linger=True)
        return True

    def _shed_keeping_connection(self, answer: bytes) -> None:
        """Send the 503 now, or, to a client back before its last Retry-After was up, once it is and a random part
        of it more (reading paused), twice as long for each early return in a row: clients that resend at once come
        back less and less often, and a herd refused together comes back spread out, not all at once."""
        now, retry = self.loop.time(), self.settings.retry_after_s
        if now >= self._last_shed + retry:  # the first 503, or a client that waited as it was told
            self._last_shed, self._early_returns = now, 0
            return self._socket.write(answer)
        self._early_returns += 1
        wait = retry * 2 ** min(self._early_returns - 1, MAX_HOLD_DOUBLINGS)
        self._last_shed += wait + random.uniform(0, HOLD_JITTER * retry)
        self.flow.pause_reading()
        self._hold = self.loop.call_at(self._last_shed, self._send_held, answer)

    def _send_held(self, answer: bytes) -> None:
        self._hold = None
        if self.is_closing():
            return
        self._socket.write(answer)
        self.flow.resume_reading()
        if self._done_while_held:
            self._done_while_held = False
            self.on_response_complete()

    def _declared_length(self) -> int:
        for name, value in self.headers:
            if name == b"content-length":
                return int(value) if value.isdigit() else -1
        return self.settings.max_body_bytes + 1  # chunked: no length

    def _header_timeout(self) -> None:
        self._timer = None
        if self._phase == _IDLE:  # a connection that never sent a byte
            return self.close_connection(linger=False)
        self._refuse("header_timeout", "header_timeout")

    @property
    def _check_every(self) -> float:
        return min(1.0, self.settings.body_timeout_s / 2)

    def _check_upload(self) -> None:
        """Every second of an upload: cut it after body_timeout_s of silence or when it is slower than allowed."""
        self._timer = None
        now = self.loop.time()
        if self.flow.read_paused:  # the application is not reading: the client is not to blame
            self._body_seen = now
            self._body_started += self._check_every
        elapsed = now - self._body_started
        if now - self._body_seen > self.settings.body_timeout_s:
            return self._refuse("body_timeout", "body_timeout")
        if elapsed > self.settings.body_timeout_s and self._body_bytes < self.settings.min_upload_rate * elapsed:
            return self._refuse("upload_too_slow", "upload_too_slow")
        self._timer = self.loop.call_later(self._check_every, self._check_upload)

    def _refuse(self, answer: str, reason: str | None = None) -> None:
        """Answer with a pre-built error (unless this request's answer already started) and close."""
        if reason is not None:
            metrics.REJECTED.labels(reason, "").inc()
        on_v2 = self._phase != _IDLE and (self.url == b"/v2" or self.url.startswith((b"/v2/", b"/v2?")))
        error, response = self.refusals[f"{answer}+v2" if on_v2 else answer]
        cycle = self.cycle if self._phase == _BODY and not self._shed else None
        if cycle is None or not cycle.response_started:
            self._socket.write(response)
        if cycle is not None:  # the application stops waiting for the body and learns why (for its metrics)
            self.scope["state"]["refusal"] = ApiError(error.status, error.code, error.message)
            cycle.disconnected = True
            cycle.message_event.set()
        self.close_connection(linger=True)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
