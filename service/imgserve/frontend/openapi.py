"""The OpenAPI 3.1 document of what this server serves (GET /openapi.json; frontend/docs_page.py serves it and
Swagger UI over it).

imgserve's own routes are plain Starlette routes: each is described here as a FastAPI route on an endpoint that
never runs, typed as the real route reads and answers (a plain LitAPI's route is FastAPI's already). FastAPI's
`get_openapi` writes the document from them once, at start; the front ends answer it as bytes.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal

from fastapi import File, Form, Header, Path, Query, UploadFile
from fastapi.openapi.utils import get_openapi
from fastapi.routing import APIRoute
from pydantic import BaseModel, Field, RootModel
from starlette.responses import PlainTextResponse
from starlette.routing import BaseRoute

from imgserve.api import ImageAPI
from imgserve.config import Access
from imgserve.errors import ApiError
from imgserve.frontend.auth import guarded_routes
from imgserve.frontend.telemetry import route
from imgserve.frontend.v2 import schemas as v2
from imgserve.frontend.v2.http import HEADER_LENGTH
from imgserve.frontend.v2.http import NOT_READY as V2_NOT_READY
from imgserve.frontend.v2.model import VERSION
from imgserve.litapi import LitServeAPI
from imgserve.models.loader import ModelLoadError
from imgserve.served import Catalog, ServedModel
from imgserve.version import __version__

TAGS = [
    {"name": "predict", "description": "Send an image, get the model's answer."},
    {"name": "health", "description": "Liveness, readiness, what runs, its metrics."},
    {"name": "v2", "description": "The Open Inference Protocol (KServe v2, Triton's HTTP/REST API)."},
]
RETRY_AFTER = {"Retry-After": {"description": "Seconds to wait before trying again", "schema": {"type": "integer"}}}
SECURITY_SCHEMES = {
    "bearer": {"type": "http", "scheme": "bearer", "description": "Authorization: Bearer <key>"},
    "apiKey": {"type": "apiKey", "in": "header", "name": "X-API-Key"},
}

PREDICT_ERRORS: dict[int | str, str] = {
    400: "Not a readable image (empty, corrupt, not an image), or a malformed body",
    408: "The request's headers or body came too slowly",
    413: "A body over max_body_bytes, or an image over max_image_pixels",
    415: "Neither multipart/form-data nor an image/* body, or an image format that is not read",
    422: "No `file` field, a bad field or query parameter, or a bad X-Request-Timeout",
    500: "The model or the API failed on this request (the rest of its batch is answered)",
    503: "Shed (queue full, draining, out of memory, a worker lost): try again after Retry-After seconds",
    504: "The request's deadline passed; work not yet started never reaches the model",
}
V2_ERRORS = {
    400: "A request the protocol cannot read, or inputs that do not fit the model's",
    404: "No such model or version",
    413: "A body over max_body_bytes, or more images than the server holds",
    415: "A Content-Encoding other than gzip or deflate, or an image format that is not read",
    422: "A bad `timeout` parameter or X-Request-Timeout",
    500: "The model or the API failed on this request",
    503: PREDICT_ERRORS[503],
    504: PREDICT_ERRORS[504],
}
HOOK_ERROR = "An ApiError that the API's hooks raise: its status (e.g. 429 with Retry-After)"
LITSERVE_ERRORS = {
    400: "A body that is neither JSON nor a form",
    413: "A body over max_body_bytes",
    **{s: PREDICT_ERRORS[s] for s in (408, 503, 504)},
}


class ErrorDetail(BaseModel):
    code: str = Field(description="What went wrong, for programs: queue_full, deadline, corrupt_image, ...")
    message: str = Field(description="What went wrong, in one line")


class Error(BaseModel):
    """The body of every error of imgserve's own routes."""

    error: ErrorDetail


class Detail(BaseModel):
    """The body of an error that a plain LitAPI's hooks raise (FastAPI's HTTPException, as LitServe answers it)."""

    detail: Any


class LitServeError(RootModel[Error | Detail]):
    """An error of a plain LitAPI's route: imgserve's envelope where admission or the connection refused it, else
    FastAPI's {"detail": ...} as LitServe answers."""


class Health(BaseModel):
    status: Literal["alive", "ready", "not ready"]
    reason: str | None = Field(None, description="Why not ready: model loading, draining, worker restarting, ...")


