"""A plain `litserve.LitAPI` served unchanged, through the same core as every `ImageAPI`: `LitServeAPI` is the
ImageAPI that carries it.

Its hooks run where LitServe runs them, in the inference worker: the front end reads the call as it reads every
call (the same limits) and packs what `decode_request` will get (the JSON body, or a form's fields and files, their
bytes in the slot). In the worker, `batch` rebuilds the request object LitServe hands `decode_request` (the JSON,
a pydantic model where `decode_request` annotates one, a form whose files have `.file.read()`, `.filename`,
`.content_type`) and runs it, then LitServe's `batch`; `predict` runs LitServe's `predict` (per request when the
API is not batched); `unbatch` runs LitServe's `unbatch` and `encode_response`, whose answer travels back as JSON
or as a Response's parts. A hook with a `context` parameter gets the request's context dict, one per request in the
batch steps, as in LitServe. Batching follows the served batch size: with more than one, LitServe's `batch` and
`unbatch` run, as LitServe runs them.
"""

from __future__ import annotations

import inspect
import io
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import litserve as ls
import numpy as np
import torch
from pydantic import BaseModel
from starlette.datastructures import FormData, Headers, UploadFile
from starlette.responses import Response

from imgserve.api import FORM_TYPES, ImageAPI, Request, hook_signature

STEPS = ("decode_request", "batch", "predict", "unbatch", "encode_response")


@dataclass
class LitBatch:
    """What travels from `batch` to `predict` to `unbatch` in the worker: LitServe's batch (or the decoded inputs,
    unbatched) and then its output, with each request's context."""

    value: Any
    contexts: list[dict[str, Any]] = field(default_factory=list)


class LitServeAPI(ImageAPI):
    """The ImageAPI that serves the plain LitAPI `api` at its own `api_path`, with this batch size and timeout."""

    group_by_shape = False  # LitServe batches any requests together

    def __init__(self, api: ls.LitAPI, max_batch_size: int, batch_timeout_s: float) -> None:
        super().__init__(max_batch_size=max_batch_size, batch_timeout=batch_timeout_s, api_path=api.api_path)
        self.lit = api
        self.request_type = request_model(api)
        self.batched = max_batch_size > 1
        self.hooks: dict[str, Callable[..., Any]] = {}  # made in the worker (lambdas do not travel there)

    def describe(self) -> str:
        return f"{type(self.lit).__module__}.{type(self.lit).__qualname__}"

    # In the front ends.
    def decode_request(self, request: Request) -> dict[str, Any]:
        """What travels to the worker: {"json": the body} (checked to be JSON unless a pydantic model was already
        validated from it), or a form's {"form": fields, "files": [[field, filename, content type, bytes], ...]}."""
        if request.files or request.content_type in FORM_TYPES:
            files = [[upload.field, upload.filename, upload.content_type, upload.data] for upload in request.files]
            return {"form": dict(request.form), "files": files}
        if self.request_type is None:
            request.json()  # 400 when it is not JSON
        return {"json": request.body}

    def encode_response(self, answer: dict[str, Any], request: Request) -> Any:
        """What `encode_response` answered in the worker: its JSON value (the route serializes it as FastAPI
        does), or the Response it returned."""
        if "response" not in answer:
            return answer["json"]
        parts = answer["response"]
        response = Response(parts["body"], status_code=parts["status"])
        response.raw_headers = [(key.encode("latin-1"), value.encode("latin-1")) for key, value in parts["headers"]]
        return response

    def example_request(self) -> None:
        """None: there is nothing to measure a plain LitAPI's memory on."""
        return None

    # In the inference workers.
    def setup(self, device: str) -> None:
        self.hooks = {name: _with_context(getattr(self.lit, name)) for name in STEPS}
        self.lit.pre_setup()
        self.lit.setup(device)
        self.lit.device = device  # as LitServe sets it after setup

    def batch(self, inputs: list[dict[str, Any]]) -> LitBatch:
        contexts: list[dict[str, Any]] = [{} for _ in inputs]
        decoded = [
            self.hooks["decode_request"](c, self._request(item)) for c, item in zip(contexts, inputs, strict=True)
        ]
        return LitBatch(self.hooks["batch"](contexts, decoded) if self.batched else decoded, contexts)

    def predict(self, batch: LitBatch) -> LitBatch:
        hooks, contexts = self.hooks, batch.contexts
        if self.batched:
            return LitBatch(hooks["predict"](contexts, batch.value), contexts)
        return LitBatch([hooks["predict"](c, x) for c, x in zip(contexts, batch.value, strict=True)], contexts)

    def unbatch(self, output: LitBatch) -> list[dict[str, Any]]:
        outputs = list(self.hooks["unbatch"](output.contexts, output.value)) if self.batched else output.value
        return [self._finished(c, y) for c, y in zip(output.contexts, outputs, strict=True)]

    def _request(self, item: dict[str, Any]) -> Any:
        """The request object LitServe would hand `decode_request`."""
        if "form" in item:
            files = [
                (name, UploadFile(io.BytesIO(data), filename=filename, headers=Headers({"content-type": kind or ""})))
                for name, filename, kind, data in item["files"]
            ]
            return FormData([*item["form"].items(), *files])
        if self.request_type is not None:
            return self.request_type.model_validate_json(item["json"])
        return json.loads(item["json"])

    def _finished(self, context: dict[str, Any], output: Any) -> dict[str, Any]:
        """`encode_response`'s answer as it travels back: {"json": value} or {"response": its parts}."""
        answer = self.hooks["encode_response"](context, output)
        if isinstance(answer, Response):
            headers = [[key.decode("latin-1"), value.decode("latin-1")] for key, value in answer.raw_headers]
            return {"response": {"status": answer.status_code, "headers": headers, "body": bytes(answer.body)}}
        return {"json": _plain(answer)}


def request_model(api: ls.LitAPI) -> type[BaseModel] | None:
    """The pydantic model `decode_request` annotates its request with, if any (LitServe validates the body as it)."""
    parameter = hook_signature(api.decode_request).parameters.get("request")
    annotation = None if parameter is None else parameter.annotation
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def _with_context(hook: Any) -> Callable[..., Any]:
    """`hook` called as `call(context, *args)`, LitServe's convention: a hook with a parameter named `context` gets
    the request's context dict (a list of them for the batch steps), the others do not."""
    if "context" in inspect.signature(hook).parameters:
        return lambda context, *args: hook(*args, context=context)
    return lambda context, *args: hook(*args)


def _plain(value: Any) -> Any:
    """What FastAPI would serialize, in values that travel: pydantic models dumped, arrays and tensors as lists."""
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().tolist()
    if isinstance(value, np.ndarray | np.generic):
        return value.tolist()
    if isinstance(value, dict):
        return {str(key): _plain(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(item) for item in value]
    return value
