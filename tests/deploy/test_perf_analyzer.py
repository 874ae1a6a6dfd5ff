"""Triton's perf_analyzer (in its podman container, loadtests/perf_analyzer.py) against a real server: its input data
is what the server reads as one image per request, and a short sweep over HTTP, gRPC and gRPC's stream
(`--streaming`) completes without errors and shows the server's side (the statistics extension). The container image
is built by the first run (about 40 s: a Debian trixie rootfs and perf-analyzer from PyPI), then reused."""

from __future__ import annotations

import base64
import json
import time
from pathlib import Path

import httpx
import pytest
from containers import require_podman
from serving import REPO, SOURCE, Server

from imgserve.testing import free_port, serve_command
from loadtests import perf_analyzer
from loadtests.lib.images import square_jpegs
from loadtests.lib.servers import running_server

INFER = "/v2/models/denoiser/infer"


def test_input_data_is_one_jpeg_per_request(server: Server, tmp_path: Path) -> None:
    """Each step of the input file, sent as perf_analyzer sends it (a binary BYTES input [1, 1]), is one image."""
    images = [image.data for image in square_jpegs(32, count=2)]
    path = tmp_path / "images.json"
    perf_analyzer.write_input_data(path, images)
    steps = json.loads(path.read_text())["data"]
    assert len(steps) == 2
    for step in steps:
        blob = base64.b64decode(step["image"]["content"]["b64"])
        header = json.dumps(
            {"inputs": [{"name": "image", "datatype": "BYTES", "shape": [1, *step["image"]["shape"]],
                         "parameters": {"binary_data_size": len(blob)}}]}
        ).encode()  # fmt: skip
        response = httpx.post(
            f"{server.url}{INFER}", content=header + blob, headers={"Inference-Header-Content-Length": str(len(header))}
        )
        assert response.status_code == 200, response.text


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> str:
    """perf_analyzer's image, built once where it is not there yet."""
    require_podman()
    started = time.monotonic()
    perf_analyzer.ensure_image(tmp_path_factory.mktemp("perf-analyzer-image"))
    print(f"the perf_analyzer image was ready in {time.monotonic() - started:.0f} s")
    return perf_analyzer.IMAGE


@pytest.mark.timeout(900)
def test_perf_analyzer_sweeps_http_grpc_and_the_stream_and_shows_the_servers_side(image: str, tmp_path: Path) -> None:
    images = [image.data for image in square_jpegs(64, count=4)]
    perf_analyzer.write_input_data(tmp_path / "images.json", images)
    port, grpc_port = free_port(), free_port()
    command = serve_command(port, grpc_port)
    source = {"PYTHONPATH": f"{SOURCE}:{REPO}"}  # this worktree's imgserve, whatever is installed
    with running_server(command, port, tmp_path / "server.log", "/health/ready", source):
        for client, target in (("http", port), ("grpc", grpc_port), ("grpc streaming", grpc_port)):
            protocol, _, streaming = client.partition(" ")
            points = perf_analyzer.perf_analyzer(tmp_path, protocol, target, "1:2", 1000, streaming=bool(streaming))
            assert [p.concurrency for p in points] == [1, 2]
            assert all(p.throughput > 0 and p.errors == 0 for p in points), points
            assert all(p.server_us and p.server_us["Server Compute Infer"] > 0 for p in points), points
            output = (tmp_path / f"{client.replace(' ', '-')}-1-2.csv.log").read_text()
            assert output.count("Server: ") == 2 and output.count("Successful request count: ") == 2, output
            assert output.count("compute infer ") == 2, output  # "Avg request latency: ... (overhead ... + queue ...
