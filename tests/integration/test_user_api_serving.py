"""imgserve's serving guarantees hold for a user's own ImageAPI (tests/support/user_apis.py), with real servers: the
batch memory measured at start on the API's example request (and max_batch_size auto from it), a SIMULATED CUDA
out-of-memory split, the per-stage metrics, the Open Inference Protocol over HTTP and gRPC from the API's declared
tensors (or the default ones), and one copy of the weights for every worker where the API loads its model through
imgserve. (Overload, deadlines, drain, faults and errors: test_user_api.py.)"""

from __future__ import annotations

import asyncio
import io
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton_http
from PIL import Image
from safetensors.torch import save_file
from serving import Server, image_bytes, running_server
from user_apis import HUNGRY_BYTES_PER_ELEMENT, TinyNet

from imgserve.pod import AUTO_BATCH_CAP
from imgserve.testing import free_port

PNG = {"Content-Type": "image/png"}
STAGES = (
    "imgserve_decode_duration_seconds",
    "imgserve_queue_wait_seconds",
    "imgserve_inference_duration_seconds",
    "imgserve_encode_duration_seconds",
)


def post(server: Server, data: bytes, tag: str = "") -> httpx.Response:
    return httpx.post(f"{server.url}/predict", params={"tag": tag}, content=data, headers=PNG, timeout=30)


def info(server: Server) -> dict:
    return httpx.get(f"{server.url}/info").json()


def measured(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, api: str, side: int, **settings: object) -> dict:
    """/info of a server of `api` whose example request is a `side` x `side` image (a tenth of the free memory is
    the batch budget, so that auto batch sizes stay under the cap)."""
    monkeypatch.setenv("USER_API_EXAMPLE_SIDE", str(side))
    with running_server(tmp_path, api=api, workers_per_device=1, gpu_memory_fraction=0.1, **settings) as server:
        return info(server)


