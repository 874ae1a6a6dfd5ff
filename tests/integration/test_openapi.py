"""/openapi.json and /docs on real servers: the document validates as OpenAPI 3.1 and describes what the server
serves (the built-in API's query parameters, a user API's declared fields, a plain LitAPI's own route, the errors,
health and Open Inference Protocol routes); Swagger UI renders it in a real headless browser from the server's own
files; --no-docs turns both off; --protect-metrics puts them behind the API key."""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from openapi_spec_validator import validate
from serving import Server, image_bytes, running_server, start_server, stop_server

KEY = "docs-test-key"
V2_ROUTES = ["/v2", "/v2/health/live", "/v2/health/ready", "/v2/models/stats"] + [
    f"{base}{tail}"
    for base in ("/v2/models/{model}", "/v2/models/{model}/versions/{version}")
    for tail in ("", "/ready", "/config", "/stats", "/infer")
]
HEALTH_ROUTES = ["/health/live", "/health/ready", "/health", "/info", "/metrics"]


@pytest.fixture(scope="module")
def builtin(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The built-in denoiser with an API key (the docs stay open without --protect-metrics)."""
    with running_server(tmp_path_factory.mktemp("logs"), api_key=KEY) as running:
        yield running


def described(server: Server, **headers: str) -> dict[str, Any]:
    """The server's OpenAPI document, checked against the OpenAPI 3.1 schema."""
    answer = httpx.get(f"{server.url}/openapi.json", headers=headers, timeout=10)
    assert answer.status_code == 200 and answer.headers["content-type"] == "application/json", answer.text
    document = answer.json()
    validate(document)
    assert document["openapi"].startswith("3.1")
    return document


def parameters(operation: dict[str, Any], where: str) -> dict[str, dict[str, Any]]:
    return {parameter["name"]: parameter for parameter in operation.get("parameters", []) if parameter["in"] == where}


def schema(document: dict[str, Any], reference: dict[str, Any]) -> dict[str, Any]:
    return document["components"]["schemas"][reference["$ref"].rpartition("/")[2]]


def test_the_builtin_api_is_described_with_its_parameters_errors_health_and_v2_routes(builtin: Server) -> None:
    document = described(builtin)
    assert set(document["paths"]) == {"/predict", "/v1/images:predict", *HEALTH_ROUTES, *V2_ROUTES}
    predict = document["paths"]["/predict"]["post"]
    query = parameters(predict, "query")
    assert set(query) == {"format", "quality", "top_k", "score_threshold"}
    assert query["format"]["schema"]["anyOf"][0]["enum"] == ["jpeg", "png", "webp", "json"]
    assert (query["top_k"]["schema"]["minimum"], query["top_k"]["schema"]["maximum"]) == (1, 1000)
    assert "X-Request-Timeout" in parameters(predict, "header")
    body = predict["requestBody"]["content"]
    assert {"multipart/form-data", "image/*"} <= set(body)
    assert schema(document, body["multipart/form-data"]["schema"])["required"] == ["file"]
    answers = predict["responses"]
    assert {"200", "400", "401", "413", "415", "422", "503", "504"} <= set(answers)
    assert {"image/jpeg", "image/png", "application/json"} <= set(answers["200"]["content"])
    assert "Retry-After" in answers["503"]["headers"]
    assert schema(document, answers["503"]["content"]["application/json"]["schema"])["required"] == ["error"]
    assert predict["security"] and "apiKey" in document["components"]["securitySchemes"]  # a key is configured
    assert "security" not in document["paths"]["/health/ready"]["get"]
    assert "503" in document["paths"]["/health/ready"]["get"]["responses"]
    infer = document["paths"]["/v2/models/{model}/infer"]["post"]
    assert parameters(infer, "path")["model"]["schema"]["enum"] == ["denoiser"]
    assert {"application/json", "application/octet-stream"} <= set(infer["requestBody"]["content"])
    request = schema(document, infer["requestBody"]["content"]["application/json"]["schema"])
    assert {"inputs", "outputs", "parameters", "id"} <= set(request["properties"])
    protocol_error = schema(document, infer["responses"]["400"]["content"]["application/json"]["schema"])
    assert protocol_error["properties"] == {"error": {"type": "string", "title": "Error"}}  # {"error": "message"}
    metadata = document["paths"]["/v2/models/{model}"]["get"]["responses"]
    assert "422" not in metadata and "HTTPValidationError" not in document["components"]["schemas"]


def test_docs_render_in_a_headless_browser_from_the_servers_own_files(builtin: Server, tmp_path: Path) -> None:
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        pytest.skip("chromium is not installed (`make tools` installs it where apt can)")
    page = httpx.get(f"{builtin.url}/docs", timeout=10)
    assert page.status_code == 200 and "/predict" not in page.text  # the routes come from the rendering
    assets = re.findall(r'(?:src|href)="([^"]+)"', page.text)
    assert assets and all(asset.startswith("/docs/assets/") for asset in assets), assets  # no CDN
    served_before = builtin.metric("imgserve_requests_total", route="/docs/assets", code="200")
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"]
    flags += ["--disable-component-update", "--no-first-run", f"--user-data-dir={tmp_path / 'profile'}"]
    command = [browser, *flags, "--virtual-time-budget=15000", "--dump-dom", f"{builtin.url}/docs"]
    dom = subprocess.run(command, capture_output=True, text=True, timeout=120, check=True).stdout
    rendered = set(re.findall(r'data-path="([^"]+)"', dom))  # each operation Swagger UI drew
    assert {"/predict", "/v2/models/{model}/infer", "/health/ready"} <= rendered, dom[-2000:]
    assert "Failed to load API definition" not in dom
    assert builtin.metric("imgserve_requests_total", route="/docs/assets", code="200") >= served_before + 2


def test_docs_stay_open_without_protect_metrics_and_are_labelled_in_the_metrics(builtin: Server) -> None:
    for path in ("/docs", "/openapi.json", "/docs/assets/swagger-ui.css"):
        assert httpx.get(f"{builtin.url}{path}", timeout=10).status_code == 200, path
    missing = httpx.get(f"{builtin.url}/docs/assets/nothing.js", timeout=10)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    for label in ("/docs", "/openapi.json", "/docs/assets"):
        assert builtin.metric("imgserve_requests_total", route=label) > 0, label
    assert httpx.post(f"{builtin.url}/predict", timeout=10).status_code == 401  # the key still guards /predict


def test_a_user_apis_declared_fields_are_described_and_read(tmp_path: Path) -> None:
    with running_server(tmp_path, api="openapi_apis:Brightness") as server:
        document = described(server)
        assert document["info"]["description"] == "The share of an image's pixels brighter than a threshold."
        predict = document["paths"]["/predict"]["post"]
        query = parameters(predict, "query")
        assert set(query) == {"threshold", "channel"}
        assert query["threshold"]["description"] == "How bright a pixel must be to count (0-1)"
        assert query["threshold"]["schema"]["maximum"] == 1
        form = schema(document, predict["requestBody"]["content"]["multipart/form-data"]["schema"])
        declared = schema(document, form["allOf"][0])
        assert set(declared["properties"]) == {"threshold", "channel"} and "file" in form["properties"]
        assert "default" in predict["responses"] and "security" not in predict  # no key configured
        infer = document["paths"]["/v2/models/{model}/infer"]["post"]
        assert parameters(infer, "path")["model"]["schema"]["enum"] == ["Brightness"]
        assert "`image` BYTES [-1, 1]" in infer["description"]
        image = image_bytes(32, 32)
        answer = httpx.post(f"{server.url}/predict?threshold=0.99", files={"file": ("a.png", image)}, timeout=30)
        assert answer.status_code == 200 and 0 <= answer.json()["bright"] < 0.5, answer.text
        bad = httpx.post(f"{server.url}/predict", data={"threshold": "2"}, files={"file": ("a.png", image)}, timeout=30)
        assert bad.status_code == 422 and bad.json()["error"]["code"] == "bad_fields"


def test_a_plain_litapis_own_route_is_described_and_protect_metrics_guards_the_docs(tmp_path: Path) -> None:
    with running_server(tmp_path, api="openapi_apis:Lengths", api_key=KEY, protect_metrics=True) as server:
        for path in ("/docs", "/openapi.json"):
            refused = httpx.get(f"{server.url}{path}", timeout=10)
            assert refused.status_code == 401 and refused.headers["www-authenticate"] == "Bearer", path
        assert httpx.get(f"{server.url}/docs", headers={"X-API-Key": KEY}, timeout=10).status_code == 200
        document = described(server, Authorization=f"Bearer {KEY}")
        assert set(document["paths"]) == {"/predict", *HEALTH_ROUTES}  # no v2 for a plain LitAPI
        predict = document["paths"]["/predict"]["post"]
        body = schema(document, predict["requestBody"]["content"]["application/json"]["schema"])
        assert body["title"] == "Question" and body["required"] == ["text"]
        answer = schema(document, predict["responses"]["200"]["content"]["application/json"]["schema"])
        assert answer["title"] == "Answer"
        assert "422" in predict["responses"] and predict["security"]  # FastAPI validates its body
        for path in ("/predict", "/info", "/metrics"):
            assert "401" in next(iter(document["paths"][path].values()))["responses"], path
        counted = httpx.post(f"{server.url}/predict", json={"text": "four"}, headers={"X-API-Key": KEY}, timeout=30)
        assert counted.status_code == 200 and counted.json() == {"length": 4}


def test_no_docs_serves_neither(tmp_path: Path) -> None:
    with running_server(tmp_path, docs=False) as server:
        for path in ("/docs", "/openapi.json", "/docs/assets/swagger-ui-bundle.js", "/redoc"):
            answer = httpx.get(f"{server.url}{path}", timeout=10)
            assert answer.status_code == 404 and answer.json()["error"]["code"] == "not_found", path


def test_a_request_model_that_is_no_pydantic_model_stops_the_start_with_one_line(tmp_path: Path) -> None:
    server = start_server({"api": "openapi_apis:NotAModel"}, tmp_path)
    try:
        assert server.process.wait(timeout=120) == 2, server.log_tail()
        last = server.log().strip().splitlines()[-1]
        assert last.endswith(
            "NotAModel.request_model is {'threshold': <class 'float'>}: give a pydantic BaseModel subclass (or None)"
        ), last
        assert "Traceback" not in server.log()
    finally:
        stop_server(server)