def _param(name: str, annotation: Any, default: Any = inspect.Parameter.empty) -> inspect.Parameter:
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=annotation, default=default)


class Describer:
    """Each route this server serves as a FastAPI route that describes it: what it reads, what it answers (its
    errors in its protocol's envelope) and, where API keys guard it, the keys it takes."""

    def __init__(self, access: Access) -> None:
        self.keys = access.api_key is not None or bool(access.api_key_file)
        self.guarded = guarded_routes(access)

    def route(
        self,
        path: str,
        method: str,
        name: str,
        tag: str,
        parameters: Sequence[inspect.Parameter] = (),
        body: dict[str, Any] | None = None,
        **options: Any,
    ) -> APIRoute:
        """A route whose endpoint takes `parameters` and never runs (imgserve's own route answers); `body`: more
        media types of the request body than FastAPI writes from the parameters."""

        async def endpoint() -> None:
            """Never called."""

        endpoint.__signature__ = inspect.Signature(list(parameters))  # type: ignore[attr-defined]  # FastAPI reads it
        options.update(self._common(path, tag, options.pop("responses", {}), body))
        return APIRoute(path, endpoint, methods=[method], name=name, **options)

    def _common(
        self, path: str, tag: str, answers: dict[int | str, Any], body: dict[str, Any] | None
    ) -> dict[str, Any]:
        """Its tag, its answers with 401 where a key is needed, and the key schemes and request body FastAPI lacks."""
        answers, extra = dict(answers), dict[str, Any]()
        if self.keys and route(path) in self.guarded:
            answers[401] = self.error(path, "No valid API key: send Authorization: Bearer <key> or X-API-Key: <key>")
            extra["security"] = [{scheme: []} for scheme in SECURITY_SCHEMES]
        if body:
            extra["requestBody"] = {"content": body}
        return {"tags": [tag], "responses": answers, "openapi_extra": extra or None}

    def errors(self, path: str, statuses: Mapping[Any, str], body: Any = None) -> dict[int | str, Any]:
        return {status: self.error(path, text, status, body) for status, text in statuses.items()}

    def error(self, path: str, description: str, status: int | str = 0, body: Any = None) -> dict[str, Any]:
        """One error answer: `body`, by default the envelope of the protocol `path` belongs to."""
        body = body or (v2.ProtocolError if path.startswith("/v2") else Error)
        retry = {"headers": RETRY_AFTER} if status in (503, "default") else {}
        return {"model": body, "description": description, **retry}

    def predict(self, model: ServedModel, app_routes: Sequence[BaseRoute]) -> list[APIRoute]:
        """POST at the paths of a model whose API is an ImageAPI; a plain LitAPI's route, as FastAPI describes it."""
        api = model.api
        if isinstance(api, LitServeAPI):
            found = [route for route in app_routes if isinstance(route, APIRoute) and route.path == api.api_path]
            return [self._litserve(api, route) for route in found]
        statuses = {**PREDICT_ERRORS, "default": HOOK_ERROR}
        return [
            self.route(
                path,
                "POST",
                f"predict_{model.name}",
                "predict",
                self._predict_parameters(api),
                IMAGE_BODY,
                summary=f"Run {model.name} on one image",
                description=self._predict_text(api),
                responses={200: self._predict_answer(api), **self.errors(path, statuses)},
            )
            for path in model.paths
        ]

    def _predict_parameters(self, api: ImageAPI) -> list[inspect.Parameter]:
        """The multipart `file`, the fields the API reads (its `request_model`, from the query string or the form)
        and the deadline."""
        upload = "The image; or send it as the whole body, with an image/* Content-Type"
        found = [_param("file", Annotated[UploadFile, File(description=upload)])]
        if (fields := request_model(api)) is not None:
            found += [_param("fields", Annotated[fields, Form()]), _param("query", Annotated[fields, Query()])]
        timeout = "This request's deadline in seconds (default request_timeout_s, at most max_request_timeout_s)"
        header = Header(alias="X-Request-Timeout", description=timeout)
        return [*found, _param("timeout", Annotated[float | None, header], None)]

    def _predict_text(self, api: ImageAPI) -> str:
        """The API's docstring, else what its encode_response answers; and where its fields go."""
        text = inspect.cleandoc(type(api).__doc__ or "").partition("\n\n")[0].replace("\n", " ")
        text = text or f"What `{type(api).__qualname__}.encode_response` answers."
        if request_model(api) is not None:
            text += " Its fields go in the query string, or with a multipart upload in the form."
        return text

    def _predict_answer(self, api: ImageAPI) -> dict[str, Any]:
        """The media types the API says it answers with (`response_types`)."""
        content = {kind: {"schema": {} if kind == "application/json" else binary(kind)} for kind in api.response_types}
        return {"description": "The API's answer", "content": content}

    def _litserve(self, api: LitServeAPI, found: APIRoute) -> APIRoute:
        """A plain LitAPI's route as FastAPI describes it, with the answers imgserve adds around it."""
        answers = self.errors(found.path, LITSERVE_ERRORS, LitServeError)
        return APIRoute(
            found.path,
            found.endpoint,
            methods=sorted(found.methods or ()),
            name=found.name,
            response_model=found.response_model,
            summary=f"{type(api.lit).__qualname__}: the API's predict route",
            **self._common(found.path, "predict", answers, None),
        )

    def health(self) -> list[APIRoute]:
        """The health routes, /info and /metrics."""
        not_ready = {503: {"model": Health, "description": "Not ready: `reason` says why"}}
        ready: dict[str, Any] = {
            "summary": "Can it take requests now?",
            "response_model": Health,
            "responses": not_ready,
        }
        return [
            self.route("/health/live", "GET", "live", "health", summary="Is the process up?", response_model=Health),
            self.route("/health/ready", "GET", "ready", "health", **ready),
            self.route("/health", "GET", "health", "health", **ready),
            self.route(
                "/info",
                "GET",
                "info",
                "health",
                summary="What runs: model, device, workers, batch limits, version",
                response_model=dict[str, Any],
            ),
            self.route(
                "/metrics", "GET", "metrics", "health", summary="Prometheus metrics", response_class=PlainTextResponse
            ),
        ]

    def v2(self, models: Sequence[ServedModel]) -> list[APIRoute]:
        """The Open Inference Protocol's routes for the `models`, with and without their version."""
        not_ready = {V2_NOT_READY: {"model": v2.Ready, "description": "Not ready: `error` says why"}}
        found = [
            self.route("/v2", "GET", "server_metadata", "v2", response_model=v2.ServerMetadata),
            self.route("/v2/health/live", "GET", "server_live", "v2", response_model=v2.Live),
            self.route("/v2/health/ready", "GET", "server_ready", "v2", response_model=v2.Ready, responses=not_ready),
            self.route("/v2/models/stats", "GET", "statistics", "v2", response_model=v2.Statistics),
        ]
        named = Path(description="The model's name", json_schema_extra={"enum": [model.name for model in models]})
        model = _param("model", Annotated[str, named])
        version = _param("version", Annotated[str, Path(json_schema_extra={"enum": [VERSION]})])
        tensors = _tensors_text(models)
        found += self._v2_model("/v2/models/{model}", [model], "", tensors)
        found += self._v2_model("/v2/models/{model}/versions/{version}", [model, version], "_version", tensors)
        return found

    def _v2_model(self, base: str, parameters: list[inspect.Parameter], suffix: str, tensors: str) -> list[APIRoute]:
        """A model's metadata, readiness, configuration and inference at `base`."""
        missing = self.errors(base, {404: V2_ERRORS[404]})
        not_ready = {V2_NOT_READY: {"model": v2.ModelReady, "description": "Not ready: `error` says why"}}
        header = "The length of the JSON header when tensors' bytes follow it (0: the body is the first input's item)"
        length = _param("header_length", Annotated[int | None, Header(alias=HEADER_LENGTH, description=header)], None)
        infer, raw = f"{base}/infer", {"application/octet-stream": {"schema": binary()}}
        return [
            self.route(
                base,
                "GET",
                f"model_metadata{suffix}",
                "v2",
                parameters,
                response_model=v2.ModelMetadata,
                responses=missing,
            ),
            self.route(
                f"{base}/ready",
                "GET",
                f"model_ready{suffix}",
                "v2",
                parameters,
                response_model=v2.ModelReady,
                responses={**missing, **not_ready},
            ),
            self.route(
                f"{base}/config",
                "GET",
                f"model_config{suffix}",
                "v2",
                parameters,
                response_model=v2.ModelConfig,
                responses=missing,
            ),
            self.route(
                f"{base}/stats", "GET", f"model_statistics{suffix}", "v2", parameters, response_model=v2.Statistics
            ),
            self.route(
                infer,
                "POST",
                f"model_infer{suffix}",
                "v2",
                [*parameters, _param("request", v2.InferRequest), length],
                raw,
                summary="Run the model on a batch of tensors",
                description=tensors,
                response_model=v2.InferResponse,
                responses={200: {"content": raw}, **self.errors(infer, V2_ERRORS)},
            ),
        ]


