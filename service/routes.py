"""HTTP routes of the front end: read and decode the upload, hand it to a worker, answer; health, info, metrics."""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from typing import TYPE_CHECKING, Any, Literal

from litserve.utils import LitAPIStatus, ResponseBufferItem, WorkerSetupStatus
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from service import codec, metrics, tasks
from service.errors import ApiError
from service.preprocess import Preprocess

if TYPE_CHECKING:
    from service.server import ImageServer

WORKER_CHECK_S = 0.25


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
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise ApiError(422, "bad_parameters", problems) from None


async def _upload(request: Request) -> bytes:
    """The image bytes: the multipart field `file`, or the raw body with an image Content-Type."""
    media = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media == "multipart/form-data":
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


class Routes:
    """The endpoints, bound to one ImageServer (its queues, response buffer and shared state)."""

    def __init__(self, server: ImageServer) -> None:
        self.server = server
        self.settings, self.state = server.settings, server.state
        self.preprocess = Preprocess.from_settings(self.settings)
        self.renderer = tasks.Renderer(self.settings, tasks.read_labels(self.settings.labels))
        self._free_slots: list[int] | None = None  # this front end's slots in the shared taken-by table
        self._tickets = itertools.count(1)

    async def predict(self, request: Request) -> Response:
        try:
            params = _params(request)
            data = await _upload(request)
            pixels, geometry = await run_in_threadpool(
                codec.decode_image, data, self.settings.max_image_pixels, self.preprocess
            )
            payload = {
                "pixels": pixels,
                "geometry": geometry,  # issue 15: the upload's size and crop, to map masks and boxes back
                "deadline": request.scope["state"]["deadline"],
                "admitted": time.monotonic(),
            }
            output = await self._dispatch(payload)
            return await run_in_threadpool(
                self.renderer, self.state.task, output, payload["geometry"], params, request.headers.get("accept", "")
            )
        except ApiError as error:
            return error.response()

    def _claim_slot(self) -> int:
        if self._free_slots is None:  # the first request in this front-end process: take its own range
            size = self.server.slots_per_front_end
            first = self.server.app.response_queue_id * size
            self._free_slots = list(range(first, first + size))
        return self._free_slots.pop()  # never empty: admission keeps fewer requests in flight than there are slots

    async def _dispatch(self, payload: dict[str, Any]) -> Any:
        """Queue the payload for a worker and wait for its answer, until the deadline or the worker's death."""
        server, uid = self.server, uuid.uuid4().hex
        slot, ticket = self._claim_slot(), next(self._tickets)
        item = ResponseBufferItem(event=asyncio.Event())
        server.response_buffer[uid] = item
        submitted = time.monotonic()
        payload["slot"] = (slot, ticket)  # where the worker that takes it marks itself (SharedState.mark_taken)
        server.request_queue.put((server.app.response_queue_id, uid, submitted, payload))
        try:
            while not item.event.is_set():
                remaining = payload["deadline"] - time.monotonic()
                if remaining <= 0:
                    metrics.REJECTED.labels("deadline").inc()
                    raise ApiError(504, "deadline", "no answer before the request's deadline")
                worker = self.state.taken_by(slot, ticket)
                if worker is not None and self.state.lost_since(worker, submitted):
                    metrics.REJECTED.labels("worker_lost").inc()
                    raise ApiError(503, "worker_lost", "the inference worker died", self.settings.retry_after_s)
                try:
                    await asyncio.wait_for(item.event.wait(), timeout=min(remaining, WORKER_CHECK_S))
                except TimeoutError:
                    continue
        finally:
            server.response_buffer.pop(uid, None)
            self._free_slots.append(slot)
        output, status = item.response
        if status == LitAPIStatus.ERROR or output is None:
            raise ApiError(500, "internal_error", "the inference worker failed on this batch")
        if isinstance(output, ApiError):
            raise output
        return output

    def _not_ready_reason(self) -> str | None:
        if self.state.draining:
            return "draining"
        if not self.state.all_workers_alive:
            return "worker restarting"
        status = dict(self.server.workers_setup_status)
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
        return JSONResponse(self.server.describe())

    async def metrics(self, request: Request) -> Response:
        body = await run_in_threadpool(metrics.exposition, self.server.pod_collector)
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")
