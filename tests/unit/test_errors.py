"""The error envelope for what no route answers itself: unexpected exceptions and Starlette's HTTP errors."""

from __future__ import annotations

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.routing import Route
from starlette.testclient import TestClient

from imgserve.errors import install_handlers


async def boom(request: Request) -> None:
    raise RuntimeError("a bug")


def test_an_unexpected_exception_is_a_json_500_that_closes_the_connection() -> None:
    app = Starlette(routes=[Route("/boom", boom)])
    install_handlers(app)
    with TestClient(app, raise_server_exceptions=False) as client:
        response = client.get("/boom")
        assert (response.status_code, response.json()["error"]["code"]) == (500, "internal_error")
        assert response.headers["connection"] == "close"
        missing = client.post("/nowhere")
        assert (missing.status_code, missing.json()["error"]["code"]) == (404, "not_found")
