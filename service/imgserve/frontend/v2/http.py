"""The Open Inference Protocol over HTTP, beside imgserve's own routes on the same port: health, metadata, config,
statistics and infer (JSON tensors, Triton's binary tensor data extension, raw binary bodies, gzip/deflate bodies);
the shared-memory extensions' routes answer that they are not supported (501, as Triton answers with them off).

Errors are the protocol's `{"error": "<message>"}`. Health answers 200 for true and 400 for false (required_api.md:
"a 4xx status code indicates false"; Triton's choice of 4xx), with JSON bodies where the text wants them empty
(KServe's client reads `ready` from a 200 and `error` from any other answer).
"""

from __future__ import annotations

import json
import time
import zlib
from collections.abc import Callable, Collection
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from imgserve.errors import ApiError
from imgserve.frontend import tracing
from imgserve.frontend.inference import INLINE_CODEC_BYTES
from imgserve.frontend.v2 import tensors
from imgserve.frontend.v2.model import VERSION, V2Model, V2Models
from imgserve.frontend.v2.tensors import InferRequest, RequestedOutput, Tensor

HEADER_LENGTH = "Inference-Header-Content-Length"
ACTIONS = ("status", "register", "unregister")  # of the shared-memory extensions
NOT_READY = 400
ANY_ZLIB_HEADER = 32 + zlib.MAX_WBITS  # gzip or zlib, told apart by the header


class V2Routes:
    """The HTTP endpoints of the protocol for the served models."""

    def __init__(self, models: V2Models, max_body_bytes: int) -> None:
        self.models, self.max_body_bytes = models, max_body_bytes

    def routes(self) -> list[Route]:
        """Every route, each model route with and without `/versions/{version}`."""
        found = [
            Route("/v2", self.server_metadata, methods=["GET"]),
            Route("/v2/", self.server_metadata, methods=["GET"]),  # the OpenAPI document's spelling
            Route("/v2/health/live", self.live, methods=["GET"]),
            Route("/v2/health/ready", self.ready, methods=["GET"]),
            Route("/v2/models/stats", self.statistics, methods=["GET"]),
        ]
        for base in ("/v2/models/{model}", "/v2/models/{model}/versions/{version}"):
            found += [
                Route(base, self.metadata, methods=["GET"]),
                Route(f"{base}/ready", self.model_ready, methods=["GET"]),
                Route(f"{base}/config", self.config, methods=["GET"]),
                Route(f"{base}/stats", self.statistics, methods=["GET"]),
                Route(f"{base}/infer", self.infer, methods=["POST"]),
            ]
        for memory in ("systemsharedmemory", "cudasharedmemory"):
            for base in (f"/v2/{memory}", f"/v2/{memory}/region/{{region}}"):
                found += [Route(f"{base}/{action}", self.shared_memory, methods=["GET", "POST"]) for action in ACTIONS]
        return found

    async def server_metadata(self, request: Request) -> JSONResponse:
        return JSONResponse(self.models.server_metadata())

    async def live(self, request: Request) -> JSONResponse:
        return JSONResponse({"live": True})

    async def ready(self, request: Request) -> JSONResponse:
        return self._readiness({}, self.models.not_ready_reason(None))

    async def model_ready(self, request: Request) -> Response:
        return await self._answer(request, self._model_ready)

    async def metadata(self, request: Request) -> Response:
        return await self._answer(request, lambda model: JSONResponse(model.metadata()))

    async def config(self, request: Request) -> Response:
        return await self._answer(request, lambda model: JSONResponse(model.config()))

    async def statistics(self, request: Request) -> Response:
        """Every model's statistics (`/v2/models/stats`), or one model's; read on a thread (it reads files)."""
        name = request.path_params.get("model")
        try:
            if name is not None:
                self.models.find(name, request.path_params.get("version"))
            return JSONResponse(await run_in_threadpool(self.models.statistics, name))
        except ApiError as error:
            return error.response(request.url.path)

    async def shared_memory(self, request: Request) -> Response:
        return tensors.not_supported(tensors.NO_SHARED_MEMORY).response(request.url.path)

    def _model_ready(self, model: V2Model) -> JSONResponse:
        return self._readiness({"name": model.name}, self.models.model_not_ready_reason(model.name))

    def _readiness(self, body: dict[str, Any], reason: str | None) -> JSONResponse:
        """200 `{..., "ready": true}`, or 400 `{..., "ready": false, "error": why}` (loading, draining, ...)."""
        if reason is None:
            return JSONResponse({**body, "ready": True})
        return JSONResponse({**body, "ready": False, "error": f"not ready: {reason}"}, status_code=NOT_READY)

    async def _answer(self, request: Request, answer: Callable[[V2Model], Response]) -> Response:
        try:
            return answer(self.models.find(request.path_params["model"], request.path_params.get("version")))
        except ApiError as error:
            return error.response(request.url.path)

    async def infer(self, request: Request) -> Response:
        try:
            model = self.models.find(request.path_params["model"], request.path_params.get("version"))
            with tracing.step("read"):
                parsed = await self._parsed(request, model)
                tracing.adopt(parsed.id)
            state = request.scope["state"]
            outputs = await model.infer(parsed, state["deadline"], state.get("first_byte", time.monotonic()))
            if sum(tensors.nbytes(tensor) for _, tensor in outputs) <= INLINE_CODEC_BYTES:
                return self._response(model, parsed, outputs)
            return await run_in_threadpool(self._response, model, parsed, outputs)
        except ApiError as error:
            return error.response(request.url.path)

    async def _parsed(self, request: Request, model: V2Model) -> InferRequest:
        """The request's body inflated and parsed: on the event loop when its JSON is small and it is not compressed,
        else on the front end's codec threads (a 20 KB gzip body can inflate to max_body_bytes). Binary tensors cost
        no more than their element count, which the parser holds to max_images."""
        body, encoding = await request.body(), _encoding(request.headers.get("content-encoding"))
        header_length = request.headers.get(HEADER_LENGTH)
        limits = (header_length, self.max_body_bytes, model.max_images(), model.binary_inputs)
        if encoding == "identity" and tensors.json_length(len(body), header_length) <= INLINE_CODEC_BYTES:
            return parse_body(body, encoding, *limits)
        return await model.inference.codec.run(parse_body, body, encoding, *limits)

    def _response(
        self, model: V2Model, request: InferRequest, outputs: list[tuple[RequestedOutput, Tensor]]
    ) -> Response:
        """The answer: a JSON header, then the binary outputs in order (with the header's length) if any."""
        header: dict[str, Any] = {"model_name": model.name, "model_version": VERSION}
        if request.id is not None:
            header["id"] = request.id
        header["outputs"], blobs = [], []
        for output, tensor in outputs:
            entry: dict[str, Any] = {"name": tensor.name, "datatype": tensor.datatype, "shape": tensor.shape}
            if output.binary:
                blobs.append(tensors.raw(tensor))
                entry["parameters"] = {"binary_data_size": len(blobs[-1])}
            else:
                entry["data"] = tensors.json_data(tensor)
            header["outputs"].append(entry)
        text = json.dumps(header, separators=(",", ":")).encode()
        if not blobs:
            return Response(text, media_type="application/json")
        headers = {HEADER_LENGTH: str(len(text))}
        return Response(b"".join([text, *blobs]), media_type="application/octet-stream", headers=headers)


