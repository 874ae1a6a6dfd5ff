"""Hostile Open Inference Protocol bodies against a real server with ONE front end: small compressed bodies that
inflate to millions of BYTES elements never stall that front end's event loop (its health probe keeps answering
within 100 ms) and get a 4xx; malformed header lengths, deep nesting and non-integers in integer data get 400 JSON."""

from __future__ import annotations

import gzip
import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from serving import Server, image_bytes, running_server

INFER = "/v2/models/denoiser/infer"
ELEMENTS = 4_500_000  # zero-length BYTES elements per bomb: 13.5 MB of JSON, 18 MB of binary, 15-18 KB gzipped
HEALTH_BUDGET_S = 0.1


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """One front end (every request shares its event loop) and the default body limit (20 MiB), so a bomb inflates
    whole and only the element count can refuse it."""
    with running_server(tmp_path_factory.mktemp("logs"), api_servers=1, batch_timeout_ms=2) as running:
        assert len(running.front_end_pids()) == 1
        yield running


def json_bomb(shape: list[int]) -> bytes:
    """A JSON infer body whose BYTES input holds ELEMENTS empty strings (whatever its shape says)."""
    head = json.dumps({"name": "image", "datatype": "BYTES", "shape": shape}).encode()[:-1]
    return b'{"inputs": [' + head + b', "data": [' + b'"",' * (ELEMENTS - 1) + b'""]}]}'


def binary_bomb(shape: list[int]) -> tuple[bytes, str]:
    """A binary-tensor infer body (and its header length) whose BYTES input holds ELEMENTS zero-length elements."""
    data = bytes(4 * ELEMENTS)  # each element: a uint32 length of 0
    item = {"name": "image", "datatype": "BYTES", "shape": shape, "parameters": {"binary_data_size": len(data)}}
    header = json.dumps({"inputs": [item]}).encode()
    return header + data, str(len(header))


@pytest.fixture(scope="module")
def bombs() -> dict[str, tuple[bytes, dict[str, str]]]:
    """Gzip bombs of both HTTP encodings, with a shape that tells the truth and one that claims a single image."""
    gzipped = {"Content-Encoding": "gzip"}
    found = {}
    for suffix, shape in (("", [ELEMENTS, 1]), (", shape [1, 1]", [1, 1])):
        found[f"json{suffix}"] = (gzip.compress(json_bomb(shape), 9), gzipped)
        body, length = binary_bomb(shape)
        found[f"binary{suffix}"] = (gzip.compress(body, 9), {**gzipped, "Inference-Header-Content-Length": length})
    assert all(len(body) < 25_000 for body, _ in found.values())
    return found


class HealthProbe:
    """Polls /health/live every 10 ms on one keep-alive connection while the block runs: each answer's status and
    how long it took."""

    def __init__(self, server: Server) -> None:
        self.url, self._stop = f"{server.url}/health/live", threading.Event()
        self.statuses: list[int] = []
        self.latencies: list[float] = []
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def __enter__(self) -> HealthProbe:
        self._thread.start()
        time.sleep(0.2)
        return self

    def __exit__(self, *exc: object) -> None:
        time.sleep(0.2)
        self._stop.set()
        self._thread.join(30)

    def _poll(self) -> None:
        with httpx.Client(timeout=30) as client:
            while not self._stop.is_set():
                started = time.perf_counter()
                self.statuses.append(client.get(self.url).status_code)
                self.latencies.append(time.perf_counter() - started)
                time.sleep(0.01)


def post(server: Server, body: bytes, headers: dict[str, str]) -> httpx.Response:
    with httpx.Client(timeout=60) as client:
        return client.post(f"{server.url}{INFER}", content=body, headers=headers)


