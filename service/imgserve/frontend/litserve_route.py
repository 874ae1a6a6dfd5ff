"""A plain `litserve.LitAPI`'s route, answered as LitServe answers it, through the same core as every route.

The route is registered on FastAPI as LitServe registers it (the `request` parameter typed as `decode_request`
annotates it, the answer typed as `encode_response` annotates its return), so FastAPI validates a pydantic body (a
422 as LitServe's) and serializes the answer exactly as it would under LitServe. The call is read as every call is
(`reading.read_request`, the same limits) and run through `Inference` with the API's hooks (`litapi.LitServeAPI`:
what travels to the worker, and the worker's answer back). An error answers FastAPI's {"detail": ...} with its
status, as LitServe does; admission, keys and deadlines answer as on every imgserve route.
"""

from __future__ import annotations

import inspect
from typing import Any

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from imgserve.api import encoder, hook_signature
from imgserve.errors import ApiError
from imgserve.frontend import tracing
from imgserve.frontend.inference import Inference, Steps
from imgserve.frontend.reading import call_size, read_request
from imgserve.litapi import LitServeAPI
from imgserve.served import ServedModel


class LitServeRoute:
    """POST `api.api_path` for the plain LitAPI that the model's API (a LitServeAPI) serves."""

    def __init__(self, model: ServedModel, api: LitServeAPI, inference: Inference, max_image_pixels: int) -> None:
        self.model, self.api, self.inference, self.max_image_pixels = model, api, inference, max_image_pixels
        decode = hook_signature(api.lit.decode_request).parameters.get("request")
        self.request_type = decode.annotation if decode and decode.annotation is not decode.empty else Request
        returned = hook_signature(api.lit.encode_response).return_annotation
        self.response_type = Response if returned is inspect.Signature.empty else returned
        self.steps = Steps(model, api.decode_request, encoder(api), call_size)

    def register(self, app: FastAPI) -> None:
        """Add the route to the app, typed as LitServe types it."""
        path = self.api.api_path

        async def endpoint(request: Any, call: Request | None = None) -> Any:
            return await self.answer(call or request)

        kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
        parameters = [inspect.Parameter("request", kind, annotation=self.request_type)]
        if self.request_type is not Request:  # FastAPI passes the HTTP call to one Request parameter only
            parameters.append(inspect.Parameter("call", kind, annotation=Request))
        signature = inspect.Signature(parameters, return_annotation=self.response_type)
        endpoint.__signature__ = signature  # type: ignore[attr-defined]  # FastAPI reads the types from it
        app.add_api_route(path, endpoint, methods=["POST"])

    async def answer(self, call: Request) -> Any:
        """The worker's answer for one call: what `encode_response` returned (FastAPI serializes it), or a Response."""
        try:
            with tracing.step("read"):
                read = await read_request(call, self.max_image_pixels)
            (answer,) = await self.inference.run([read], call.scope["state"]["deadline"], self.steps)
        except ApiError as error:
            headers = {"Retry-After": str(error.retry_after)} if error.retry_after is not None else None
            return JSONResponse({"detail": error.message}, status_code=error.status, headers=headers)
        return answer
