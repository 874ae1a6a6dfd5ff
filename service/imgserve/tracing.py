"""OpenTelemetry traces, configured as OpenTelemetry is configured everywhere, and the request id.

Tracing is on when `OTEL_TRACES_EXPORTER` names an exporter (`otlp`, `console`), or, with it unset, when an OTLP
endpoint is set (`OTEL_EXPORTER_OTLP_ENDPOINT`, `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`); off with nothing set, with
`OTEL_TRACES_EXPORTER=none` or `OTEL_SDK_DISABLED=true`. The rest is the SDK's own reading of its variables: the
OTLP protocol (`OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL`, grpc or http/protobuf, the specification's default), the
endpoint, headers and timeout, `OTEL_SERVICE_NAME` (imgserve when unset), `OTEL_RESOURCE_ATTRIBUTES`,
`OTEL_TRACES_SAMPLER` with `OTEL_TRACES_SAMPLER_ARG`, and the batch exporter's `OTEL_BSP_*`. The SDK and the
exporters are the optional extra `imgserve[tracing]`; `check` refuses the start (one line) when tracing is asked for
and cannot run.

Every process that traces (each front end, each worker) sets the SDK up itself (`provider`), after it was forked (a
worker from the fork server, which never starts it), never the main process before a fork: the exporter's thread does
not survive a fork. Spans leave from that thread in batches (BatchSpanProcessor), off the request path.

What crosses from a front end to a worker with a traced request is one plain string (`carry`): the W3C traceparent
of the span the worker's spans hang under and the request id, checked on arrival (`carried`). A request id is the
caller's X-Request-ID when it is safe to echo (1-128 characters of letters, digits and `._:+/=@-`), else a new one
(`request_id`): never a header value echoed raw.
"""

from __future__ import annotations

import os
import re
import secrets
from collections.abc import Mapping
from typing import Any

REQUEST_ID = "imgserve.request_id"  # on every span of a request
MODEL = "imgserve.model"
ITEM = "imgserve.item"  # the item's index in its call (v2 carries N items)
BATCH_SIZE = "imgserve.batch.size"
BATCH_INDEX = "imgserve.batch.index"  # the item's index in its batch
REFUSAL = "imgserve.refusal"  # why a request was refused or dropped: queue_full, draining, deadline, ...
SAFE_ID = re.compile(r"[A-Za-z0-9._:+/=@-]{1,128}")
TRACEPARENT = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")
MAX_CARRIED = 55 + 1 + 128  # a traceparent, a space, a request id
REFUSALS = (429, 503, 504)  # statuses that refuse or drop a request rather than fail it
EXPORTERS = ("otlp", "console")
PROTOCOLS = ("http/protobuf", "grpc")


def exporters(environ: Mapping[str, str] = os.environ) -> list[str]:
    """The span exporters the environment asks for; none: tracing is off."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return []
    named = environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if not named:
        endpoints = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        return ["otlp"] if any(environ.get(name, "").strip() for name in endpoints) else []
    return [name.strip() for name in named.split(",") if name.strip() not in ("", "none")]


def enabled(environ: Mapping[str, str] = os.environ) -> bool:
    return bool(exporters(environ))


def protocol(environ: Mapping[str, str] = os.environ) -> str:
    given = environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
    return (given or "http/protobuf").strip().lower()


def check(environ: Mapping[str, str] = os.environ) -> str | None:
    """Why tracing, as the environment asks for it, cannot run (one line), or None. In the main process: it imports
    the exporters' modules but starts nothing."""
    for name in exporters(environ):
        if name not in EXPORTERS:
            return f"OTEL_TRACES_EXPORTER={name}: imgserve exports traces with {', '.join(EXPORTERS)} (or none)"
        if name == "otlp" and protocol(environ) not in PROTOCOLS:
            return f"OTLP protocol {protocol(environ)!r}: imgserve exports traces over {' or '.join(PROTOCOLS)}"
        try:
            _exporter(name, environ)
        except ImportError as exc:
            return f"tracing is on ({name}) but its packages are missing ({exc.name}): pip install 'imgserve[tracing]'"
    return None


def _exporter(name: str, environ: Mapping[str, str]) -> type:
    """The exporter class for `name` (the SDK reads its endpoint, headers and timeout from the environment)."""
    if name == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter
    if protocol(environ) == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as Grpc

        return Grpc
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as Http

    return Http


def provider(role: str, environ: Mapping[str, str] = os.environ) -> Any:
    """This process's TracerProvider: the resource from the environment (service.name imgserve unless set) and
    `imgserve.process` = `role`, the sampler from OTEL_TRACES_SAMPLER, each exporter behind a BatchSpanProcessor.
    Call it once, in the process that traces. It is imgserve's own, not the global provider: a global one would turn
    on FastAPI's native telemetry (fastapi >= 0.16x), which would make a second server span of every request."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    made = TracerProvider(resource=Resource.create({"service.name": "imgserve", "imgserve.process": role}))
    for name in exporters(environ):
        made.add_span_processor(BatchSpanProcessor(_exporter(name, environ)()))
    return made


def failed(span: Any, status: int, code: str, message: str) -> None:
    """Record an error answer on the span where it happened: its code, a refusal's reason, the span's status."""
    from opentelemetry.trace import StatusCode

    span.set_attribute("error.type", code)
    if status in REFUSALS:
        span.set_attribute(REFUSAL, code)
    span.set_status(StatusCode.ERROR, message)


def safe_id(given: str | None) -> str | None:
    """The caller's id when it is safe to echo and log, else None."""
    return given if given is not None and SAFE_ID.fullmatch(given) else None


def request_id(given: str | None) -> str:
    """The caller's id when it is safe to echo and log, else a new random one (32 hex digits)."""
    return safe_id(given) or secrets.token_hex(16)


def traceparent(trace_id: int, span_id: int, flags: int) -> str:
    return f"00-{trace_id:032x}-{span_id:016x}-{flags:02x}"


def carry(parent: str, request: str) -> str:
    """What travels to the worker with a traced request: the traceparent its spans hang under, and its id."""
    return f"{parent} {request}"


def carried(text: str) -> tuple[tuple[int, int, int], str] | None:
    """((trace id, span id, flags), request id) from `carry`'s string, or None when it is not one."""
    parent, _, request = text.partition(" ")
    found = TRACEPARENT.fullmatch(parent)
    if found is None or not SAFE_ID.fullmatch(request):
        return None
    trace_id, span_id, flags = (int(part, 16) for part in found.groups())
    if trace_id == 0 or span_id == 0:
        return None
    return (trace_id, span_id, flags), request
