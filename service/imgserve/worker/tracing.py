"""An inference worker's spans: made for each batch that served a traced request, once its answers are sent.

A traced request's message carries its front end's `hand-off` span and its request id (tracing.carry). For each such
request a `queue` span hangs under that `hand-off` span: from the hand-off to the start of the batch, with the
batch's size and the request's index in it, or ending in the refusal `deadline` for a request that was past its
deadline (dropped, never run). The batch that ran is one `batch` span, in the trace of its first traced request and
linked to every traced request's `hand-off` span (a batch serves many traces; each link carries the request's id and
index), with its `predict` span (the API's batch, predict and unbatch) under it; each `queue` span links to the
batch. An item that failed is an error on the span where it failed: `predict` (with an event per item), or its
`queue` span when its request could not be read.

The spans are made from the times the worker noted (`Ran`) after the answers have left, so the requests never wait
for them; the SDK's batch processor exports them from its own thread. With tracing off `TRACER` is None and `record`
returns at once.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from imgserve import tracing
from imgserve.errors import ApiError
from imgserve.handoff.wire import RequestMessage

TRACER: Any = None  # this worker's tracer when tracing is on (start)


@dataclass(frozen=True)
class Ran:
    """What a batch's answer noted (time.monotonic()): its model's name, when it started, which of its requests ran
    the model (in their order in the model's batch), and when the model started and ended."""

    model: str
    started: float
    ready: list[int]
    predict_started: float
    predict_ended: float


def start() -> None:
    """In a worker process, after its start: trace its batches when the environment says so."""
    global TRACER
    if tracing.enabled():
        TRACER = tracing.provider("worker").get_tracer("imgserve")


def record(requests: Sequence[RequestMessage], outputs: Sequence[Any], ran: Ran | None) -> None:
    """The spans of one answered batch (`ran` None: the worker failed on it outside the API's hooks)."""
    if TRACER is None:
        return
    traced = [(i, found) for i, request in enumerate(requests) if request.trace and (found := _parent(request))]
    if not traced:
        return
    clock = time.time_ns() - time.monotonic_ns()  # monotonic seconds -> epoch nanoseconds
    ended = time.monotonic()
    ready = {index: position for position, index in enumerate(ran.ready)} if ran else {}
    batch = _batch(traced, ready, outputs, ran, clock, ended) if ran and ran.ready else None
    model = {tracing.MODEL: ran.model} if ran else {}
    for i, (context, request_id) in traced:
        attributes: dict[str, Any] = {tracing.REQUEST_ID: request_id, **model}
        if i in ready:
            attributes |= {tracing.BATCH_SIZE: len(ready), tracing.BATCH_INDEX: ready[i]}
        links = [_link(batch.get_span_context(), {})] if batch is not None else []
        span = TRACER.start_span(
            "queue", _context(context), attributes=attributes, links=links, start_time=_ns(requests[i].queued, clock)
        )
        if i not in ready and isinstance(outputs[i], ApiError):
            tracing.failed(span, outputs[i].status, outputs[i].code, outputs[i].message)
        span.end(_ns(ran.started if ran else ended, clock))


def _batch(
    traced: list[tuple[int, Any]],
    ready: dict[int, int],
    outputs: Sequence[Any],
    ran: Ran,
    clock: int,
    ended: float,
) -> Any:
    """The batch's span and its `predict` span, in the trace of its first traced request (ended; returned for the
    queue spans to link to)."""
    links = [
        _link(context, {tracing.REQUEST_ID: request_id, **({tracing.BATCH_INDEX: ready[i]} if i in ready else {})})
        for i, (context, request_id) in traced
    ]
    first_context, first_id = traced[0][1]
    attributes = {tracing.MODEL: ran.model, tracing.BATCH_SIZE: len(ready), tracing.REQUEST_ID: first_id}
    batch = TRACER.start_span(
        "batch", _context(first_context), attributes=attributes, links=links, start_time=_ns(ran.started, clock)
    )
    predict = TRACER.start_span(
        "predict", _context(batch.get_span_context()), attributes=attributes, start_time=_ns(ran.predict_started, clock)
    )
    for i, position in ready.items():
        if isinstance(outputs[i], ApiError):
            error = outputs[i]
            predict.add_event("item failed", {tracing.BATCH_INDEX: position, "error.type": error.code})
            tracing.failed(predict, error.status, error.code, error.message)
    predict.end(_ns(ran.predict_ended, clock))
    batch.end(_ns(ended, clock))
    return batch


def _parent(request: RequestMessage) -> tuple[Any, str] | None:
    """The request's `hand-off` span as a remote parent, and its id; None when its context is not one."""
    from opentelemetry.trace import SpanContext, TraceFlags

    found = tracing.carried(request.trace)
    if found is None:
        return None
    (trace_id, span_id, flags), request_id = found
    return SpanContext(trace_id, span_id, is_remote=True, trace_flags=TraceFlags(flags)), request_id


def _context(parent: Any) -> Any:
    from opentelemetry import trace

    return trace.set_span_in_context(trace.NonRecordingSpan(parent))


def _link(context: Any, attributes: dict[str, Any]) -> Any:
    from opentelemetry.trace import Link

    return Link(context, attributes)


def _ns(monotonic: float, clock: int) -> int:
    return int(monotonic * 1e9) + clock
