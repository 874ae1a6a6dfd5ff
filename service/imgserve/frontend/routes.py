"""HTTP routes of the front end: read and decode the upload, hand it to a worker, answer; health, info, metrics."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from imgserve.config import Settings
from imgserve.errors import ApiError
from imgserve.frontend import codec
from imgserve.frontend.render import Renderer
from imgserve.handoff.dispatch import Dispatcher, Slot
from imgserve.handoff.state import SharedState
from imgserve.models import outputs
from imgserve.models.preprocess import Geometry, Preprocess
from litserve.utils import WorkerSetupStatus
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from python_multipart.multipart import parse_options_header
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

INLINE_CODEC_BYTES = 32 * 1024  # uploads up to this size are decoded (and their answers encoded) on the event loop
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
        return PredictParams(**request.query_params)
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


async def _call(inline: bool, function: Callable[..., Any], *args: Any) -> Any:
    """`function(*args)` on the event loop when `inline`, else in the thread pool."""
    return function(*args) if inline else await run_in_threadpool(function, *args)


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
        dispatcher: Dispatcher,
        metrics_body: Callable[[], bytes],
        describe: Callable[[], dict[str, Any]],
        setup_status: Callable[[], dict[str, str]],
    ) -> None:
        self.settings, self.state, self.dispatcher, self.metrics_body = settings, state, dispatcher, metrics_body
        self.describe, self.setup_status = describe, setup_status
        self.preprocess = Preprocess.from_settings(settings)
        self.renderer = Renderer(settings, outputs.read_labels(settings.labels))

    async def predict(self, request: Request) -> Response:
        try:
            params = _params(request)
            data = await _upload(request)
            # A small image costs less to decode and encode than a hop to the thread pool and back.
            inline = len(data) <= INLINE_CODEC_BYTES
            accept = request.headers.get("accept", "")
            async with self.dispatcher.slot() as slot:
                shape, geometry = await _call(inline, self._decode_into, data, slot)
                answer = await slot.submit(shape, request.scope["state"]["deadline"])
                return await _call(inline, self._render, slot, answer, geometry, params, accept)
        except ApiError as error:
            return error.response()

    def _decode_into(self, data: bytes, slot: Slot) -> tuple[tuple[int, ...], Geometry]:
        """Decode, validate and preprocess the upload straight into the request's slot; its shape is all that is
        queued, and its geometry (how the model's input was cut from the upload) stays here for the answer."""
        pixels, geometry = codec.decode_image(data, self.settings.max_image_pixels, self.preprocess)
        slot.write(pixels)
        return pixels.shape, geometry

    def _render(self, slot: Slot, answer: Any, geometry: Geometry, params: PredictParams, accept: str) -> Response:
        """The worker's result (read from the slot when it lies there) -> the HTTP answer for the model's kind."""
        return self.renderer(self.state.task, slot.result(answer), geometry, params, accept)

    def _not_ready_reason(self) -> str | None:
        if self.state.draining:
            return "draining"
        if not self.state.all_workers_alive:
            return "worker restarting"
        status = self.setup_status()
        if not status or any(value != WorkerSetupStatus.READY for value in status.values()):
            return "model loading"
        return None

    async def ready(self, request: Request) -> JSONResponse:
        reason = self._not_ready_reason()
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
