"""Triton's example clients (triton-inference-server/client, src/python/examples) as a Triton user runs them against
imgserve serving user APIs (tests/support/triton_apis.py): the tritonclient calls those scripts make, over HTTP and
gRPC. image_client.py: read the metadata and configuration, lay the pixels out as the input's format says, ask for
the top classes (`class_count`), sync, async, asyncio and streaming. simple_*_infer_client.py: binary and JSON
tensors, compressed bodies, the statistics, an unknown model. simple_*_string_infer_client.py: text in BYTES."""

from __future__ import annotations

import asyncio
import queue
from collections.abc import Iterator
from functools import partial
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpc_aio
import tritonclient.grpc.model_config_pb2 as model_config
import tritonclient.http as httpclient
import tritonclient.http.aio as http_aio
from PIL import Image
from serving import Server, running_server
from tritonclient.utils import InferenceServerException, triton_to_np_dtype

from imgserve.testing import free_port

COLOURS = ["red", "green", "blue"]  # the classifier's labels, in order
IMAGES = {  # mostly red, green and blue, at sizes image_client resizes from
    "red": Image.new("RGB", (50, 40), (200, 30, 10)),
    "green": Image.new("RGB", (31, 77), (20, 180, 60)),
    "blue": Image.new("RGB", (300, 260), (10, 40, 220)),
}
NCHW, NHWC = model_config.ModelInput.FORMAT_NCHW, model_config.ModelInput.FORMAT_NHWC


