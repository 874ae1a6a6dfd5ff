"""GET /openapi.json (the document frontend/openapi.py wrote at start) and GET /docs, Swagger UI over it, from the
Swagger UI files that the swagger-ui-py package ships, served under /docs/assets: no CDN, so the page renders on a
cluster without internet."""

from __future__ import annotations

import json
from importlib.resources import files
from typing import Any

from fastapi.openapi.docs import get_swagger_ui_html
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles

from imgserve.frontend.telemetry import DOCS_ASSETS, DOCS_PATHS

OPENAPI_PATH, DOCS_PATH = DOCS_PATHS[1], DOCS_PATHS[0]


def routes(described: dict[str, Any]) -> list[BaseRoute]:
    """GET /openapi.json (`described`), GET /docs (Swagger UI's page over it) and Swagger UI's files."""
    body = json.dumps(described).encode()
    page = get_swagger_ui_html(
        openapi_url=OPENAPI_PATH,
        title=described["info"]["title"],
        swagger_js_url=f"{DOCS_ASSETS}/swagger-ui-bundle.js",
        swagger_css_url=f"{DOCS_ASSETS}/swagger-ui.css",
        swagger_favicon_url=f"{DOCS_ASSETS}/favicon-32x32.png",
        swagger_ui_parameters={"validatorUrl": None},  # Swagger UI would send the document to an online validator
    ).body

    async def openapi_json(request: Request) -> Response:
        return Response(body, media_type="application/json")

    async def docs(request: Request) -> Response:
        return HTMLResponse(page)

    return [
        Route(OPENAPI_PATH, openapi_json, methods=["GET"]),
        Route(DOCS_PATH, docs, methods=["GET"]),
        Mount(DOCS_ASSETS, app=StaticFiles(directory=str(files("swagger_ui") / "static"))),
    ]
