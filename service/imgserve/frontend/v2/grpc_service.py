"""The Open Inference Protocol over gRPC (`inference.GRPCInferenceService`), on its own port (--grpc-port).

It runs on the event loop of the first HTTP front end (the process that admits and dispatches its HTTP requests),
so a gRPC inference goes through the same admission, slots and batcher as /predict. One front end only: each
client holds one long-lived HTTP/2 connection, so sharing the port among front ends (SO_REUSEPORT) would not
spread one client's load, and a second server started on a taken port fails loudly instead of sharing it.
The wire format is Triton's generated stubs (tritonclient.grpc: service_pb2, model_config_pb2). Inputs are read
from `raw_input_contents` or the typed `contents`; outputs are always written to `raw_output_contents`, the only
place tritonclient.grpc reads them. Errors are gRPC status codes with the message; a 503 carries `retry-after`
in the trailing metadata. ModelStreamInfer answers each request of a stream on it (grpc_stream.py). What a call
must pass before its handler, and the channel's limits, are in grpc_gate.py. A request's id is its own `id`, else the
call's `x-request-id` metadata, else a new one (frontend/tracing.py); ModelInfer echoes it in its trailing metadata
as `x-request-id`.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf import json_format
from tritonclient.grpc import model_config_pb2, service_pb2, service_pb2_grpc

from imgserve import metrics
from imgserve.config import ServerSettings
from imgserve.errors import ApiError
from imgserve.frontend import telemetry, tracing
from imgserve.frontend.auth import Keys
from imgserve.frontend.v2 import grpc_stream, tensors
from imgserve.frontend.v2.grpc_gate import Gate, options
from imgserve.frontend.v2.model import VERSION, V2Models
from imgserve.frontend.v2.repository import Repository
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
    501: grpc.StatusCode.UNIMPLEMENTED,
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
CODES = {status: code.value[0] for status, code in STATUS.items()}  # the numbers a span's rpc.grpc.status_code takes

Handler = Callable[[Any, Any, grpc.aio.ServicerContext], Awaitable[Any]]


def _rpc(label: str) -> Callable[[Handler], Handler]:
    """Count and time the call under `label`, and turn an ApiError into the gRPC status for its HTTP status. A call
    gRPC cancels counts as 504 (and a deadline rejection) when its deadline ran out, else as 499 (the client left)."""

    def wrap(method: Handler) -> Handler:
        @functools.wraps(method)
        async def handler(self: Servicer, request: Any, context: grpc.aio.ServicerContext) -> Any:
            metrics.one_deadline_per_request()  # gRPC runs each call in a task of its own
            started, status = time.perf_counter(), 200
            try:
                return await method(self, request, context)
            except asyncio.CancelledError:  # gRPC ended the call: its deadline passed first, or the client left
                status = grpc_stream.cancelled_status(context, self.models.label(getattr(request, "model_name", "")))
                raise
            except ApiError as error:
                status = error.status
                if error.retry_after is not None:
                    echoed = tuple(context.trailing_metadata() or ())
                    context.set_trailing_metadata((*echoed, ("retry-after", str(error.retry_after))))
                await context.abort(STATUS.get(error.status, grpc.StatusCode.INTERNAL), error.message)
            except Exception:
                status = 500
                log.exception("gRPC %s failed", method.__name__)
                await context.abort(grpc.StatusCode.INTERNAL, "the server failed on this request")
            finally:
                name = getattr(request, "model_name", "") or getattr(request, "name", "")
                metrics.count(label, status, time.perf_counter() - started, self.models.label(name))

        return handler

    return wrap


class Servicer(service_pb2_grpc.GRPCInferenceServiceServicer):  # type: ignore[misc]  # tritonclient ships no types
    """The core RPCs, ModelConfig (perf_analyzer -i grpc needs it), ModelStreamInfer, ModelStatistics and the model
    repository's; the shared-memory RPCs answer that they are not supported; the rest answer UNIMPLEMENTED."""

    def __init__(self, models: V2Models, repository: Repository, settings: ServerSettings, keys: Keys) -> None:
        self.models, self.repository, self.settings, self.keys = models, repository, settings, keys

    @_rpc(telemetry.GRPC_OTHER)
    async def ServerLive(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return service_pb2.ServerLiveResponse(live=True)

    @_rpc(telemetry.GRPC_OTHER)
    async def ServerReady(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return service_pb2.ServerReadyResponse(ready=self.models.not_ready_reason(None) is None)

    @_rpc(telemetry.GRPC_OTHER)
    async def ModelReady(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        model = self.models.find(request.name, request.version)
        return service_pb2.ModelReadyResponse(ready=self.models.model_not_ready_reason(model.name) is None)

    @_rpc(telemetry.GRPC_OTHER)
    async def ServerMetadata(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return json_format.ParseDict(self.models.server_metadata(), service_pb2.ServerMetadataResponse())

    @_rpc(telemetry.GRPC_OTHER)
    async def ModelMetadata(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        model = self.models.find(request.name, request.version)
        return json_format.ParseDict(model.metadata(), service_pb2.ModelMetadataResponse())

    @_rpc(telemetry.GRPC_OTHER)
    async def ModelConfig(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        model = self.models.find(request.name, request.version)
        config = json_format.ParseDict(model.config(), model_config_pb2.ModelConfig())
        return service_pb2.ModelConfigResponse(config=config)

    @_rpc(telemetry.GRPC_OTHER)
    async def ModelStatistics(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        """Every model's statistics (no name), or one model's; read on a thread (it reads files)."""
        if request.name:
            self.models.find(request.name, request.version)
        statistics = await asyncio.to_thread(self.models.statistics, request.name or None)
        return json_format.ParseDict(statistics, service_pb2.ModelStatisticsResponse())

    @_rpc(telemetry.GRPC_OTHER)
    async def RepositoryIndex(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        models = [service_pb2.RepositoryIndexResponse.ModelIndex(**m) for m in self.repository.index(request.ready)]
        return service_pb2.RepositoryIndexResponse(models=models)

    @_rpc(telemetry.GRPC_OTHER)
    async def RepositoryModelLoad(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await self.repository.load(request.model_name)
        return service_pb2.RepositoryModelLoadResponse()

    @_rpc(telemetry.GRPC_OTHER)
    async def RepositoryModelUnload(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await self.repository.unload(request.model_name)
        return service_pb2.RepositoryModelUnloadResponse()

    @_rpc(telemetry.GRPC_OTHER)
    async def _no_shared_memory(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        raise tensors.not_supported(tensors.NO_SHARED_MEMORY)

    SystemSharedMemoryStatus = SystemSharedMemoryRegister = SystemSharedMemoryUnregister = _no_shared_memory
    CudaSharedMemoryStatus = CudaSharedMemoryRegister = CudaSharedMemoryUnregister = _no_shared_memory

    @_rpc(telemetry.GRPC_INFER)
    async def ModelInfer(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        request_id = tracing.grpc_request_id(request.id, context.invocation_metadata())
        context.set_trailing_metadata((("x-request-id", request_id),))
        return await self.infer(request, context, request_id)  # its API key was checked by Gate, before it was read

    async def ModelStreamInfer(self, requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> None:
        window = max(1, self.models.max_images())
        await grpc_stream.Stream(self.infer, context, window, self.models.label).serve(requests)

    async def infer(self, request: Any, context: grpc.aio.ServicerContext, request_id: str | None = None) -> Any:
        """One ModelInferRequest answered (ModelInfer's, or one of a stream's): its deadline is the call's, else
        request_timeout_s, counted from now and capped at max_request_timeout_s. With tracing on, it is a server
        span under the call's trace context."""
        started = time.monotonic()
        metadata = context.invocation_metadata()
        request_id = request_id or tracing.grpc_request_id(request.id, metadata)
        with tracing.grpc_request(request_id, metadata, self.models.label(request.model_name), CODES):
            model = self.models.find(request.model_name, request.model_version)
            remaining = context.time_remaining()
            timeout = self.settings.request_timeout_s if remaining is None else remaining
            deadline = started + min(timeout, self.settings.max_request_timeout_s)
            with tracing.step("read"):
                call = _request(request)
            outputs = await model.infer(call, deadline, started)
            return _response(model.name, request.id, [tensor for _, tensor in outputs])


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
    for tensor in [*message.inputs, *message.outputs]:
        tensors.check_in_request(tensor.name, tensor.parameters)
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
