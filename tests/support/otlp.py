"""A real OTLP/HTTP trace receiver on 127.0.0.1, for the tests: it takes what the servers' exporters POST to
/v1/traces, decodes it with OpenTelemetry's official protobuf (opentelemetry-proto), and keeps every span."""

from __future__ import annotations

import gzip
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span as ProtoSpan


@dataclass(frozen=True)
class Link:
    trace_id: str
    span_id: str
    attributes: dict[str, Any]


@dataclass(frozen=True)
class Span:
    """One received span, ids as hex."""

    name: str
    trace_id: str
    span_id: str
    parent_id: str
    kind: str
    attributes: dict[str, Any]
    links: list[Link]
    status: str  # UNSET, OK or ERROR
    status_message: str
    start_ns: int
    end_ns: int
    process: str  # the resource's imgserve.process: frontend or worker
    service: str
    events: list[str] = field(default_factory=list)


def _value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    return None if kind is None else getattr(value, kind)


def _attributes(pairs: Any) -> dict[str, Any]:
    return {pair.key: _value(pair.value) for pair in pairs}


def decode(body: bytes) -> list[Span]:
    """The spans of one ExportTraceServiceRequest."""
    request = ExportTraceServiceRequest()
    request.ParseFromString(body)
    found = []
    for resource_spans in request.resource_spans:
        resource = _attributes(resource_spans.resource.attributes)
        for scope in resource_spans.scope_spans:
            for span in scope.spans:
                links = [
                    Link(link.trace_id.hex(), link.span_id.hex(), _attributes(link.attributes)) for link in span.links
                ]
                found.append(
                    Span(
                        span.name,
                        span.trace_id.hex(),
                        span.span_id.hex(),
                        span.parent_span_id.hex(),
                        ProtoSpan.SpanKind.Name(span.kind).removeprefix("SPAN_KIND_"),
                        _attributes(span.attributes),
                        links,
                        ["UNSET", "OK", "ERROR"][span.status.code],
                        span.status.message,
                        span.start_time_unix_nano,
                        span.end_time_unix_nano,
                        resource.get("imgserve.process", ""),
                        resource.get("service.name", ""),
                        [event.name for event in span.events],
                    )
                )
    return found


class Receiver:
    """The receiver: `endpoint` for OTEL_EXPORTER_OTLP_ENDPOINT, `spans` as they came."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path != "/v1/traces":
                    self.send_response(404)
                    self.end_headers()
                    return
                spans = decode(body)
                with receiver.lock:
                    receiver.spans.extend(spans)
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def trace(self, trace_id: str) -> list[Span]:
        with self.lock:
            return [span for span in self.spans if span.trace_id == trace_id]

    def wait(self, condition: Callable[[list[Span]], Any], what: str, timeout_s: float = 20) -> Any:
        """Until `condition(spans so far)` is truthy (its value); fail the test after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self.lock:
                found = condition(list(self.spans))
            if found:
                return found
            time.sleep(0.05)
        pytest.fail(f"the receiver did not get {what} within {timeout_s:.0f} s")


def receiving() -> Iterator[Receiver]:
    """A running receiver until the generator closes (a pytest fixture's body)."""
    receiver = Receiver()
    receiver.thread.start()
    try:
        yield receiver
    finally:
        receiver.server.shutdown()
        receiver.server.server_close()


def environment(receiver: Receiver, **more: str) -> dict[str, str]:
    """The OTEL_* variables that send a server's traces to `receiver` over OTLP/HTTP, fast (the tests wait on them)."""
    return {
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "OTEL_BSP_SCHEDULE_DELAY": "50",
        **more,
    }
