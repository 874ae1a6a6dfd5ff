"""The Open Inference Protocol over gRPC (`inference.GRPCInferenceService`), on its own port (--grpc-port).

It runs on the event loop of the first HTTP front end (the process that admits and dispatches its HTTP requests),
so a gRPC inference goes through the same admission, slots and batcher as /predict. One front end only: each
client holds one long-lived HTTP/2 connection, so sharing the port among front ends (SO_REUSEPORT) would not
spread one client's load, and a second server started on a taken port fails loudly instead of sharing it.
The wire format is Triton's generated stubs (tritonclient.grpc: service_pb2, model_config_pb2). Inputs are read
from `raw_input_contents` or the typed `contents`; outputs are always written to `raw_output_contents`, the only
place tritonclient.grpc reads them. Errors are gRPC status codes with the message; a 503 carries `retry-after`
in the trailing metadata.

Limits, like HTTP's (`Gate`, `options`): ModelInfer's API key is checked from the call's metadata before its message
is read; `max_connections` bounds connections, calls in progress (more answer RESOURCE_EXHAUSTED at once) and the
streams of one connection; `header_timeout_s` bounds a connection's handshake, its idle time, and the wait for the
message of an open RPC; a request message is at most `max_body_bytes`.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from google.protobuf import json_format
from google.protobuf.message import DecodeError
from tritonclient.grpc import model_config_pb2, service_pb2, service_pb2_grpc

from imgserve import metrics
from imgserve.config import ServerSettings
from imgserve.errors import ApiError
from imgserve.frontend import telemetry
from imgserve.frontend.auth import Keys, presented_key
from imgserve.frontend.v2 import tensors
from imgserve.frontend.v2.model import VERSION, ServedModel
from imgserve.frontend.v2.tensors import InferRequest, RequestedOutput, Tensor

log = logging.getLogger(__name__)
STATUS = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    404: grpc.StatusCode.NOT_FOUND,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    415: grpc.StatusCode.INVALID_ARGUMENT,
    422: grpc.StatusCode.INVALID_ARGUMENT,
    499: grpc.StatusCode.CANCELLED,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}
CONTENTS = {  # the typed field of InferTensorContents that carries each datatype
    "BOOL": "bool_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
}
GRACE_S = 5.0  # how long in-flight calls get when the front end stops
INFER = "/inference.GRPCInferenceService/ModelInfer"
# A client's own timer ends its call at the deadline, which reaches the server as a cancellation a transit time before
# the server's copy of that deadline: a call cancelled this close to its deadline is counted as having run out of time.
DEADLINE_SLACK_S = 0.05
GUARDED = frozenset({INFER})  # the RPCs that need a key, as over HTTP: inference; health, metadata, config stay open
# The largest message gRPC and protobuf carry. An answer is bounded before its compute, as over HTTP, by the request's
# images (at most the pod's queue) x the pixel limit; a smaller send limit could only refuse an answer already made.
MAX_MESSAGE = 2**31 - 1

Handler = Callable[[Any, Any, grpc.aio.ServicerContext], Awaitable[Any]]


def _rpc(label: str) -> Callable[[Handler], Handler]:
    """Count and time the call under `label`, and turn an ApiError into the gRPC status for its HTTP status. A call
    gRPC cancels counts as 504 (and a deadline rejection) when its deadline ran out, else as 499 (the client left)."""

    def wrap(method: Handler) -> Handler:
        @functools.wraps(method)
        async def handler(self: Servicer, request: Any, context: grpc.aio.ServicerContext) -> Any:
            started, status = time.perf_counter(), 200
            try:
                return await method(self, request, context)
            except asyncio.CancelledError:  # gRPC ended the call: its deadline passed first, or the client left
                remaining = context.time_remaining()
                expired = remaining is not None and remaining <= DEADLINE_SLACK_S
                status = 504 if expired else 499
                if expired:
                    metrics.REJECTED.labels("deadline").inc()
                raise
            except ApiError as error:
                status = error.status
                if error.retry_after is not None:
                    context.set_trailing_metadata((("retry-after", str(error.retry_after)),))
                await context.abort(STATUS.get(error.status, grpc.StatusCode.INTERNAL), error.message)
            except Exception:
                status = 500
                log.exception("gRPC %s failed", method.__name__)
                await context.abort(grpc.StatusCode.INTERNAL, "the server failed on this request")
            finally:
                metrics.count(label, status, time.perf_counter() - started)

        return handler

    return wrap


class Servicer(service_pb2_grpc.GRPCInferenceServiceServicer):
    """The core RPCs and ModelConfig (perf_analyzer -i grpc needs it); the rest answer UNIMPLEMENTED."""

    def __init__(self, model: ServedModel, settings: ServerSettings, keys: Keys) -> None:
        self.model, self.settings, self.keys = model, settings, keys

    @_rpc(telemetry.GRPC_OTHER)
    async def ServerLive(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return service_pb2.ServerLiveResponse(live=True)

    @_rpc(telemetry.GRPC_OTHER)
    async def ServerReady(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return service_pb2.ServerReadyResponse(ready=self.model.not_ready_reason() is None)

    @_rpc(telemetry.GRPC_OTHER)
    async def ModelReady(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        self.model.check(request.name, request.version)
        return service_pb2.ModelReadyResponse(ready=self.model.not_ready_reason() is None)

    @_rpc(telemetry.GRPC_OTHER)
    async def ServerMetadata(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return json_format.ParseDict(self.model.server_metadata(), service_pb2.ServerMetadataResponse())

    @_rpc(telemetry.GRPC_OTHER)
    async def ModelMetadata(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        self.model.check(request.name, request.version)
        return json_format.ParseDict(self.model.metadata(), service_pb2.ModelMetadataResponse())

    @_rpc(telemetry.GRPC_OTHER)
    async def ModelConfig(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        self.model.check(request.name, request.version)
        config = json_format.ParseDict(self.model.config(), model_config_pb2.ModelConfig())
        return service_pb2.ModelConfigResponse(config=config)

    @_rpc(telemetry.GRPC_INFER)
    async def ModelInfer(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        started = time.monotonic()  # its API key was checked by Gate, before the message was read
        self.model.check(request.model_name, request.model_version)
        remaining = context.time_remaining()
        timeout = self.settings.request_timeout_s if remaining is None else remaining
        deadline = started + min(timeout, self.settings.max_request_timeout_s)
        outputs = await self.model.infer(_request(request), deadline, started)
        return _response(self.model.name, request.id, [tensor for _, tensor in outputs])


class Gate(grpc.aio.ServerInterceptor):
    """Sees each call's method and metadata before its message is read. A guarded call without a valid key gets a
    handler that never reads the message and answers UNAUTHENTICATED; every other unary call must send its message
    within `header_timeout_s` (an open RPC's message is a few bytes, sent with its headers), so calls that never send
    one cannot hold the server's call slots; ModelInfer's message has no such bound. Every message is parsed by the
    handler, so one that is not the RPC's protobuf answers INVALID_ARGUMENT (gRPC's own parsing answers UNKNOWN)."""

    def __init__(self, keys: Keys, settings: ServerSettings) -> None:
        self.keys, self.timeout = keys, settings.header_timeout_s

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(details)
        if handler is None or handler.request_streaming or handler.response_streaming:
            return handler
        if details.method not in GUARDED:
            return _read_within(handler, self.timeout, telemetry.GRPC_OTHER)
        metadata = [(key.encode(), _bytes(value)) for key, value in details.invocation_metadata or ()]
        allowed = self.keys.allow(presented_key(metadata))
        return _read_within(handler, None, telemetry.GRPC_INFER) if allowed else _REFUSED


async def _unauthenticated(requests: Any, context: grpc.aio.ServicerContext) -> None:
    """A guarded call without a valid key, whole: counted as a 401 and answered, its message never read."""
    started = time.perf_counter()
    try:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "send a valid API key: authorization: Bearer <key>")
    finally:
        metrics.count(telemetry.GRPC_INFER, 401, time.perf_counter() - started)


# A request-streaming handler: gRPC reads no message until the handler asks for one, and this one never does.
_REFUSED = grpc.stream_unary_rpc_method_handler(_unauthenticated)


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
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"the request message is not valid protobuf: {exc}")
        return await handler.unary_unary(request, context)

    return grpc.stream_unary_rpc_method_handler(answer, None, handler.response_serializer)


def _bytes(value: str | bytes) -> bytes:
    return value if isinstance(value, bytes) else value.encode()


def _parameter(value: Any) -> Any:
    """An InferParameter's value, whichever of its fields is set."""
    field = value.WhichOneof("parameter_choice")
    return None if field is None else getattr(value, field)