def parse_body(
    body: bytes, encoding: str, header_length: str | None, limit: int, max_images: int, binary: Collection[str]
) -> InferRequest:
    """An infer body after its Content-Encoding, parsed: at most `limit` bytes once inflated and `max_images` BYTES
    elements per input (413 beyond either), each checked before the work it bounds is done; the BYTES inputs named
    in `binary` are base64 in JSON, any other text."""
    return tensors.parse_http(_decompressed(body, encoding, limit), header_length, max_images, binary)


def _encoding(value: str | None) -> str:
    return (value or "identity").strip().lower()


def _decompressed(body: bytes, encoding: str, limit: int) -> bytes:
    """The body after its Content-Encoding (gzip, deflate or identity), held to `limit` bytes once inflated: the
    inflater stops one byte past the limit, whatever the compressed body claims."""
    if encoding == "identity":
        return body
    if encoding not in ("gzip", "deflate"):
        raise ApiError(415, "unsupported_encoding", f"Content-Encoding {encoding[:30]!r} is not supported")
    inflater = zlib.decompressobj(ANY_ZLIB_HEADER)
    try:
        inflated = inflater.decompress(body, limit + 1)
    except zlib.error as exc:
        raise tensors.bad(f"the {encoding} body cannot be inflated: {exc}") from None
    if len(inflated) > limit:
        raise ApiError(413, "body_too_large", f"the inflated body is over the limit of {limit} bytes")
    if not inflater.eof:
        raise tensors.bad(f"the {encoding} body is truncated")
    return inflated
