"""A plain `litserve.LitAPI`'s route, answered as LitServe answers it, with imgserve's guarantees around it.

The route is registered on FastAPI as LitServe registers it (the `request` parameter typed as `decode_request`
annotates it, the answer typed as `encode_response` annotates its return), so FastAPI reads the body (a pydantic
model validated: 422 as LitServe's) and serializes the answer exactly as it would under LitServe. The front end
only packs what was read for the worker: the JSON body, or a form's fields and files (their bytes in the slot);
the worker runs every hook (worker/hooks.py). An error of the API's hooks answers FastAPI's {"detail": ...} with
its status, as LitServe does; admission, keys and deadlines answer as on every imgserve route.
"""

from __future__ import annotations

import inspect
import json
from typing import Any

import litserve as ls
from fastapi import FastAPI
from pydantic import BaseModel
from starlette.datastructures import UploadFile
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from imgserve.api import hook_signature
from imgserve.config import Settings
from imgserve.errors import ApiError
from imgserve.frontend import telemetry
from imgserve.frontend.inference import Inference, Steps

FORM_TYPES = ("multipart/form-data", "application/x-www-form-urlencoded")


class LitServeRoute:
    """POST `api.api_path` for a plain LitAPI."""

    def __init__(self, api: ls.LitAPI, inference: Inference, settings: Settings) -> None:
        self.api, self.inference, self.settings = api, inference, settings
        decode = hook_signature(api.decode_request).parameters.get("request")
        self.request_type = decode.annotation if decode and decode.annotation is not decode.empty else Request
        returned = hook_signature(api.encode_response).return_annotation
        self.response_type = Response if returned is inspect.Signature.empty else returned
        self.steps: Steps[dict[str, Any]] = Steps(lambda item: item, lambda answer, item: answer, _size)

    def register(self, app: FastAPI) -> None:
        """Add the route to the app, typed as LitServe types it, and count it as a prediction route."""
        path = self.api.api_path
        telemetry.serve_predictions_at(path)

        async def endpoint(request: Any, call: Request | None = None) -> Any:
            return await self.answer(request, call or request)

        kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
        parameters = [inspect.Parameter("request", kind, annotation=self.request_type)]
        if self.request_type is not Request:  # FastAPI passes the HTTP call to one Request parameter only
            parameters.append(inspect.Parameter("call", kind, annotation=Request))  # for its deadline
        signature = inspect.Signature(parameters, return_annotation=self.response_type)
        endpoint.__signature__ = signature  # type: ignore[attr-defined]  # FastAPI reads the types from it
        app.add_api_route(path, endpoint, methods=["POST"])

    async def answer(self, request: Any, call: Request) -> Any:
        """The worker's answer for one call: what `encode_response` returned (FastAPI serializes it), or a Response."""
        try:
            item = await _item(request)
            (answer,) = await self.inference.run([item], call.scope["state"]["deadline"], self.steps)
        except ApiError as error:
            headers = {"Retry-After": str(error.retry_after)} if error.retry_after is not None else None
            return JSONResponse({"detail": error.message}, status_code=error.status, headers=headers)
        if "response" in answer:
            parts = answer["response"]
            response = Response(parts["body"], status_code=parts["status"])
            response.raw_headers = [(key.encode("latin-1"), value.encode("latin-1")) for key, value in parts["headers"]]
            return response
        return answer["json"]


async def _item(request: Any) -> dict[str, Any]:
    """What travels to the worker: {"json": body bytes} (a pydantic model as its JSON), or a form's
    {"form": fields, "files": [[field, filename, content type, bytes], ...]}."""
    if isinstance(request, BaseModel):
        return {"json": request.model_dump_json().encode()}
    content_type = request.headers.get("content-type", "")
    if content_type.split(";")[0].strip().lower() in FORM_TYPES:
        form = await request.form()
        fields, files = {}, []
        for name, value in form.multi_items():
            if isinstance(value, UploadFile):
                files.append([name, value.filename, value.content_type, await value.read()])
            else:
                fields[name] = value
        return {"form": fields, "files": files}
    body = await request.body()
    try:
        json.loads(body)
    except (ValueError, RecursionError) as exc:
        raise ApiError(400, "bad_json", f"the body is not JSON: {exc}"[:300]) from None
    return {"json": body}


def _size(item: dict[str, Any]) -> int:
    if "json" in item:
        return len(item["json"])
    return sum(len(data) for *_, data in item["files"])