@pytest.mark.parametrize("bomb", ["json", "binary", "json, shape [1, 1]", "binary, shape [1, 1]"])
def test_a_gzip_bomb_of_empty_elements_gets_4xx_and_the_event_loop_keeps_answering(
    server: Server, bombs: dict, bomb: str
) -> None:
    body, headers = bombs[bomb]
    with HealthProbe(server) as probe, ThreadPoolExecutor(3) as pool:
        answers = list(pool.map(lambda _: post(server, body, headers), range(6)))  # three at a time, twice
    for answer in answers:
        assert answer.status_code in (400, 413), answer.text[:300]
        assert answer.headers["content-type"] == "application/json"
        assert list(answer.json()) == ["error"] and isinstance(answer.json()["error"], str)
    assert len(probe.statuses) >= 10 and set(probe.statuses) == {200}, probe.statuses
    slowest = sorted(probe.latencies)[-5:]
    # One probe may meet a scheduling hiccup of this 2-core machine (the client's own threads share it); a stalled
    # loop fails every probe during a bomb (1.1-2.7 s each before the parse moved off it).
    assert slowest[-2] < HEALTH_BUDGET_S, f"/health/live's slowest answers during the bombs (s): {slowest}"
    assert slowest[-1] < 5 * HEALTH_BUDGET_S, f"/health/live's slowest answers during the bombs (s): {slowest}"
    assert post(server, image_bytes(16, 16), {"Inference-Header-Content-Length": "0"}).status_code == 200


def nested(depth: int, leaf: str = "0") -> str:
    return "[" * depth + leaf + "]" * depth


def pixels_json(values: str, datatype: str = "UINT8") -> bytes:
    """A JSON infer body of one 1x1 pixel whose three values are `values` (JSON text, so NaN can be spelled)."""
    return b'{"inputs": [{"name": "pixels", "datatype": "%s", "shape": [1, 1, 1, 3], "data": [%s]}]}' % (
        datatype.encode(),
        values.encode(),
    )


GOOD_HEADER = json.dumps({"inputs": [{"name": "image", "datatype": "BYTES", "shape": [1, 1], "data": ["AA=="]}]})
DEEP = 3000
MALFORMED = {
    # Starlette reads header values as latin-1: these bytes arrive as the superscripts, which str.isdigit() takes
    "header length '²'": (GOOD_HEADER.encode(), {"Inference-Header-Content-Length": "²".encode("latin-1")}),
    "header length '1²'": (GOOD_HEADER.encode(), {"Inference-Header-Content-Length": "1²".encode("latin-1")}),
    "header length '¹³'": (GOOD_HEADER.encode(), {"Inference-Header-Content-Length": "¹³".encode("latin-1")}),
    "header length '١٢' (UTF-8)": (GOOD_HEADER.encode(), {"Inference-Header-Content-Length": "١٢".encode()}),
    "header length '１２' (UTF-8)": (GOOD_HEADER.encode(), {"Inference-Header-Content-Length": "１２".encode()}),
    "document nested 3000 deep": (nested(DEEP).encode(), {}),
    "inputs nested 3000 deep": (('{"inputs": ' + nested(DEEP) + "}").encode(), {}),
    "data nested 3000 deep": (pixels_json(nested(DEEP)), {}),
    "parameters nested 3000 deep": ((GOOD_HEADER[:-1] + ', "parameters": {"p": ' + nested(DEEP) + "}}").encode(), {}),
    "gzip body nested 3000 deep": (gzip.compress(pixels_json(nested(DEEP))), {"Content-Encoding": "gzip"}),
    "NaN in UINT8 data": (pixels_json("NaN, 0, 0"), {}),
    "Infinity in UINT8 data": (pixels_json("0, Infinity, 0"), {}),
    "-Infinity in UINT8 data": (pixels_json("0, 0, -Infinity"), {}),
    "1.5 in UINT8 data": (pixels_json("1.5, 0, 0"), {}),
    "1e400 in UINT8 data": (pixels_json("0, 1e400, 0"), {}),
    "2.0 in UINT8 data": (pixels_json("0, 0, 2.0"), {}),
    "NaN in INT32 data": (pixels_json("NaN, 0, 0", "INT32"), {}),
}


@pytest.mark.parametrize("case", MALFORMED)
def test_malformed_bodies_get_400_json_and_the_server_stays_healthy(server: Server, case: str) -> None:
    body, headers = MALFORMED[case]
    failures, log_start = server.metric("imgserve_requests_total", route="/v2/infer", code="500"), len(server.log())
    response = httpx.post(f"{server.url}{INFER}", content=body, headers=headers, timeout=30)
    assert response.status_code == 400, response.text[:300]
    assert response.headers["content-type"] == "application/json"
    assert list(response.json()) == ["error"] and isinstance(response.json()["error"], str)
    assert httpx.get(f"{server.url}/v2/health/ready").json() == {"ready": True}
    assert server.metric("imgserve_requests_total", route="/v2/infer", code="500") == failures
    assert "Traceback" not in server.log()[log_start:]
