"""Triton's perf_analyzer (in its podman container, loadtests/perf_analyzer.py) against a real server: its input data
is what the server reads as one image per request, and a short sweep over HTTP and gRPC completes without errors."""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest
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


def _image_built() -> bool:
    if not shutil.which("podman"):
        return False
    return subprocess.run(["podman", "image", "exists", perf_analyzer.IMAGE], check=False).returncode == 0


@pytest.mark.skipif(not _image_built(), reason="needs podman and the perf_analyzer image (loadtests/perf_analyzer.py)")
def test_perf_analyzer_completes_a_sweep_over_http_and_grpc(tmp_path: Path) -> None:
    images = [image.data for image in square_jpegs(64, count=4)]
    perf_analyzer.write_input_data(tmp_path / "images.json", images)
    port, grpc_port = free_port(), free_port()
    command = serve_command(port, grpc_port)
    source = {"PYTHONPATH": f"{SOURCE}:{REPO}"}  # this worktree's imgserve, whatever is installed
    with running_server(command, port, tmp_path / "server.log", "/health/ready", source):
        for protocol, target in (("http", port), ("grpc", grpc_port)):
            points = perf_analyzer.perf_analyzer(tmp_path, protocol, target, "1:2", 1000)
            assert [p.concurrency for p in points] == [1, 2]
            assert all(p.throughput > 0 and p.errors == 0 for p in points), points
