"""The Open Inference Protocol's model repository extension (Triton's): the index of the server's models with their
states, and, with --model-control explicit, loading and unloading one while the others serve.

A load or unload asks the main process (the model's `wanted` flag in the shared state) and waits until it is done,
as Triton's calls do: a load answers once the model is READY, or with the one-line reason it could not be (a worker
failed to set it up, or the models would not fit the device's memory together); an unload once the model's admitted
requests are answered and its memory freed. Without explicit control every call but the index answers that control is
off.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from imgserve.errors import ApiError
from imgserve.handoff.model_state import LOADING, READY, STATE_NAMES, UNAVAILABLE, UNLOADING
from imgserve.handoff.state import SharedState
from imgserve.served import Catalog

POLL_S = 0.05
LOAD_TIMEOUT_S = 600.0  # a model's load (weights, set-up and warm-up in every worker, a compile) may take minutes


class Repository:
    """The catalog's models as the repository extension shows them, and their loads and unloads."""

    def __init__(self, catalog: Catalog, state: SharedState, explicit: bool) -> None:
        self.catalog, self.state, self.explicit = catalog, state, explicit

    def index(self, ready_only: bool = False) -> list[dict[str, Any]]:
        """Every model (or only the ready ones): its name, version, state and the reason it is not ready."""
        found = []
        for model in self.catalog:
            state = self.state.models.state(model.index)
            if ready_only and state != READY:
                continue
            entry = {"name": model.name, "version": "1", "state": STATE_NAMES[state]}
            if state == UNAVAILABLE and (reason := self.state.models.reason(model.index)):
                entry["reason"] = reason
            found.append(entry)
        return found

    async def load(self, name: str) -> None:
        """Load `name` and wait until it is READY; ApiError 400 with the reason when it cannot be."""
        model = self._controlled(name)
        models = self.state.models
        if models.state(model) == READY:
            return
        models.want(model, True)
        state = await self._settled(model, picked_up=lambda state: state == LOADING)
        if state != READY:
            raise ApiError(400, "load_failed", f"failed to load {name!r}: {models.reason(model) or 'it was unloaded'}")

    async def unload(self, name: str) -> None:
        """Unload `name` and wait until its memory is freed (its admitted requests answered first)."""
        model = self._controlled(name)
        models = self.state.models
        if models.state(model) == UNAVAILABLE and not models.wanted(model):
            return
        models.want(model, False)
        await self._settled(model, picked_up=lambda state: state in (UNLOADING, UNAVAILABLE))

    def _controlled(self, name: str) -> int:
        if not self.explicit:
            raise ApiError(400, "control_off", "model control is off: start the server with --model-control explicit")
        model = self.catalog.by_name.get(name)
        if model is None:
            raise ApiError(400, "unknown_model", f"failed to load {name[:100]!r}: no such model in the repository")
        return model.index

    async def _settled(self, model: int, picked_up: Any) -> int:
        """The model's state once the main process has taken up the request and finished it."""
        deadline = time.monotonic() + LOAD_TIMEOUT_S
        taken = False
        while time.monotonic() < deadline:
            state = self.state.models.state(model)
            taken = taken or picked_up(state)
            if taken and state in (READY, UNAVAILABLE):
                return state
            await asyncio.sleep(POLL_S)
        raise ApiError(503, "load_timeout", f"the model did not settle within {LOAD_TIMEOUT_S:.0f} s", 1)


class RepositoryRoutes:
    """The extension's HTTP routes."""

    def __init__(self, repository: Repository) -> None:
        self.repository = repository

    def routes(self) -> list[Route]:
        return [
            Route("/v2/repository/index", self.index, methods=["POST"]),
            Route("/v2/repository/models/{model}/load", self.load, methods=["POST"]),
            Route("/v2/repository/models/{model}/unload", self.unload, methods=["POST"]),
        ]

    async def index(self, request: Request) -> Response:
        body = await request.body()
        try:
            ready = bool(_object(body).get("ready", False))
        except ApiError as error:
            return error.response(request.url.path)
        return JSONResponse(self.repository.index(ready))

    async def load(self, request: Request) -> Response:
        return await self._answer(request, self.repository.load)

    async def unload(self, request: Request) -> Response:
        return await self._answer(request, self.repository.unload)

    async def _answer(self, request: Request, action: Any) -> Response:
        try:
            _object(await request.body())
            await action(request.path_params["model"])
        except ApiError as error:
            return error.response(request.url.path)
        return JSONResponse({})


def _object(body: bytes) -> dict[str, Any]:
    """A request body: empty, or a JSON object (its `parameters` are Triton's and not used here)."""
    if not body.strip():
        return {}
    try:
        found = json.loads(body)
    except (ValueError, RecursionError):
        raise ApiError(400, "bad_request", "the body is not JSON") from None
    if not isinstance(found, dict):
        raise ApiError(400, "bad_request", "the body is a JSON object")
    return found