@pytest.fixture(scope="module")
def classifier(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with running_server(tmp_path_factory.mktemp("logs"), api="triton_apis:NchwClassifier", grpc_port=free_port()) as s:
        yield s


@pytest.fixture(scope="module")
def simple(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with running_server(tmp_path_factory.mktemp("logs"), api="triton_apis:Simple", grpc_port=free_port()) as s:
        yield s


@pytest.fixture(scope="module")
def simple_string(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with running_server(tmp_path_factory.mktemp("logs"), api="triton_apis:SimpleString", grpc_port=free_port()) as s:
        yield s


def image_batch(metadata: Any, config: Any, names: list[str]) -> tuple[str, str, np.ndarray]:
    """What image_client.py does with the model's description: one input of 3 dims, laid out as its configuration's
    `format` says (it refuses any other), each image resized and cast to the input's datatype. The input's name,
    the output's name and the batch."""
    (tensor,), (output,), (declared,) = metadata["inputs"], metadata["outputs"], config["input"]
    layout = model_config.ModelInput.Format.Value(declared.get("format", "FORMAT_NONE"))
    if layout not in (NCHW, NHWC):
        raise AssertionError(f"unexpected input format {model_config.ModelInput.Format.Name(layout)}")
    dims = tensor["shape"][1:]
    channels, height, width = dims if layout == NCHW else (dims[2], dims[0], dims[1])
    assert config["max_batch_size"] > 0 and channels == 3 and output["datatype"] == "FP32"
    pixels = [np.asarray(IMAGES[name].resize((width, height))) for name in names]  # H, W, C
    typed = [item.astype(triton_to_np_dtype(tensor["datatype"])) for item in pixels]
    items = [np.transpose(item, (2, 0, 1)) if layout == NCHW else item for item in typed]
    return tensor["name"], output["name"], np.stack(items)


def described(client: Any, model: str) -> tuple[Any, Any]:
    """The model's metadata and configuration as dicts, from either protocol's client."""
    metadata, config = client.get_model_metadata(model), client.get_model_config(model)
    if isinstance(metadata, dict):
        return metadata, config
    from google.protobuf import json_format

    found = json_format.MessageToDict(metadata, preserving_proto_field_name=True)
    for tensor in found["inputs"] + found["outputs"]:
        tensor["shape"] = [int(size) for size in tensor["shape"]]
    return found, json_format.MessageToDict(config.config, preserving_proto_field_name=True)


def http_sync(server: Server, requests: list[dict[str, Any]]) -> list[Any]:
    client = httpclient.InferenceServerClient(server.address)
    return [client.infer(**request) for request in requests]


def http_async(server: Server, requests: list[dict[str, Any]]) -> list[Any]:
    client = httpclient.InferenceServerClient(server.address, concurrency=len(requests))
    return [handle.get_result() for handle in [client.async_infer(**request) for request in requests]]


def http_asyncio(server: Server, requests: list[dict[str, Any]]) -> list[Any]:
    async def run() -> list[Any]:
        async with http_aio.InferenceServerClient(server.address) as client:
            return await asyncio.gather(*(client.infer(**request) for request in requests))

    return asyncio.run(run())


def grpc_sync(server: Server, requests: list[dict[str, Any]]) -> list[Any]:
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    return [client.infer(**request) for request in requests]


def grpc_async(server: Server, requests: list[dict[str, Any]]) -> list[Any]:
    client, answers = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}"), queue.Queue()
    for request in requests:
        client.async_infer(callback=lambda result, error: answers.put((result, error)), **request)
    return _collected(answers, len(requests))


def grpc_asyncio(server: Server, requests: list[dict[str, Any]]) -> list[Any]:
    async def run() -> list[Any]:
        async with grpc_aio.InferenceServerClient(f"127.0.0.1:{server.grpc_port}") as client:
            return await asyncio.gather(*(client.infer(**request) for request in requests))

    return asyncio.run(run())


def grpc_streaming(server: Server, requests: list[dict[str, Any]]) -> list[Any]:
    """image_client.py --streaming: one stream, every request sent, then the stream closed; answers by their id."""
    client, answers = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}"), queue.Queue()
    client.start_stream(partial(lambda found, result, error: found.put((result, error)), answers))
    try:
        for request in requests:
            client.async_stream_infer(**request)
    finally:
        client.stop_stream()
    results = {result.get_response().id: result for result in _collected(answers, len(requests))}
    return [results[request["request_id"]] for request in requests]


def _collected(answers: queue.Queue, count: int) -> list[Any]:
    found = []
    for _ in range(count):
        result, error = answers.get(timeout=60)
        if error is not None:
            raise error
        found.append(result)
    return found


CLIENTS = {
    "http": (httpclient, http_sync),
    "http async": (httpclient, http_async),
    "http asyncio": (httpclient, http_asyncio),
    "grpc": (grpcclient, grpc_sync),
    "grpc async": (grpcclient, grpc_async),
    "grpc asyncio": (grpcclient, grpc_asyncio),
    "grpc streaming": (grpcclient, grpc_streaming),
}


@pytest.mark.parametrize("way", list(CLIENTS))
def test_image_client_classifies_an_nchw_model_in_every_way(classifier: Server, way: str) -> None:
    """image_client.py -c 3 against a model declared TensorSpec("data", "FP32", (3, 224, 224), format="NCHW"),
    batches of 1 and 2: the configuration says FORMAT_NCHW over both protocols, and the top class is the colour."""
    library, send = CLIENTS[way]
    address = classifier.address if library is httpclient else f"127.0.0.1:{classifier.grpc_port}"
    metadata, config = described(library.InferenceServerClient(address), "colours")
    assert config["input"][0]["format"] == "FORMAT_NCHW"
    batches = [["red"], ["green", "blue"]]
    requests = []
    for number, names in enumerate(batches):
        name, output, batch = image_batch(metadata, config, names)
        assert batch.shape == (len(names), 3, 224, 224) and batch.dtype == np.float32
        tensor = library.InferInput(name, list(batch.shape), "FP32")
        tensor.set_data_from_numpy(batch)
        top = [library.InferRequestedOutput(output, class_count=3)]
        requests.append({"model_name": "colours", "inputs": [tensor], "outputs": top, "request_id": str(number)})
    for names, request, result in zip(batches, requests, send(classifier, requests), strict=True):
        found = result.get_response()
        assert (found["id"] if isinstance(found, dict) else found.id) == request["request_id"]
        classes = result.as_numpy(output)
        assert classes.shape == (len(names), 3)
        for expected, row in zip(names, classes, strict=True):
            score, index, label = row[0].decode().split(":")
            assert label == expected and int(index) == COLOURS.index(expected) and float(score) > 0.5
            assert sorted(entry.decode().split(":")[2] for entry in row) == sorted(COLOURS)


def test_an_nhwc_model_that_says_nothing_is_still_guessed(tmp_path) -> None:
    """The guess stays: a UINT8 [224, 224, 3] input without a declared format shows FORMAT_NHWC, and image_client's
    way of calling it classifies."""
    with running_server(tmp_path, api="triton_apis:NhwcClassifier", grpc_port=free_port()) as server:
        grpc_config = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}").get_model_config("colours")
        assert grpc_config.config.input[0].format == NHWC
        client = httpclient.InferenceServerClient(server.address)
        metadata, config = described(client, "colours")
        name, output, batch = image_batch(metadata, config, ["blue"])
        assert batch.shape == (1, 224, 224, 3) and batch.dtype == np.uint8
        tensor = httpclient.InferInput(name, list(batch.shape), "UINT8")
        tensor.set_data_from_numpy(batch)
        result = client.infer("colours", [tensor], outputs=[httpclient.InferRequestedOutput(output, class_count=1)])
        assert result.as_numpy(output)[0][0].decode().endswith(":2:blue")


