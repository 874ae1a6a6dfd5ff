"""API keys against a real server: Bearer and X-API-Key, several keys, a key file that rotates, open health routes;
keys fail closed (a key source without a key stops the start; a key file that breaks later keeps the keys)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import tritonclient.grpc as grpcclient
from serving import Server, image_bytes, running_server, start_server, stop_server, wait_until
from tritonclient.utils import InferenceServerException

from imgserve.testing import free_port

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


def _predict_code(server: Server, key: str | None = None) -> int:
    return predict(server, {} if key is None else {"X-API-Key": key}).status_code


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
    """Every front end re-reads the file on its own clock, so the swap is checked on a run of fresh connections."""
    key_file.write_text("rotated\n")
    wait_until(lambda: _swapped(server, "from-file", "rotated"), 20, "the rotated key file in force on every front end")
    assert predict(server, {"X-API-Key": "old-key"}).status_code == 200


def _swapped(server: Server, old: str, new: str) -> bool:
    """Whether 12 requests in a row, each on a new connection, find the new key in force and the old one gone."""
    return all(_predict_code(server, old) == 401 and _predict_code(server, new) == 200 for _ in range(12))


def test_metrics_info_and_statistics_can_be_protected(tmp_path: Path) -> None:
    """--protect-metrics guards /metrics, /info and the v2 statistics over HTTP and gRPC (they tell the same traffic);
    health and metadata stay open."""
    with running_server(tmp_path, api_key="k", protect_metrics="true", grpc_port=free_port()) as server:
        for path in ("/metrics", "/info", "/v2/models/stats", "/v2/models/denoiser/versions/1/stats"):
            assert httpx.get(f"{server.url}{path}").status_code == 401
            assert httpx.get(f"{server.url}{path}", headers={"Authorization": "Bearer k"}).status_code == 200
        assert httpx.get(f"{server.url}/health/ready").status_code == 200
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
        with pytest.raises(InferenceServerException, match="UNAUTHENTICATED"):
            client.get_inference_statistics("denoiser")
        statistics = client.get_inference_statistics("denoiser", headers={"authorization": "Bearer k"})
        assert [entry.name for entry in statistics.model_stats] == ["denoiser"]
        assert client.get_model_metadata("denoiser").name == "denoiser"


def test_a_missing_key_file_stops_the_server_with_a_clear_error(tmp_path: Path) -> None:
    server = start_server({"api_key_file": str(tmp_path / "absent")}, tmp_path)
    try:
        assert server.process.wait(timeout=60) == 2
    finally:
        stop_server(server)
    assert "cannot read --api-key-file" in server.log() and "Traceback" not in server.log()


def _fifo(path: Path) -> None:
    os.mkfifo(path)


@pytest.mark.parametrize(
    ("setting", "make", "message"),
    [
        ("api_key_file", lambda path: path.write_text(""), "holds no key"),
        ("api_key_file", lambda path: path.write_text("  \n\t\n\n"), "holds no key"),
        ("api_key_file", _fifo, "not a regular file"),
        ("api_key_file", Path.mkdir, "not a regular file"),
        ("api_key_file", lambda path: path.write_text("k" * 70_000), "larger than 64 KiB"),
        ("api_key", None, "--api-key holds no key"),
    ],
    ids=["empty file", "blank file", "fifo", "directory", "too large", "key list without a key"],
)
def test_a_key_source_without_a_key_stops_the_start_in_one_line(tmp_path: Path, setting, make, message) -> None:
    """Keys fail closed: a key source that is set and yields no key is exit 2, never a server without keys."""
    path = tmp_path / "api-key"
    if make is not None:
        make(path)
    server = start_server({setting: str(path) if make else ","}, tmp_path)
    try:
        assert server.process.wait(timeout=60) == 2
    finally:
        stop_server(server)
    lines = [line for line in server.log().splitlines() if line.strip()]
    assert len(lines) == 1 and "imgserve: " in lines[0] and message in lines[0], lines


def test_a_key_file_that_breaks_while_serving_keeps_its_keys(tmp_path: Path) -> None:
    """Truncated, then swapped for a FIFO: the keys in force stay (no key 401, the old key 200), each change is one
    warning and one imgserve_api_key_reload_failures_total, and the FIFO never blocks a front end."""
    path = tmp_path / "api-key"
    path.write_text("k1\n")
    with running_server(tmp_path, api_key_file=str(path)) as server:
        assert (_predict_code(server), _predict_code(server, "k1")) == (401, 200)
        failures = "imgserve_api_key_reload_failures_total"
        assert server.metric(failures) == 0
        for broken in (lambda: path.write_text(""), lambda: (path.unlink(), os.mkfifo(path))):
            before = server.metric(failures)
            broken()
            wait_until(lambda before=before: server.metric(failures) > before, 10, "the broken key file was noticed")
            started = time.monotonic()
            assert httpx.get(f"{server.url}/health/live", timeout=5).status_code == 200
            assert time.monotonic() - started < 1
            for _ in range(4):  # every front end
                assert (_predict_code(server), _predict_code(server, "k1")) == (401, 200)
        time.sleep(2.5)  # a file that stays broken is not warned about again
        warnings = [line for line in server.log().splitlines() if "keeping the 1 keys in force" in line]
        assert len(warnings) == server.metric(failures) >= 2, warnings
        path.unlink()
        path.write_text("k2\n")
        wait_until(lambda: _swapped(server, "k1", "k2"), 10, "the repaired key file in force on every front end")


def test_a_front_end_started_after_a_rotation_and_a_break_has_the_latest_keys(tmp_path: Path) -> None:
    """Rotated from k1 to k2, then broken: a front end that replaces a dead one starts from k2 (never from the keys
    read at start) and does not warn again about the file it finds as the others left it."""
    path = tmp_path / "api-key"
    path.write_text("k1\n")
    with running_server(tmp_path, api_key_file=str(path), api_servers=1) as server:
        path.write_text("k2\n")
        wait_until(lambda: _predict_code(server, "k2") == 200, 10, "the rotated key was read")
        path.write_text("")
        failures = "imgserve_api_key_reload_failures_total"
        wait_until(lambda: server.metric(failures) == 1, 10, "the broken key file was noticed")
        time.sleep(1.5)  # the main process has read it too
        [front_end] = server.front_end_pids().values()
        os.kill(front_end, signal.SIGKILL)
        wait_until(
            lambda: server.front_end_pids() and front_end not in server.front_end_pids().values(), 10, "replaced"
        )
        assert (_predict_code(server, "k1"), _predict_code(server, "k2")) == (401, 200)
        time.sleep(1.5)
        assert server.metric(failures) == 1
        assert len([line for line in server.log().splitlines() if "keeping the 1 keys in force" in line]) == 1
