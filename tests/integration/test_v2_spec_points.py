"""Where the Open Inference Protocol's official texts say what a server answers (required_api.md, inference_rest.md,
the proto, Triton's extension_binary_data.md): readiness, the default outputs, raw binary requests, the server
metadata path and the platform, each with the clients that read them."""

from __future__ import annotations

import base64
import io
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
import torch
import tritonclient.http as triton
from PIL import Image
from serving import (
    SUPPORT,
    Server,
    grpc_stub,
    image_bytes,
    running_server,
    start_server,
    stop_server,
    wait_ready,
    wait_until,
)
from torch import nn

from imgserve.testing import free_port

MODEL = "denoiser"
PNG = image_bytes(20, 10, seed=5)


@pytest.fixture(scope="module")
def builtin(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with running_server(tmp_path_factory.mktemp("logs"), grpc_port=free_port(), max_batch_size=4) as server:
        yield server


def readiness(server: Server, model: str) -> dict[str, object]:
    """The v2 readiness answers, imgserve's own /health/ready status, and what Triton's and KServe's clients make of
    them (KServe's in a child process: it cannot share one with tritonclient.grpc)."""
    client = triton.InferenceServerClient(server.address)
    kserve = [sys.executable, str(SUPPORT / "kserve_readiness.py"), server.url, model]
    run = subprocess.run(kserve, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    return {
        "ready": _answer(httpx.get(f"{server.url}/v2/health/ready")),
        "model ready": _answer(httpx.get(f"{server.url}/v2/models/{model}/ready")),
        "imgserve ready": httpx.get(f"{server.url}/health/ready").status_code,
        "tritonclient": (client.is_server_live(), client.is_server_ready(), client.is_model_ready(model)),
        "kserve": json.loads(run.stdout),
    }


def _answer(response: httpx.Response) -> tuple[int, dict]:
    return response.status_code, response.json()


def assert_not_ready(found: dict[str, object], model: str, reason: str) -> None:
    """required_api.md: "A 200 status code indicates true and a 4xx status code indicates false"; KServe's
    is_server_ready raises on it with the server's message, its is_model_ready and Triton's client say False."""
    error = f"not ready: {reason}"
    assert found["ready"] == (400, {"ready": False, "error": error})
    assert found["model ready"] == (400, {"name": model, "ready": False, "error": error})
    assert found["imgserve ready"] == 503  # the chart's probes read imgserve's own route, which is unchanged
    assert found["tritonclient"] == (True, False, False)
    kserve = found["kserve"]
    assert isinstance(kserve, dict) and kserve["live"] is True and kserve["model_ready"] is False
    assert kserve["ready"]["status"] == 400 and error in kserve["ready"]["message"]


def test_not_ready_is_a_4xx_while_a_worker_loads(tmp_path, monkeypatch) -> None:
    """A worker that died is started again and loads its model: not ready until it has. (At start the port opens
    only once every worker has loaded, so this is when a running server is seen loading.)"""
    delay = tmp_path / "setup-delay"
    monkeypatch.setenv("V2_SETUP_DELAY_FILE", str(delay))
    server = start_server({"api": "v2_apis:SlowMeanColour"}, tmp_path)
    try:
        wait_ready(server)
        delay.write_text("120")  # the next setup: longer than the test
        os.kill(server.worker_pids()[0], signal.SIGKILL)
        ready = f"{server.url}/v2/health/ready"
        wait_until(lambda: httpx.get(ready).status_code != 200, 30, "a worker loading again")
        assert_not_ready(readiness(server, "mean_colour"), "mean_colour", "worker restarting")
    finally:
        stop_server(server, grace_s=2)


def test_not_ready_is_a_4xx_while_draining(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("V2_PREDICT_DELAY_S", "2")
    settings = {"api": "v2_apis:SlowMeanColour", "max_batch_size": 1, "batch_timeout_ms": 0, "drain_timeout_s": 60}
    with running_server(tmp_path, **settings) as server, ThreadPoolExecutor(4) as pool:
        body = {"inputs": [{"name": "image", "datatype": "BYTES", "shape": [1, 1], "data": [_base64(PNG)]}]}
        infer = f"{server.url}/v2/models/mean_colour/infer"
        in_flight = [pool.submit(httpx.post, infer, json=body, timeout=60) for _ in range(4)]
        wait_until(lambda: server.metric("imgserve_queue_depth") >= 3, 20, "requests in flight")
        server.process.send_signal(signal.SIGTERM)
        wait_until(lambda: httpx.get(f"{server.url}/v2/health/ready").status_code != 200, 10, "draining")
        assert_not_ready(readiness(server, "mean_colour"), "mean_colour", "draining")
        assert [call.result().status_code for call in in_flight] == [200] * 4


def test_a_request_without_outputs_gets_every_output_over_http_and_grpc(builtin: Server) -> None:
    """inference_rest.md and the proto: "if not specified all outputs produced by the model will be returned"."""
    from tritonclient.grpc import service_pb2

    metadata = httpx.get(f"{builtin.url}/v2/models/{MODEL}").json()
    every = [output["name"] for output in metadata["outputs"]]
    assert every == ["output_image", "output_pixels"]
    body = {"inputs": [{"name": "image", "datatype": "BYTES", "shape": [1, 1], "data": [_base64(PNG)]}]}
    answer = httpx.post(f"{builtin.url}/v2/models/{MODEL}/infer", json=body).json()
    assert [output["name"] for output in answer["outputs"]] == every
    request = service_pb2.ModelInferRequest(model_name=MODEL)
    request.inputs.add(name="image", datatype="BYTES", shape=[1, 1]).contents.bytes_contents.append(PNG)
    with grpc_stub(builtin) as stub:
        response = stub.ModelInfer(request, timeout=60)
    assert [output.name for output in response.outputs] == every and len(response.raw_output_contents) == 2


def test_a_raw_binary_request_is_answered_in_binary(builtin: Server) -> None:
    """extension_binary_data.md, "Raw Binary Request": Inference-Header-Content-Length 0, the body the one input;
    "all the model output will be requested to be returned in binary tensor form": the answer is
    application/octet-stream, its own Inference-Header-Content-Length the JSON's length, each output's
    `parameters.binary_data_size` (and no `data`), then the outputs' bytes in order."""
    response = httpx.post(
        f"{builtin.url}/v2/models/{MODEL}/infer",
        content=PNG,
        headers={"Inference-Header-Content-Length": "0", "Content-Type": "application/octet-stream"},
    )
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "application/octet-stream"
    length = int(response.headers["Inference-Header-Content-Length"])
    header = json.loads(response.content[:length])
    assert [(o["name"], o["datatype"], o["shape"]) for o in header["outputs"]] == [
        ("output_image", "BYTES", [1, 1]),
        ("output_pixels", "UINT8", [1, 10, 20, 3]),
    ]
    sizes = [output.pop("parameters") for output in header["outputs"]]
    assert all(set(output) == {"name", "datatype", "shape"} for output in header["outputs"])
    image_size, pixels_size = (size["binary_data_size"] for size in sizes)
    assert length + image_size + pixels_size == len(response.content)
    element = response.content[length : length + image_size]
    assert int.from_bytes(element[:4], "little") == image_size - 4
    assert Image.open(io.BytesIO(element[4:])).size == (20, 10) and pixels_size == 10 * 20 * 3


def test_the_server_metadata_answers_at_v2_and_v2_slash(builtin: Server) -> None:
    """required_api.md writes `GET v2`, the OpenAPI document `/v2/`: both are the server metadata."""
    plain, slash = (httpx.get(f"{builtin.url}{path}", follow_redirects=False) for path in ("/v2", "/v2/"))
    assert (plain.status_code, slash.status_code) == (200, 200)
    assert slash.json() == plain.json() and set(plain.json()) == {"name", "version", "extensions"}


def test_the_platform_names_the_model_format(builtin: Server, tmp_path) -> None:
    """inference_rest.md, Platforms: "<project>_<format>", `pytorch_torchscript` for TorchScript, whatever the
    file's suffix; the built-in model, built by Python code, is `pytorch_eager`."""
    assert httpx.get(f"{builtin.url}/v2/models/{MODEL}").json()["platform"] == "pytorch_eager"
    path = tmp_path / "scripted.pt"
    torch.jit.save(torch.jit.script(nn.Conv2d(3, 3, 1)), str(path))
    with running_server(tmp_path, model=str(path)) as server:
        metadata = httpx.get(f"{server.url}/v2/models/scripted").json()
        config = httpx.get(f"{server.url}/v2/models/scripted/config").json()
    assert metadata["platform"] == config["platform"] == "pytorch_torchscript"


def test_pixels_of_the_raw_answer_are_the_json_answers(builtin: Server) -> None:
    """The raw binary answer carries the same pixels as a JSON request for the same image."""
    raw = httpx.post(
        f"{builtin.url}/v2/models/{MODEL}/infer", content=PNG, headers={"Inference-Header-Content-Length": "0"}
    )
    length = int(raw.headers["Inference-Header-Content-Length"])
    image_size = json.loads(raw.content[:length])["outputs"][0]["parameters"]["binary_data_size"]
    body = {
        "inputs": [{"name": "image", "datatype": "BYTES", "shape": [1, 1], "data": [_base64(PNG)]}],
        "outputs": [{"name": "output_pixels"}],
    }
    (pixels,) = httpx.post(f"{builtin.url}/v2/models/{MODEL}/infer", json=body).json()["outputs"]
    expected = np.asarray(pixels["data"], dtype=np.uint8).tobytes()
    assert raw.content[length + image_size :] == expected


def _base64(data: bytes) -> str:
    return base64.b64encode(data).decode()