def add_sub_tensors(library: Any, binary: tuple[bool, bool] = (False, True)) -> tuple[list[Any], np.ndarray]:
    """simple's inputs as the example clients make them: 0..15 and all -1 (first as JSON, second binary over HTTP)."""
    data = np.stack([np.arange(16, dtype=np.int32), np.full(16, -1, dtype=np.int32)])[:, None]
    inputs = [library.InferInput(f"INPUT{index}", [1, 16], "INT32") for index in range(2)]
    for tensor, values, as_binary in zip(inputs, data, binary, strict=True):
        if library is httpclient:
            tensor.set_data_from_numpy(values, binary_data=as_binary)
        else:
            tensor.set_data_from_numpy(values)
    return inputs, data


def check_add_sub(result: Any, data: np.ndarray) -> None:
    assert result.as_numpy("OUTPUT0").tolist() == (data[0] + data[1]).tolist()
    assert result.as_numpy("OUTPUT1").tolist() == (data[0] - data[1]).tolist()


@pytest.mark.parametrize("compression", [None, "gzip", "deflate"])
def test_simple_http_client_with_binary_and_json_tensors(simple: Server, compression: str | None) -> None:
    """simple_http_infer_client.py (--request- and --response-compression-algorithm): a JSON and a binary input,
    a binary and a JSON output, query parameters; then all outputs unnamed; its statistics; an unknown model."""
    client = httpclient.InferenceServerClient(simple.address)
    inputs, data = add_sub_tensors(httpclient)
    outputs = [httpclient.InferRequestedOutput("OUTPUT0", binary_data=True)]
    outputs.append(httpclient.InferRequestedOutput("OUTPUT1", binary_data=False))
    compressed = {"request_compression_algorithm": compression, "response_compression_algorithm": compression}
    named = client.infer("simple", inputs, outputs=outputs, query_params={"test_1": 1, "test_2": 2}, **compressed)
    check_add_sub(named, data)
    assert "data" in named.get_output("OUTPUT1") and "data" not in named.get_output("OUTPUT0")
    check_add_sub(client.infer("simple", inputs, outputs=None, **compressed), data)
    statistics = client.get_inference_statistics(model_name="simple")
    assert [entry["name"] for entry in statistics["model_stats"]] == ["simple"]
    with pytest.raises(InferenceServerException) as caught:
        client.infer("wrong_model_name", inputs, outputs=outputs)
    assert caught.value.message().startswith("Request for unknown model")


@pytest.mark.parametrize("way", ["grpc", "grpc async", "grpc asyncio", "http async", "http asyncio"])
def test_simple_clients_sync_async_and_asyncio(simple: Server, way: str) -> None:
    """simple_grpc_infer_client.py, simple_grpc_async_infer_client.py, simple_grpc_aio_infer_client.py and the HTTP
    async and aio twins: the add/sub answers, then the statistics (which they print)."""
    library, send = CLIENTS[way]
    inputs, data = add_sub_tensors(library, binary=(True, True))
    outputs = [library.InferRequestedOutput(name) for name in ("OUTPUT0", "OUTPUT1")]
    (result,) = send(simple, [{"model_name": "simple", "inputs": inputs, "outputs": outputs, "request_id": "1"}])
    check_add_sub(result, data)
    address = simple.address if library is httpclient else f"127.0.0.1:{simple.grpc_port}"
    statistics = library.InferenceServerClient(address).get_inference_statistics("simple")
    names = [entry["name"] for entry in statistics["model_stats"]] if isinstance(statistics, dict) else None
    assert (names or [entry.name for entry in statistics.model_stats]) == ["simple"]


def text_tensors(library: Any) -> tuple[list[Any], np.ndarray]:
    """simple_string's inputs as simple_*_string_infer_client.py makes them: 0..15 and all 1, as UTF-8 text; over
    HTTP the first binary, the second as JSON strings."""
    numbers = np.stack([np.arange(16, dtype=np.int32), np.ones(16, dtype=np.int32)])[:, None]
    inputs = [library.InferInput(f"INPUT{index}", [1, 16], "BYTES") for index in range(2)]
    for tensor, values, binary in zip(inputs, numbers, (True, False), strict=True):
        text = np.array([[str(number).encode() for number in values[0]]], dtype=object)
        if library is httpclient:
            tensor.set_data_from_numpy(text, binary_data=binary)
        else:
            tensor.set_data_from_numpy(text)
    return inputs, numbers