def _tensors_text(models: Sequence[ServedModel]) -> str:
    """Each model's tensors (the built-in API's outputs are known after its warm-up: GET /v2/models/{model})."""

    def listed(specs: Sequence[Any]) -> str:
        return ", ".join(f"`{spec.name}` {spec.datatype} {[-1, *spec.dims]}" for spec in specs)

    described = []
    for model in models:
        try:
            outputs = listed(model.api.outputs)
        except ApiError:
            outputs = "those of its output kind, decided as it starts (GET /v2/models/{model})"
        described.append(f"`{model.name}` takes {listed(model.api.inputs)} and answers {outputs}")
    return (
        f"{'; '.join(described)}. With `{HEADER_LENGTH}`, the body is the JSON request followed by the bytes of the "
        "tensors it marks with `binary_data_size`; outputs asked for with `binary_data` follow the JSON answer the "
        "same way."
    )


def binary(media_type: str = "application/octet-stream") -> dict[str, str]:
    """The schema of a body of bytes."""
    return {"type": "string", "contentMediaType": media_type}


IMAGE_BODY = {kind: {"schema": binary(kind)} for kind in ("image/*", "application/octet-stream")}


def request_model(api: Any) -> type[BaseModel] | None:
    """The API's `request_model`, checked: a pydantic model class, or None."""
    found = getattr(api, "request_model", None)
    if found is not None and not (isinstance(found, type) and issubclass(found, BaseModel)):
        name = type(api).__qualname__
        raise ModelLoadError(f"{name}.request_model is {found!r}: give a pydantic BaseModel subclass (or None)")
    return found