def _request(message: Any) -> InferRequest:
    """A ModelInferRequest -> InferRequest."""
    raw = list(message.raw_input_contents)
    if raw and len(raw) != len(message.inputs):
        raise tensors.bad(f"{len(raw)} raw_input_contents for {len(message.inputs)} inputs")
    inputs = []
    for index, tensor in enumerate(message.inputs):
        name, datatype, shape = tensor.name, tensor.datatype, list(tensor.shape)
        if raw:
            inputs.append(tensors.from_binary(name, datatype, shape, raw[index]))
        elif datatype == "BYTES":
            inputs.append(tensors.from_elements(name, shape, list(tensor.contents.bytes_contents)))
        elif datatype in CONTENTS:
            values = list(getattr(tensor.contents, CONTENTS[datatype]))
            inputs.append(tensors.from_numbers(name, datatype, shape, values))
        else:
            raise tensors.bad(f"input {name[:100]!r}: datatype {datatype[:16]!r} cannot travel in typed contents")
    outputs = None
    if message.outputs:
        outputs = []
        for output in message.outputs:
            k = _parameter(output.parameters["classification"]) if "classification" in output.parameters else None
            if k is not None and (not isinstance(k, int) or isinstance(k, bool) or k < 1):
                raise tensors.bad(f"output {output.name!r}: classification must be a positive integer")
            outputs.append(RequestedOutput(output.name, binary=True, classification=k))
    parameters = {key: _parameter(value) for key, value in message.parameters.items()}
    return InferRequest(inputs, outputs, parameters, message.id or None)


def _response(model: str, request_id: str, outputs: list[Tensor]) -> Any:
    """The ModelInferResponse, every output in raw_output_contents."""
    response = service_pb2.ModelInferResponse(model_name=model, model_version=VERSION, id=request_id)
    for tensor in outputs:
        response.outputs.add(name=tensor.name, datatype=tensor.datatype, shape=tensor.shape)
        response.raw_output_contents.append(tensors.raw(tensor))
    return response


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


async def start(servicer: Servicer, settings: ServerSettings) -> grpc.aio.Server:
    """Serve gRPC on --grpc-port on the running event loop, at most `max_connections` calls in progress at once
    (gRPC answers the next ones RESOURCE_EXHAUSTED at once, before any of our code)."""
    server = grpc.aio.server(
        interceptors=[Gate(servicer.keys, settings)],
        options=options(settings),
        maximum_concurrent_rpcs=settings.max_connections,
    )
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, server)
    host = f"[{settings.host}]" if ":" in settings.host else settings.host
    server.add_insecure_port(f"{host}:{settings.grpc_port}")
    await server.start()
    return server