@pytest.mark.parametrize("library", [httpclient, grpcclient], ids=["http", "grpc"])
def test_text_in_bytes_tensors(simple_string: Server, library: Any) -> None:
    """simple_http_string_infer_client.py and its gRPC twin: BYTES elements that are text, sent as JSON strings as
    the protocol writes them (HTTP's second input), answered as text (HTTP's second output as JSON strings)."""
    address = simple_string.address if library is httpclient else f"127.0.0.1:{simple_string.grpc_port}"
    client = library.InferenceServerClient(address)
    inputs, numbers = text_tensors(library)
    if library is httpclient:
        outputs = [httpclient.InferRequestedOutput("OUTPUT0", binary_data=True)]
        outputs.append(httpclient.InferRequestedOutput("OUTPUT1", binary_data=False))
    else:
        outputs = [grpcclient.InferRequestedOutput(name) for name in ("OUTPUT0", "OUTPUT1")]
    result = client.infer("simple_string", inputs, outputs=outputs)
    sums, differences = (result.as_numpy(name)[0] for name in ("OUTPUT0", "OUTPUT1"))
    assert [int(element) for element in sums] == (numbers[0][0] + numbers[1][0]).tolist()
    assert [int(element) for element in differences] == (numbers[0][0] - numbers[1][0]).tolist()
    if library is httpclient:
        assert result.get_output("OUTPUT1")["data"] == [str(n) for n in (numbers[0][0] - numbers[1][0])]


def test_statistics_count_and_time_what_the_server_measured(simple: Server) -> None:
    """The statistics extension over both protocols: three calls over HTTP and a batch of two over gRPC succeed and
    one call fails; each stage counts what it saw, its time is there, and each item's stages fit in its call's time."""
    client = httpclient.InferenceServerClient(simple.address)
    grpc_client = grpcclient.InferenceServerClient(f"127.0.0.1:{simple.grpc_port}")
    before = statistics(client)
    inputs, data = add_sub_tensors(httpclient)
    for _ in range(3):
        check_add_sub(client.infer("simple", inputs), data)
    pair = [grpcclient.InferInput(f"INPUT{index}", [2, 16], "INT32") for index in range(2)]
    for tensor in pair:
        tensor.set_data_from_numpy(np.zeros((2, 16), dtype=np.int32))
    assert grpc_client.infer("simple", pair).as_numpy("OUTPUT0").shape == (2, 16)
    wrong = httpclient.InferInput("INPUT0", [1, 8], "INT32")
    wrong.set_data_from_numpy(np.zeros((1, 8), dtype=np.int32))
    with pytest.raises(InferenceServerException, match="INPUT0"):
        client.infer("simple", [wrong])
    after = statistics(client)
    grpc_after = grpc_client.get_inference_statistics("simple", as_json=True)["model_stats"][0]
    assert int(grpc_after["inference_count"]) == after["inference_count"]  # the same figures over gRPC
    assert after["inference_count"] - before["inference_count"] == 5  # images
    assert 1 <= after["execution_count"] - before["execution_count"] <= 5  # batches
    stages = {
        name: {key: stage[key] - before["inference_stats"][name][key] for key in ("count", "ns")}
        for name, stage in after["inference_stats"].items()
    }
    assert {name: stage["count"] for name, stage in stages.items()} == {
        "success": 4, "fail": 1, "queue": 5, "compute_input": 5, "compute_infer": 5, "compute_output": 5,
        "cache_hit": 0, "cache_miss": 0,
    }  # fmt: skip
    assert all(stages[name]["ns"] > 0 for name in ("success", "fail", "queue", "compute_input", "compute_infer"))
    # Each item's stages fit in its request's time, and the stages count items: the gRPC call's two items count its
    # time twice, so the items' stages fit in twice the requests' time (before that, one run read 1.05x of once).
    within = sum(stages[name]["ns"] for name in ("queue", "compute_input", "compute_infer", "compute_output"))
    assert within <= 2 * stages["success"]["ns"], stages


@pytest.mark.parametrize(
    ("path", "status"),
    [
        ("/v2/models/stats", 200),
        ("/v2/models/simple/stats", 200),
        ("/v2/models/simple/versions/1/stats", 200),
        ("/v2/models/other/stats", 404),
        ("/v2/models/simple/versions/2/stats", 404),
    ],
)
def test_statistics_routes(simple: Server, path: str, status: int) -> None:
    response = httpx.get(f"{simple.url}{path}")
    assert response.status_code == status
    if status == 200:
        assert [entry["name"] for entry in response.json()["model_stats"]] == ["simple"]
    else:
        assert list(response.json()) == ["error"]


def statistics(client: httpclient.InferenceServerClient) -> dict[str, Any]:
    (entry,) = client.get_inference_statistics("simple")["model_stats"]
    return entry
