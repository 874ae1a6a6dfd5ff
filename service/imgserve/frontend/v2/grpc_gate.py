"""What a gRPC call must pass before its handler runs, and the channel's limits: HTTP's limits, in gRPC's terms.

Inference (ModelInfer and each ModelStreamInfer stream) and the repository's loads and unloads need an API key, and
ModelStatistics too with
`protect_metrics` (as HTTP guards /metrics), checked from the call's metadata before any message is read;
`max_connections` bounds connections, calls in progress (more answer RESOURCE_EXHAUSTED at once) and the streams of
one connection; `header_timeout_s` bounds a connection's handshake, its idle time, and the wait for the message of
an open unary RPC; a message is at most `max_body_bytes`. Every message is parsed by imgserve, not by gRPC, so one
that is not the RPC's protobuf answers INVALID_ARGUMENT (gRPC's own parsing answers UNKNOWN), and on a stream it is
one request's error, not the stream's end.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from imgserve import metrics
from imgserve.config import ServerSettings
from imgserve.frontend import telemetry
from imgserve.frontend.auth import Keys, presented_key
from imgserve.frontend.v2 import tensors

SERVICE = "/inference.GRPCInferenceService"
INFERENCE = frozenset({f"{SERVICE}/ModelInfer", f"{SERVICE}/ModelStreamInfer"})  # as over HTTP: they need a key
STATISTICS = f"{SERVICE}/ModelStatistics"
REPOSITORY = frozenset({f"{SERVICE}/RepositoryModelLoad", f"{SERVICE}/RepositoryModelUnload"})  # as over HTTP
# The largest message gRPC and protobuf carry. An answer is bounded before its compute, as over HTTP, by the request's
# images (at most the pod's queue) x the pixel limit; a smaller send limit could only refuse an answer already made.
MAX_MESSAGE = 2**31 - 1
NOT_PROTOBUF = "the request message is not valid protobuf"


class Gate(grpc.aio.ServerInterceptor):  # type: ignore[misc]  # grpc ships no type information
    """Sees each call's method and metadata before its message is read. A guarded call without a valid key gets a
    handler that never reads the message and answers UNAUTHENTICATED; every other unary call must send its message
    within `header_timeout_s` (an open RPC's message is a few bytes, sent with its headers), so calls that never send
    one cannot hold the server's call slots; ModelInfer's message has no such bound. A stream's messages are each
    parsed as they come (`_parsed_each`)."""

    def __init__(self, keys: Keys, settings: ServerSettings) -> None:
        self.keys, self.timeout = keys, settings.header_timeout_s
        self.guarded = {method: telemetry.GRPC_INFER for method in INFERENCE}  # the label a refusal counts under
        self.guarded |= {method: telemetry.GRPC_OTHER for method in REPOSITORY}
        if settings.protect_metrics:
            self.guarded[STATISTICS] = telemetry.GRPC_OTHER

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(details)
        if handler is None:
            return None
        label = self.guarded.get(details.method)
        if label is not None:
            metadata = [(key.encode(), _bytes(value)) for key, value in details.invocation_metadata or ()]
            if not self.keys.allow(presented_key(metadata)):
                return _REFUSED[label]
        if handler.request_streaming and handler.response_streaming:
            return _parsed_each(handler)
        if details.method in INFERENCE:
            return _read_within(handler, None, telemetry.GRPC_INFER)
        return _read_within(handler, self.timeout, telemetry.GRPC_OTHER)


def _unauthenticated(label: str) -> grpc.RpcMethodHandler:
    """The handler of a guarded call without a valid key, whole: answered, counted as a 401 under `label`, its message
    never read (a request-streaming handler: gRPC reads no message until the handler asks for one, and this one never
    does)."""

    async def refuse(requests: Any, context: grpc.aio.ServicerContext) -> None:
        started = time.perf_counter()
        try:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "send a valid API key: authorization: Bearer <key>")
        finally:
            metrics.count(label, 401, time.perf_counter() - started)

    return grpc.stream_unary_rpc_method_handler(refuse)


_REFUSED = {label: _unauthenticated(label) for label in (telemetry.GRPC_INFER, telemetry.GRPC_OTHER)}


def _read_within(handler: grpc.RpcMethodHandler, timeout: float | None, label: str) -> grpc.RpcMethodHandler:
    """The unary `handler` as one that reads and parses its own message: DEADLINE_EXCEEDED when none arrived in
    `timeout` s (None: no bound), INVALID_ARGUMENT when it is not the RPC's protobuf; counted under `label`."""

    async def answer(requests: Any, context: grpc.aio.ServicerContext) -> Any:
        started = time.perf_counter()
        try:
            data = await asyncio.wait_for(context.read(), timeout)
        except TimeoutError:
            metrics.count(label, 408, time.perf_counter() - started)
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"the request did not arrive within {timeout} s")
        if data is grpc.aio.EOF:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the call ended without a request message")
        try:
            request = handler.request_deserializer(data)
        except DecodeError as exc:
            metrics.count(label, 400, time.perf_counter() - started)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{NOT_PROTOBUF}: {exc}")
        return await handler.unary_unary(request, context)

    return grpc.stream_unary_rpc_method_handler(answer, None, handler.response_serializer)


def _parsed_each(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """The bidirectional `handler` as one that parses each message itself: a message that is not the RPC's protobuf
    reaches the handler as the ApiError (400) that says so, in its place, and the stream goes on."""

    async def parsed(requests: AsyncIterator[bytes]) -> AsyncIterator[Any]:
        async for data in requests:
            try:
                yield handler.request_deserializer(data)
            except DecodeError as exc:
                yield tensors.bad(f"{NOT_PROTOBUF}: {exc}")

    async def answer(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> None:
        await handler.stream_stream(parsed(requests), context)

    return grpc.stream_stream_rpc_method_handler(answer, None, handler.response_serializer)


def _bytes(value: str | bytes) -> bytes:
    return value if isinstance(value, bytes) else value.encode()


def options(settings: ServerSettings) -> list[tuple[str, int]]:
    """The server's channel options: HTTP's limits for one front end, in gRPC's terms. `max_connections` bounds the
    connections (a new one past it is closed) and the streams of one connection (a client's calls past it wait in its
    own channel); `header_timeout_s` closes a connection that has not finished its handshake or has had no call for
    that long, as HTTP closes a silent or idle connection."""
    timeout_ms = round(settings.header_timeout_s * 1000)
    return [
        ("grpc.max_receive_message_length", settings.max_body_bytes),
        ("grpc.max_send_message_length", MAX_MESSAGE),
        ("grpc.max_allowed_incoming_connections", settings.max_connections),
        ("grpc.max_concurrent_streams", settings.max_connections),
        ("grpc.server_handshake_timeout_ms", timeout_ms),
        ("grpc.max_connection_idle_ms", timeout_ms),
        ("grpc.so_reuseport", 0),
    ]
