"""The API's hooks as an inference worker calls them, for the two kinds of API imgserve serves.

An `ImageAPI` was decoded in the front end: the worker runs `batch` -> `predict` -> `unbatch` on the decoded items,
and its outputs go back to be encoded in the front end. A plain `litserve.LitAPI` runs unchanged, every hook where
LitServe runs it: the worker rebuilds the request object LitServe would hand `decode_request` (the JSON body; a
form whose files have `.file.read()`, `.filename`, `.content_type`; a pydantic model where `decode_request`
annotates one), then runs LitServe's steps (`batch`/`unbatch` only when `max_batch_size` > 1, a `context` dict for
the hooks that ask for one) and `encode_response`, whose answer goes back as JSON or as a Response's parts.
"""

from __future__ import annotations

import inspect
import io
import json
import time
from collections.abc import Callable
from typing import Any

import litserve as ls
import numpy as np
import torch
from pydantic import BaseModel
from starlette.datastructures import FormData, Headers, UploadFile
from starlette.responses import Response

from imgserve.api import ImageAPI, hook_signature


class ImageHooks:
    """An ImageAPI in the worker: decoded items in, outputs out (encoded later, in the front end)."""

    def __init__(self, api: ImageAPI) -> None:
        self.api, self.group_by_shape = api, api.group_by_shape

    def prepare(self, item: Any) -> Any:
        return item

    def run(self, values: list[Any]) -> list[Any]:
        return list(self.api.unbatch(self.api.predict(self.api.batch(values))))

    def finish(self, output: Any, value: Any) -> Any:
        return output

    def predict_seconds(self, values: list[Any], device: torch.device) -> tuple[list[Any], float]:
        """`run` with the seconds `predict` took (synchronized on CUDA): the GPU probe's split."""
        batch = self.api.batch(values)
        _synchronize(device)
        started = time.perf_counter()
        output = self.api.predict(batch)
        _synchronize(device)
        seconds = time.perf_counter() - started
        return list(self.api.unbatch(output)), seconds


class LitServeHooks:
    """A plain LitAPI in the worker, run as LitServe runs it; the items are requests as the front end read them."""

    group_by_shape = False  # LitServe batches any requests together

    def __init__(self, api: ls.LitAPI) -> None:
        self.api = api
        self.request_type = request_model(api)
        self.batched = api.max_batch_size > 1
        steps = ("decode_request", "batch", "predict", "unbatch", "encode_response")
        self.hooks = {name: _with_context(getattr(api, name)) for name in steps}
        api.pre_setup()

    def prepare(self, item: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        """The request object LitServe would hand `decode_request`, decoded; with the request's context."""
        context: dict[str, Any] = {}
        return self.hooks["decode_request"](context, self._request(item)), context

    def run(self, values: list[tuple[Any, dict[str, Any]]]) -> list[Any]:
        hooks = self.hooks
        if not self.batched:
            return [hooks["predict"](context, x) for x, context in values]
        inputs, contexts = [value for value, _ in values], [context for _, context in values]
        batch = hooks["batch"](contexts, inputs)
        return list(hooks["unbatch"](contexts, hooks["predict"](contexts, batch)))

    def finish(self, output: Any, value: tuple[Any, dict[str, Any]]) -> dict[str, Any]:
        """`encode_response`'s answer as it travels back: {"json": value} or {"response": its parts}."""
        answer = self.hooks["encode_response"](value[1], output)
        if isinstance(answer, Response):
            headers = [[key.decode("latin-1"), item.decode("latin-1")] for key, item in answer.raw_headers]
            return {"response": {"status": answer.status_code, "headers": headers, "body": bytes(answer.body)}}
        return {"json": _plain(answer)}

    def _request(self, item: dict[str, Any]) -> Any:
        if "form" in item:
            files = [
                (field, UploadFile(io.BytesIO(data), filename=name, headers=Headers({"content-type": kind or ""})))
                for field, name, kind, data in item["files"]
            ]
            return FormData([*item["form"].items(), *files])
        if self.request_type is not None:
            return self.request_type.model_validate_json(item["json"])
        return json.loads(item["json"])


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


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
