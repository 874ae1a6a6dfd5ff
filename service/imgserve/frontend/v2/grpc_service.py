"""The Open Inference Protocol over gRPC (`inference.GRPCInferenceService`), on its own port (--grpc-port).

It runs on the event loop of the first HTTP front end (the process that admits and dispatches its HTTP requests),
so a gRPC inference goes through the same admission, slots and batcher as /predict. One front end only: each
client holds one long-lived HTTP/2 connection, so sharing the port among front ends (SO_REUSEPORT) would not
spread one client's load, and a second server started on a taken port fails loudly instead of sharing it.
The wire format is Triton's generated stubs (tritonclient.grpc: service_pb2, model_config_pb2). Inputs are read
from `raw_input_contents` or the typed `contents`; outputs are always written to `raw_output_contents`, the only
place tritonclient.grpc reads them. Errors are gRPC status codes with the message; a 503 carries `retry-after`
in the trailing metadata.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from google.protobuf import json_format
from imgserve import metrics
from imgserve.config import Settings
from imgserve.errors import ApiError
from imgserve.frontend.auth import Keys, presented_key
from imgserve.frontend.v2 import tensors
from imgserve.frontend.v2.model import VERSION, ServedModel
from imgserve.frontend.v2.tensors import InferRequest, RequestedOutput, Tensor
from tritonclient.grpc import model_config_pb2, service_pb2, service_pb2_grpc

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

Handler = Callable[[Any, Any, grpc.aio.ServicerContext], Awaitable[Any]]


def _rpc(label: str) -> Callable[[Handler], Handler]:
    """Count and time the call under `label`, and turn an ApiError into the gRPC status for its HTTP status."""

    def wrap(method: Handler) -> Handler:
        @functools.wraps(method)
        async def handler(self: Servicer, request: Any, context: grpc.aio.ServicerContext) -> Any:
            started, status = time.perf_counter(), 200
            try:
                return await method(self, request, context)
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

    def __init__(self, model: ServedModel, settings: Settings) -> None:
        self.model, self.settings = model, settings
        self.keys = Keys(settings)

    @_rpc(metrics.GRPC_OTHER)
    async def ServerLive(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return service_pb2.ServerLiveResponse(live=True)

    @_rpc(metrics.GRPC_OTHER)
    async def ServerReady(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return service_pb2.ServerReadyResponse(ready=self.model.not_ready_reason() is None)

    @_rpc(metrics.GRPC_OTHER)
    async def ModelReady(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        self.model.check(request.name, request.version)
        return service_pb2.ModelReadyResponse(ready=self.model.not_ready_reason() is None)

    @_rpc(metrics.GRPC_OTHER)
    async def ServerMetadata(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return json_format.ParseDict(self.model.server_metadata(), service_pb2.ServerMetadataResponse())

    @_rpc(metrics.GRPC_OTHER)
    async def ModelMetadata(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        self.model.check(request.name, request.version)
        return json_format.ParseDict(self.model.metadata(), service_pb2.ModelMetadataResponse())

    @_rpc(metrics.GRPC_OTHER)
    async def ModelConfig(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        self.model.check(request.name, request.version)
        config = json_format.ParseDict(self.model.config(), model_config_pb2.ModelConfig())
        return service_pb2.ModelConfigResponse(config=config)

    @_rpc(metrics.GRPC_INFER)
    async def ModelInfer(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        started = time.monotonic()
        metadata = [(key.encode(), _bytes(value)) for key, value in context.invocation_metadata() or ()]
        if not self.keys.allow(presented_key(metadata)):
            raise ApiError(401, "unauthorized", "send a valid API key: authorization: Bearer <key> metadata")
        self.model.check(request.model_name, request.model_version)
        remaining = context.time_remaining()
        timeout = self.settings.request_timeout_s if remaining is None else remaining
        deadline = started + min(timeout, self.settings.max_request_timeout_s)
        outputs = await self.model.infer(_request(request), deadline, started)
        return _response(self.model.name, request.id, [tensor for _, tensor in outputs])


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


async def start(servicer: Servicer, settings: Settings) -> grpc.aio.Server:
    """Serve gRPC on --grpc-port on the running event loop, with message limits at the body limit."""
    limit = settings.max_body_bytes
    options = [
        ("grpc.max_receive_message_length", limit),
        ("grpc.max_send_message_length", limit),
        ("grpc.so_reuseport", 0),
    ]
    server = grpc.aio.server(options=options)
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, server)
    host = f"[{settings.host}]" if ":" in settings.host else settings.host
    server.add_insecure_port(f"{host}:{settings.grpc_port}")
    await server.start()
    return server
