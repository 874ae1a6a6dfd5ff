"""imgserve's own HTTP routes: /predict (read the call, run the API's hooks around the model, answer), health, info,
metrics."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from imgserve.api import Request as ApiRequest
from imgserve.api import encoder
from imgserve.errors import ApiError
from imgserve.frontend import tracing
from imgserve.frontend.inference import Inference, Steps
from imgserve.frontend.reading import call_size, read_request
from imgserve.frontend.responding import http_response
from imgserve.handoff.model_state import STATE_NAMES
from imgserve.handoff.state import SharedState
from imgserve.served import ServedModel


class Routes:
    """The endpoints of one server: what they need of it is passed in, so this module does not import the server."""

    def __init__(
        self,
        state: SharedState,
        inference: Inference,
        metrics_body: Callable[[], bytes],
        describe: Callable[[], dict[str, Any]],
        serves_grpc: bool,
        max_image_pixels: int,
    ) -> None:
        self.state, self.inference, self.metrics_body, self.describe = state, inference, metrics_body, describe
        self.serves_grpc, self.max_image_pixels = serves_grpc, max_image_pixels

    def predict_with(self, model: ServedModel) -> Callable[[Request], Awaitable[Response]]:
        """POST at the model's path: the call read into a Request, decoded, run, encoded and answered."""
        api = model.api
        encode = encoder(api)
        steps: Steps[ApiRequest, Response] = Steps(
            model, api.decode_request, lambda output, call: http_response(encode(output, call)), call_size
        )

        async def predict(request: Request) -> Response:
            try:
                with tracing.step("read"):
                    call = await read_request(request, self.max_image_pixels)
                (response,) = await self.inference.run([call], request.scope["state"]["deadline"], steps)
                return response
            except ApiError as error:
                return error.response()

        return predict

    def not_ready_reason(self, model: int | None = None) -> str | None:
        """Why the server (or `model`) cannot take requests now (draining, a worker restarting, loading, the gRPC
        service not yet listening, the model not loaded), or None when ready."""
        if self.state.draining:
            return "draining"
        if not self.state.all_workers_alive:
            return "worker restarting"
        if not self.state.workers_ready:
            return "model loading"
        if self.serves_grpc and not self.state.grpc_serving:  # the first front end has not started it yet
            return "gRPC starting"
        if model is not None and not self.state.models.ready(model):
            return STATE_NAMES[self.state.models.state(model)].lower()
        return None

    async def ready(self, request: Request) -> JSONResponse:
        reason = self.not_ready_reason()
        if reason:
            return JSONResponse({"status": "not ready", "reason": reason}, status_code=503)
        return JSONResponse({"status": "ready"})

    async def live(self, request: Request) -> JSONResponse:
        return JSONResponse({"status": "alive"})

    async def info(self, request: Request) -> JSONResponse:
        return JSONResponse(self.describe())

    async def metrics(self, request: Request) -> Response:
        body = await run_in_threadpool(self.metrics_body)
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")
