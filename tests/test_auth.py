"""API keys against a real server: Bearer and X-API-Key, several keys, a key file that rotates, open health routes."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from serving import Server, image_bytes, running_server, start_server, stop_server

PNG = {"Content-Type": "image/png"}
GOOD = image_bytes(16, 16)


@pytest.fixture(scope="module")
def key_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("secret") / "api-key"
    path.write_text("from-file\n\n")
    return path


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, key_file: Path) -> Iterator[Server]:
    with running_server(
        tmp_path_factory.mktemp("logs"), api_key="old-key, new-key", api_key_file=str(key_file)
    ) as running:
        yield running


def predict(server: Server, headers: dict[str, str], client: httpx.Client | None = None) -> httpx.Response:
    return (client or httpx).post(f"{server.url}/predict", content=GOOD, headers={**PNG, **headers}, timeout=30)


@pytest.mark.parametrize(
    "headers",
    [{}, {"Authorization": "Bearer wrong"}, {"X-API-Key": "wrong"}, {"Authorization": "Basic b2xkLWtleQ=="}],
    ids=["none", "wrong bearer", "wrong x-api-key", "basic"],
)
def test_predict_without_a_valid_key_is_401(server: Server, headers: dict[str, str]) -> None:
    response = predict(server, headers)
    assert (response.status_code, response.json()["error"]["code"]) == (401, "unauthorized")
    assert response.headers["www-authenticate"] == "Bearer"


@pytest.mark.parametrize("key", ["old-key", "new-key", "from-file"])
def test_every_configured_key_works_both_ways(server: Server, key: str) -> None:
    assert predict(server, {"Authorization": f"Bearer {key}"}).status_code == 200
    assert predict(server, {"X-API-Key": key}).status_code == 200
    response = httpx.post(f"{server.url}/v1/images:predict", content=GOOD, headers=PNG)
    assert response.status_code == 401


def test_health_metrics_and_info_stay_open_by_default(server: Server) -> None:
    for path in ("/health/live", "/health/ready", "/health", "/metrics", "/info"):
        assert httpx.get(f"{server.url}{path}").status_code == 200, path
    assert "key" not in httpx.get(f"{server.url}/info").text


def test_a_refused_upload_does_not_break_the_keep_alive_connection(server: Server) -> None:
    with httpx.Client() as client:
        assert predict(server, {}, client).status_code == 401
        assert predict(server, {"X-API-Key": "new-key"}, client).status_code == 200


def test_a_rotated_key_file_is_picked_up(server: Server, key_file: Path) -> None:
    key_file.write_text("rotated\n")
    deadline = time.monotonic() + 20
    while predict(server, {"X-API-Key": "rotated"}).status_code != 200:
        assert time.monotonic() < deadline, "the new key in the file was never accepted"
        time.sleep(0.5)
    assert predict(server, {"X-API-Key": "from-file"}).status_code == 401
    assert predict(server, {"X-API-Key": "old-key"}).status_code == 200


def test_metrics_and_info_can_be_protected(tmp_path: Path) -> None:
    with running_server(tmp_path, api_key="k", protect_metrics="true") as server:
        for path in ("/metrics", "/info"):
            assert httpx.get(f"{server.url}{path}").status_code == 401
            assert httpx.get(f"{server.url}{path}", headers={"Authorization": "Bearer k"}).status_code == 200
        assert httpx.get(f"{server.url}/health/ready").status_code == 200


def test_a_missing_key_file_stops_the_server_with_a_clear_error(tmp_path: Path) -> None:
    server = start_server({"api_key_file": str(tmp_path / "absent")}, tmp_path)
    try:
        assert server.process.wait(timeout=60) == 2
    finally:
        stop_server(server)
    assert "cannot read --api-key-file" in server.log() and "Traceback" not in server.log()