def document(access: Access, catalog: Catalog, app_routes: Sequence[BaseRoute]) -> dict[str, Any]:
    """The OpenAPI document of the `catalog`'s models as this server serves them: each model's predict route (a plain
    LitAPI's from `app_routes`), health, /info, /metrics and the Open Inference Protocol's routes of the models that
    have them. ModelLoadError when an API's declarations cannot be described."""
    describer = Describer(access)
    routes = [route for model in catalog for route in describer.predict(model, app_routes)] + describer.health()
    v2_models = [model for model in catalog if not isinstance(model.api, LitServeAPI)]
    if v2_models:
        routes += describer.v2(v2_models)
    if len(catalog) == 1:
        title, text = catalog[0].api.describe(), inspect.cleandoc(type(catalog[0].api).__doc__ or "")
    else:
        title, text = f"{len(catalog)} models", "; ".join(f"{model.name}: {model.api.describe()}" for model in catalog)
    try:
        found = get_openapi(
            title=f"imgserve: {title}",
            version=__version__,
            description=text or None,
            routes=routes,
            tags=TAGS if v2_models else TAGS[:2],
        )
    except Exception as exc:  # a request_model or response type pydantic cannot write a schema for
        raise ModelLoadError(f"cannot describe the API in /openapi.json ({exc}); --no-docs serves it without") from exc
    if describer.keys:
        found.setdefault("components", {})["securitySchemes"] = SECURITY_SCHEMES
    _tidy(found, {described.path for described in app_routes if isinstance(described, APIRoute)})
    return found


def _tidy(found: dict[str, Any], fastapi_paths: set[str]) -> None:
    """FastAPI gives every route with parameters its own 422 answer (HTTPValidationError): only the routes FastAPI
    serves (`fastapi_paths`) answer it. Each route's answers are listed by status."""
    for path, operations in found["paths"].items():
        for operation in operations.values():
            answers = operation["responses"]
            if path not in fastapi_paths and "/HTTPValidationError" in json.dumps(answers.get("422", {})):
                del answers["422"]
            operation["responses"] = dict(sorted(answers.items(), key=lambda item: (item[0] == "default", item[0])))
    schemas = found.get("components", {}).get("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):  # unused now, or a user's model of the same name
        if f'/{name}"' not in json.dumps(found["paths"]) + json.dumps({k: v for k, v in schemas.items() if k != name}):
            schemas.pop(name, None)
