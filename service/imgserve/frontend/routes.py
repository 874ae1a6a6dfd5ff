"""imgserve's own HTTP routes: /predict (read the upload, infer, render the answer), health, info, metrics."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from litserve.utils import WorkerSetupStatus
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from python_multipart.multipart import parse_options_header
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from imgserve.config import Settings
from imgserve.errors import ApiError
from imgserve.frontend.inference import Inference
from imgserve.frontend.render import Renderer
from imgserve.handoff.state import SharedState
from imgserve.models import outputs

MAX_LISTED_PROBLEMS = 5


class PredictParams(BaseModel):
    """Query parameters of POST /predict."""

    model_config = ConfigDict(extra="forbid")

    format: Literal["jpeg", "png", "webp", "json"] | None = None
    quality: int | None = Field(None, ge=1, le=100)
    top_k: int = Field(5, ge=1, le=1000)
    score_threshold: float = Field(0.5, ge=0, le=1)


def _params(request: Request) -> PredictParams:
    try:
        return PredictParams.model_validate(dict(request.query_params))
    except ValidationError as exc:
        errors = exc.errors()
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}"[:100] for e in errors[:MAX_LISTED_PROBLEMS])
        more = len(errors) - MAX_LISTED_PROBLEMS
        raise ApiError(422, "bad_parameters", problems + (f"; and {more} more" if more > 0 else "")) from None


async def _upload(request: Request) -> bytes:
    """The image bytes: the multipart field `file`, or the raw body with an image Content-Type."""
    media = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media == "multipart/form-data":
        _check_multipart_closed(request, await request.body())
        try:
            form = await request.form(max_files=1, max_fields=16)
        except StarletteHTTPException as exc:
            raise ApiError(400, "bad_multipart", str(exc.detail)) from None
        upload = form.get("file")
        if upload is None or isinstance(upload, str):
            fields = ", ".join(form.keys()) or "none"
            raise ApiError(422, "missing_file", f"expected a multipart file field named 'file' (got: {fields})")
        return await upload.read()
    if media.startswith("image/") or media == "application/octet-stream":
        return await request.body()
    raise ApiError(
        415,
        "unsupported_media_type",
        f"Content-Type {media or 'none'} is not accepted: send multipart/form-data with a 'file' field "
        "or the raw image with an image/* Content-Type",
    )


def _check_multipart_closed(request: Request, body: bytes) -> None:
    """A body cut before its closing boundary is malformed (Starlette would parse it as a form without the file)."""
    _, options = parse_options_header(request.headers["content-type"])
    boundary = options.get(b"boundary", b"")
    if not boundary or body.rfind(b"--" + boundary + b"--") < 0:
        raise ApiError(400, "bad_multipart", "the multipart body has no boundary or is not closed by it")


class Routes:
    """The endpoints of one server: what they need of it is passed in, so this module does not import the server."""

    def __init__(
        self,
        settings: Settings,
        state: SharedState,
        inference: Inference,
        metrics_body: Callable[[], bytes],
        describe: Callable[[], dict[str, Any]],
        setup_status: Callable[[], dict[str, str]],
    ) -> None:
        self.settings, self.state, self.inference, self.metrics_body = settings, state, inference, metrics_body
        self.describe, self.setup_status = describe, setup_status
        self.renderer = Renderer(settings, outputs.read_labels(settings.labels))

    async def predict(self, request: Request) -> Response:
        try:
            params = _params(request)
            data = await _upload(request)
            accept = request.headers.get("accept", "")

            def render(result: Any, geometry: Any) -> Response:
                return self.renderer(self.state.task or "", result, geometry, params, accept)

            (response,) = await self.inference.run([data], request.scope["state"]["deadline"], render)
            return response
        except ApiError as error:
            return error.response()

    def not_ready_reason(self) -> str | None:
        """Why the model cannot take requests now (draining, a worker restarting, loading, the gRPC service not yet
        listening), or None when ready."""
        if self.state.draining:
            return "draining"
        if not self.state.all_workers_alive:
            return "worker restarting"
        status = self.setup_status()
        if not status or any(value != WorkerSetupStatus.READY for value in status.values()):
            return "model loading"
        if self.settings.grpc_port and not self.state.grpc_serving:  # the first front end has not started it yet
            return "gRPC starting"
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
