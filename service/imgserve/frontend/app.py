"""The HTTP front end's application: each served model's routes (its predict route at its path, or a plain LitAPI's as
LitServe registers it; the Open Inference Protocol's by its name), health, info, metrics and docs, behind the
middlewares that count every answer, check API keys and admit inference requests.

It is built once, in the main process, before the front ends are forked; each front-end process then starts it as front
end `index` (its `lifespan`): its dispatcher (requests out, answers in, on its event loop), and in the first one the
gRPC service.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI
from fastapi.telemetry import TelemetryConfig
from starlette.routing import Route

from imgserve import heap
from imgserve.config import Access, RequestLimits, ServerSettings
from imgserve.errors import install_handlers
from imgserve.frontend import docs_page, openapi, telemetry, tracing
from imgserve.frontend.admission import Admission, AdmissionMiddleware
from imgserve.frontend.auth import ApiKeyMiddleware, Keys
from imgserve.frontend.inference import Inference
from imgserve.frontend.litserve_route import LitServeRoute
from imgserve.frontend.routes import Routes
from imgserve.frontend.v2 import grpc_service
from imgserve.frontend.v2.http import V2Routes
from imgserve.frontend.v2.model import V2Models
from imgserve.frontend.v2.repository import Repository, RepositoryRoutes
from imgserve.handoff.answers import AnswerSockets
from imgserve.handoff.requests import ModelRequests
from imgserve.handoff.state import SharedState
from imgserve.litapi import LitServeAPI
from imgserve.served import Catalog

# imgserve's own spans and metrics are the server's (frontend/tracing.py, telemetry.py). FastAPI's native telemetry
# would add a second server span of every request wherever a global OpenTelemetry provider is set (the
# opentelemetry-instrument launcher sets one), and costs every request its providers' look-up even where none is.
NO_FASTAPI_TELEMETRY: TelemetryConfig = {"tracing": False, "metrics": False, "logs": False}


class FrontEnd:
    """The application every front-end process runs, and what each one starts with."""

    def __init__(
        self,
        catalog: Catalog,
        settings: ServerSettings,
        state: SharedState,
        keys: Keys,
        inference: Inference,
        hand_off: tuple[ModelRequests, AnswerSockets],
        metrics_body: Callable[[], bytes],
        describe: Callable[[], dict[str, Any]],
    ) -> None:
        self.catalog, self.settings, self.state, self.keys, self.inference = catalog, settings, state, keys, inference
        self.requests, self.answers = hand_off
        self.index = 0  # which front end this process is: set in each forked process before it serves
        limits = settings.part(RequestLimits)
        self.routes = Routes(state, inference, metrics_body, describe, self.serves_grpc, limits.max_image_pixels)
        self.models = V2Models(catalog, settings, state, inference, self.routes.not_ready_reason)
        self.repository = Repository(catalog, state, settings.model_control == "explicit")
        servicer = grpc_service.Servicer(self.models, self.repository, settings, keys)
        self.grpc_servicer = servicer if self.serves_grpc else None
        self.app = FastAPI(
            openapi_url=None, docs_url=None, redoc_url=None, lifespan=self.lifespan, telemetry=NO_FASTAPI_TELEMETRY
        )
        self._add_routes()
        self._add_middlewares(inference.admission)
        install_handlers(self.app)

    @property
    def serves_grpc(self) -> bool:
        """gRPC runs where the settings ask for it and a model has the Open Inference Protocol's routes."""
        with_v2 = any(not isinstance(model.api, LitServeAPI) for model in self.catalog)
        return bool(self.settings.grpc_port) and with_v2

    def _add_routes(self) -> None:
        app, routes = self.app, self.app.router.routes
        for model in self.catalog:
            for path in model.paths:
                telemetry.serve_predictions_at(path)
            if isinstance(model.api, LitServeAPI):
                LitServeRoute(model, model.api, self.inference, self.settings.max_image_pixels).register(app)
            else:
                routes.extend(Route(path, self.routes.predict_with(model), methods=["POST"]) for path in model.paths)
        if self.models.by_name:
            routes.extend(V2Routes(self.models, self.settings.max_body_bytes).routes())
        routes.extend(RepositoryRoutes(self.repository).routes())
        for path, endpoint in (
            ("/health/live", self.routes.live),
            ("/health/ready", self.routes.ready),
            ("/health", self.routes.ready),
            ("/info", self.routes.info),
            ("/metrics", self.routes.metrics),
        ):
            routes.append(Route(path, endpoint, methods=["GET"]))
        if self.settings.docs:  # after every other route: the document describes them
            described = openapi.document(self.settings.part(Access), self.catalog, app.routes)
            routes.extend(docs_page.routes(described))

    def _add_middlewares(self, admission: Admission) -> None:
        """Outermost first: the request's id and trace, count every answer, check keys, then admit inference
        requests."""
        self.app.add_middleware(AdmissionMiddleware, admission=admission, settings=self.settings)
        self.app.add_middleware(ApiKeyMiddleware, access=self.settings.part(Access), keys=self.keys)
        self.app.add_middleware(telemetry.MetricsMiddleware, model_of=self._model_label)
        self.app.add_middleware(tracing.RequestMiddleware, model_of=self._model_label)

    def _model_label(self, path: str) -> str:
        """The model label of a request's path: the model whose route it is, or ""."""
        model = self.catalog.by_path.get(path)
        if model is not None:
            return model.name
        name = telemetry.v2_model_name(path)
        return self.models.label(name) if name is not None else ""

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Any) -> AsyncIterator[None]:
        """One front end's start: its access log and tracing, its dispatcher (requests and answers on its event loop),
        its decoding threads on a few heap arenas; the first one also serves gRPC (--grpc-port) on its event loop,
        until it stops."""
        tracing.start(self.settings.access_log)
        heap.few_arenas()
        self.state.serve_as(self.index)
        self.inference.dispatcher.start(self.index, self.requests, self.answers.receiver(self.index))
        if self.index != 0 or self.grpc_servicer is None:
            yield
            return
        grpc_server = await grpc_service.start(self.grpc_servicer, self.settings)
        self.state.serve_grpc(True)  # ready waits for it: another front end may answer /health/ready first
        try:
            yield
        finally:
            self.state.serve_grpc(False)
            await grpc_server.stop(grpc_service.GRACE_S)