def auto_batch(described: dict, side: int) -> int:
    """The batch size max_batch_size auto must choose from the element budget on /info."""
    return min(described["batch_element_budget"] // (side * side * 3), AUTO_BATCH_CAP)


def test_the_batch_memory_is_measured_on_the_apis_example_and_sets_max_batch_size_auto(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Hungry's predict holds HUNGRY_BYTES_PER_ELEMENT at its peak: the budget says so, and the batch size auto
    chooses from it shrinks as the API's example grows."""
    small = measured(tmp_path / "small", monkeypatch, "user_apis:Hungry", 256, max_batch_size="auto")
    large = measured(tmp_path / "large", monkeypatch, "user_apis:Hungry", 512, max_batch_size="auto")
    for described in (small, large):
        per_element = described["batch_memory_budget_bytes_per_worker"] / described["batch_element_budget"]
        assert described["batch_element_budget"] > 0
        # peak RSS counts whole pages, one may already be resident: within 0.1% under (6 of the small example's 6,144)
        assert 0.999 * HUNGRY_BYTES_PER_ELEMENT <= per_element < 2 * HUNGRY_BYTES_PER_ELEMENT, described
    assert small["max_batch_size"] == auto_batch(small, 256) > 1
    assert large["max_batch_size"] == auto_batch(large, 512) > 1
    assert large["max_batch_size"] < small["max_batch_size"] / 2, (small["max_batch_size"], large["max_batch_size"])


def test_max_batch_size_auto_in_the_apis_constructor_is_measured(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    described = measured(tmp_path, monkeypatch, "user_apis:AutoHungry", 512)
    assert described["max_batch_size"] == auto_batch(described, 512) > 1
    assert described["max_batch_size"] != 8  # not the settings' default


def test_a_simulated_cuda_out_of_memory_splits_the_batch_and_answers_every_request(tmp_path: Path) -> None:
    """SIMULATED: the API raises torch.OutOfMemoryError on any batch of more than one item (there is no GPU here)."""
    settings = {"max_batch_size": 4, "batch_timeout_ms": 300, "workers_per_device": 1}
    with running_server(tmp_path, api="user_apis:OutOfMemoryOnBatches", **settings) as server:
        batches_before = server.metric("imgserve_batch_size_count")

        async def together() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=30) as client:
                url, image = f"{server.url}/predict", image_bytes(16, 12)
                return await asyncio.gather(
                    *(client.post(url, params={"tag": f"r{i}"}, content=image, headers=PNG) for i in range(4))
                )

        answers = asyncio.run(together())
        assert [(r.status_code, r.json()["tag"]) for r in answers] == [(200, f"r{i}") for i in range(4)]
        assert server.metric("imgserve_batch_size_count") - batches_before < 4, "the requests were not batched"
        assert server.metric("imgserve_oom_splits_total") >= 1
        assert httpx.get(f"{server.url}/health/ready").status_code == 200


@pytest.fixture(scope="module")
def tagged(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """user_apis.Tagged, which declares no tensors, with gRPC on."""
    with running_server(tmp_path_factory.mktemp("tagged"), api="user_apis:Tagged", grpc_port=free_port()) as server:
        yield server


def test_every_stage_is_timed_on_the_existing_metrics(tagged: Server) -> None:
    before = {name: tagged.metric(f"{name}_count") for name in STAGES}
    answered = tagged.metric("imgserve_requests_total", route="/predict", code="200")
    for i in range(3):
        assert post(tagged, image_bytes(16, 12, seed=i)).status_code == 200
    grown = {name: tagged.metric(f"{name}_count") - before[name] for name in STAGES}
    assert grown["imgserve_decode_duration_seconds"] == grown["imgserve_encode_duration_seconds"] == 3, grown
    assert grown["imgserve_queue_wait_seconds"] == 3 and grown["imgserve_inference_duration_seconds"] >= 1, grown
    assert tagged.metric("imgserve_requests_total", route="/predict", code="200") - answered == 3


def test_an_api_that_declares_no_tensors_takes_an_image_and_answers_its_json_over_v2(tagged: Server) -> None:
    images = [image_bytes(16, 12, seed=i) for i in range(3)]
    expected = [post(tagged, image).content for image in images]
    http = triton_http.InferenceServerClient(tagged.address, network_timeout=60)
    grpc = triton_grpc.InferenceServerClient(f"127.0.0.1:{tagged.grpc_port}")
    metadata = http.get_model_metadata("Tagged")
    assert (metadata["inputs"], metadata["outputs"]) == (
        [{"name": "image", "datatype": "BYTES", "shape": [-1, 1]}],
        [{"name": "output", "datatype": "BYTES", "shape": [-1, 1]}],
    )
    for triton in (triton_http, triton_grpc):
        tensor = triton.InferInput("image", [3, 1], "BYTES")
        tensor.set_data_from_numpy(np.array([[image] for image in images], dtype=object))
        result = (http if triton is triton_http else grpc).infer("Tagged", [tensor])
        output = result.as_numpy("output")
        assert output.shape == (3, 1)
        assert [json.loads(row[0]) for row in output] == [json.loads(answer) for answer in expected]


@pytest.fixture(scope="module")
def declared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """user_apis.Declared (pixels and gain in; mean and size out), with gRPC on."""
    folder = tmp_path_factory.mktemp("declared")
    with running_server(folder, api="user_apis:Declared", grpc_port=free_port(), max_batch_size=8) as server:
        yield server


def declared_inputs(triton: object, pixels: np.ndarray, gain: np.ndarray) -> list:
    tensors = [
        triton.InferInput("pixels", list(pixels.shape), "UINT8"),
        triton.InferInput("gain", [len(gain), 1], "FP32"),
    ]
    tensors[0].set_data_from_numpy(pixels)
    tensors[1].set_data_from_numpy(gain.reshape(-1, 1))
    return tensors


def test_the_declared_tensors_are_the_models_metadata_and_config(declared: Server) -> None:
    http = triton_http.InferenceServerClient(declared.address)
    metadata = http.get_model_metadata("declared")
    assert metadata["inputs"] == [
        {"name": "pixels", "datatype": "UINT8", "shape": [-1, -1, -1, 3]},
        {"name": "gain", "datatype": "FP32", "shape": [-1, 1]},
    ]
    assert metadata["outputs"] == [
        {"name": "mean", "datatype": "FP32", "shape": [-1, 3]},
        {"name": "size", "datatype": "INT32", "shape": [-1, 2]},
    ]
    config = http.get_model_config("declared")
    assert [(i["name"], i["data_type"], i["dims"]) for i in config["input"]] == [
        ("pixels", "TYPE_UINT8", [-1, -1, 3]),
        ("gain", "TYPE_FP32", [1]),
    ]
    assert [(o["name"], o["data_type"], o["dims"]) for o in config["output"]] == [
        ("mean", "TYPE_FP32", [3]),
        ("size", "TYPE_INT32", [2]),
    ]
    assert config["max_batch_size"] == 8
    grpc = triton_grpc.InferenceServerClient(f"127.0.0.1:{declared.grpc_port}")
    over_grpc = grpc.get_model_metadata("declared")
    assert [(t.name, t.datatype, list(t.shape)) for t in over_grpc.inputs] == [
        (t["name"], t["datatype"], t["shape"]) for t in metadata["inputs"]
    ]
    assert [o.name for o in grpc.get_model_config("declared").config.output] == ["mean", "size"]


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_an_infer_of_n_items_answers_n_rows_of_each_declared_output(declared: Server, protocol: str) -> None:
    pixels = np.random.default_rng(3).integers(0, 256, (5, 6, 7, 3), dtype=np.uint8)
    gain = np.array([1, 2, 0.5, 1, 3], dtype=np.float32)
    if protocol == "http":
        client, triton = triton_http.InferenceServerClient(declared.address, network_timeout=60), triton_http
    else:
        client, triton = triton_grpc.InferenceServerClient(f"127.0.0.1:{declared.grpc_port}"), triton_grpc
    result = client.infer("declared", declared_inputs(triton, pixels, gain))
    mean, size = result.as_numpy("mean"), result.as_numpy("size")
    assert (mean.shape, mean.dtype, size.shape, size.dtype) == ((5, 3), np.float32, (5, 2), np.int32)
    np.testing.assert_allclose(mean, pixels.mean(axis=(1, 2)) * gain[:, None], rtol=1e-5)
    assert size.tolist() == [[6, 7]] * 5


def test_an_api_loading_its_model_through_imgserve_shares_one_copy_of_the_weights(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    net = TinyNet()
    save_file(net.state_dict(), str(tmp_path / "tiny.safetensors"))
    monkeypatch.setenv("USER_API_MODEL", str(tmp_path / "tiny.safetensors"))
    with running_server(tmp_path, api="user_apis:Loaded", workers_per_device=2) as server:
        weights = info(server)["weights"]
        size = sum(tensor.numel() * tensor.element_size() for tensor in net.state_dict().values())
        assert weights["shared"] and weights["bytes"] == size, weights
        assert server.metric("imgserve_model_weight_bytes", device="cpu") == size, "counted once per worker"
        mapped = weights["route"].split()[-1]
        workers = server.worker_pids()
        assert len(workers) == 2
        assert all(mapped in Path(f"/proc/{pid}/maps").read_text() for pid in workers), "a worker has its own copy"
        image = image_bytes(16, 12)
        pixels = torch.from_numpy(np.array(Image.open(io.BytesIO(image)).convert("RGB")))
        with torch.inference_mode():
            expected = net.eval()(pixels.permute(2, 0, 1)[None].float() / 255)[0]
        answer = post(server, image)
        assert answer.status_code == 200, answer.text
        np.testing.assert_allclose(answer.json()["features"], expected.numpy(), rtol=1e-5, atol=1e-6)
