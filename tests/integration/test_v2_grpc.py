"""The Open Inference Protocol over gRPC against a real server, with Triton's client (tritonclient.grpc), the raw
generated stub and KServe's clients (REST and gRPC): health, metadata, ModelConfig, raw and typed tensors, status
codes, the stream, API keys, metric labels, the shared-memory RPCs."""

from __future__ import annotations

import contextlib
import io
import json
import queue
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as triton
from PIL import Image
from serving import SUPPORT, Server, image_bytes, running_server
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from imgserve.testing import free_port

MODEL = "denoiser"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with running_server(
        tmp_path_factory.mktemp("logs"), grpc_port=free_port(), max_body_bytes=200_000, batch_timeout_ms=20
    ) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: Server) -> triton.InferenceServerClient:
    return triton.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")


def images_input(*images: bytes) -> triton.InferInput:
    tensor = triton.InferInput("image", [len(images), 1], "BYTES")
    tensor.set_data_from_numpy(np.array([[image] for image in images], dtype=object))
    return tensor


def size_of(data: bytes) -> tuple[int, int]:
    return Image.open(io.BytesIO(data)).size


def test_health_metadata_and_config(client: triton.InferenceServerClient) -> None:
    assert client.is_server_live() and client.is_server_ready() and client.is_model_ready(MODEL)
    assert client.get_server_metadata().name == "imgserve"
    metadata = client.get_model_metadata(MODEL)
    assert [(t.name, t.datatype, list(t.shape)) for t in metadata.inputs] == [
        ("image", "BYTES", [-1, 1]),
        ("pixels", "UINT8", [-1, -1, -1, 3]),
    ]
    config = client.get_model_config(MODEL).config
    assert [i.name for i in config.input] == ["image", "pixels"] and all(i.optional for i in config.input)
    assert [o.name for o in config.output] == [o.name for o in metadata.outputs]
    assert config.max_batch_size > 0


def test_a_batch_round_trips_at_each_images_size(client: triton.InferenceServerClient) -> None:
    sizes = [(64, 48), (31, 17), (50, 50)]
    images = [image_bytes(w, h, "JPEG", seed=w) for w, h in sizes]
    output = triton.InferRequestedOutput("output_image")  # output_pixels cannot hold images of different sizes
    result = client.infer(
        MODEL, [images_input(*images)], outputs=[output], request_id="g1", parameters={"format": "webp"}
    )
    answers = result.as_numpy("output_image")
    assert [size_of(answer[0]) for answer in answers] == sizes
    assert Image.open(io.BytesIO(answers[0][0])).format == "WEBP"
    assert result.get_response().id == "g1"


def test_pixels_in_typed_contents_and_out_raw(stub: service_pb2_grpc.GRPCInferenceServiceStub) -> None:
    """A client that fills the typed `contents` (not tritonclient's raw bytes) is read, and outputs come back raw."""
    pixels = np.random.default_rng(1).integers(0, 256, (1, 6, 5, 3), dtype=np.uint8)
    request = service_pb2.ModelInferRequest(model_name=MODEL)
    tensor = request.inputs.add(name="pixels", datatype="UINT8", shape=list(pixels.shape))
    tensor.contents.uint_contents.extend(pixels.reshape(-1).tolist())
    request.outputs.add(name="output_pixels")
    response = stub.ModelInfer(request, timeout=30)
    (output,) = response.outputs
    assert (output.name, output.datatype, list(output.shape)) == ("output_pixels", "UINT8", [1, 6, 5, 3])
    assert len(response.raw_output_contents[0]) == pixels.size


@pytest.mark.parametrize(
    ("change", "code"),
    [
        (lambda r: setattr(r, "model_name", "other"), grpc.StatusCode.NOT_FOUND),
        (lambda r: setattr(r, "model_version", "9"), grpc.StatusCode.NOT_FOUND),
        (lambda r: r.raw_input_contents.__setitem__(0, b"\x05\x00\x00\x00hello"), grpc.StatusCode.INVALID_ARGUMENT),
        (lambda r: r.raw_input_contents.__setitem__(0, b"\xff\xff\xff\xff"), grpc.StatusCode.INVALID_ARGUMENT),
        (lambda r: r.outputs.add(name="nope"), grpc.StatusCode.INVALID_ARGUMENT),
        (lambda r: None, None),  # untouched: the request is fine (the cases above fail for their change alone)
        (lambda r: r.raw_input_contents.append(b"x"), grpc.StatusCode.INVALID_ARGUMENT),
        (lambda r: r.raw_input_contents.__setitem__(0, b"\0" * 300_000), grpc.StatusCode.RESOURCE_EXHAUSTED),
    ],
)
def test_bad_requests_get_status_codes(
    server: Server, stub: service_pb2_grpc.GRPCInferenceServiceStub, change, code
) -> None:
    png = image_bytes(12, 12)
    request = service_pb2.ModelInferRequest(model_name=MODEL)
    request.inputs.add(name="image", datatype="BYTES", shape=[1, 1])
    request.raw_input_contents.append(len(png).to_bytes(4, "little") + png)
    change(request)
    if code is None:
        assert stub.ModelInfer(request, timeout=30).outputs[0].name == "output_image"
        return
    with pytest.raises(grpc.RpcError) as caught:
        stub.ModelInfer(request, timeout=30)
    assert caught.value.code() == code and caught.value.details()
    assert stub.ServerReady(service_pb2.ServerReadyRequest(), timeout=10).ready


def test_a_stream_answers_each_message_and_a_bad_one_with_its_error(server: Server) -> None:
    """ModelStreamInfer, raw: a message that is no protobuf and a request for an unknown model are each answered with
    an error message (the request's id with it), between answers to good requests, on the one stream."""
    png = image_bytes(12, 12)

    def request(request_id: str, model: str = MODEL) -> bytes:
        message = service_pb2.ModelInferRequest(model_name=model, id=request_id)
        message.inputs.add(name="image", datatype="BYTES", shape=[1, 1])
        message.raw_input_contents.append(len(png).to_bytes(4, "little") + png)
        return message.SerializeToString()

    messages = [request("first"), b"\x0a\xff", request("unknown", model="other"), request("last")]
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
        stream = channel.stream_stream(
            "/inference.GRPCInferenceService/ModelStreamInfer",
            response_deserializer=service_pb2.ModelStreamInferResponse.FromString,
        )
        answers = list(stream(iter(messages), timeout=30))
    found = {answer.infer_response.id: answer for answer in answers}
    assert len(answers) == 4 and set(found) == {"first", "", "unknown", "last"}
    assert "not valid protobuf" in found[""].error_message
    assert "unknown model" in found["unknown"].error_message
    for good in ("first", "last"):
        assert found[good].error_message == "" and found[good].infer_response.outputs[0].name == "output_image"


def test_shared_memory_is_not_supported(client: triton.InferenceServerClient) -> None:
    """reuse_infer_objects_client.py's first calls: the shared-memory RPCs answer UNIMPLEMENTED with why."""
    for call in (client.get_system_shared_memory_status, client.unregister_cuda_shared_memory):
        with pytest.raises(InferenceServerException, match="shared memory is not supported") as caught:
            call()
        assert caught.value.status() == "StatusCode.UNIMPLEMENTED"
    assert client.is_server_ready()


def test_tritonclient_shows_the_servers_message(client: triton.InferenceServerClient) -> None:
    with pytest.raises(InferenceServerException, match="not an image"):
        client.infer(MODEL, [images_input(b"hello world")])


def test_grpc_calls_have_their_own_metric_labels(server: Server, client: triton.InferenceServerClient) -> None:
    client.infer(MODEL, [images_input(image_bytes(8, 8))])
    client.is_server_ready()
    assert server.metric("imgserve_requests_total", route="grpc/ModelInfer", code="200") >= 1
    assert server.metric("imgserve_requests_total", route="grpc", code="200") >= 1
    assert server.metric("imgserve_request_duration_seconds_count", route="grpc/ModelInfer") >= 1


def test_api_keys_model_name_and_two_front_ends(tmp_path) -> None:
    """With two HTTP front ends the first serves gRPC; --model-name names the model on both protocols; API keys
    guard gRPC ModelInfer and v2 infer (Bearer), not health or metadata."""
    import httpx

    port = free_port()
    with running_server(tmp_path, grpc_port=port, api_key="k1", model_name="restorer", api_servers=2) as server:
        client = triton.InferenceServerClient(f"127.0.0.1:{port}")
        assert client.is_server_ready() and client.get_model_metadata("restorer").name == "restorer"
        with pytest.raises(InferenceServerException, match="NOT_FOUND"):
            client.get_model_metadata(MODEL)
        image = images_input(image_bytes(8, 8))
        with pytest.raises(InferenceServerException, match="UNAUTHENTICATED"):
            client.infer("restorer", [image])
        with pytest.raises(InferenceServerException, match="UNAUTHENTICATED"):
            client.infer("restorer", [image], headers={"authorization": "Bearer wrong"})
        answer = client.infer("restorer", [image], headers={"authorization": "Bearer k1"})
        assert answer.as_numpy("output_image").shape == (1, 1)
        for headers, expected in (({}, "StatusCode.UNAUTHENTICATED"), ({"authorization": "Bearer k1"}, None)):
            assert streamed_error(client, "restorer", image, headers) == expected
        infer = f"{server.url}/v2/models/restorer/infer"
        refused = httpx.post(infer, json={"inputs": []})
        assert refused.status_code == 401 and list(refused.json()) == ["error"]
        assert refused.headers["www-authenticate"] == "Bearer"
        assert httpx.post(infer, json={"inputs": []}, headers={"Authorization": "Bearer k1"}).status_code == 400
        assert httpx.get(f"{server.url}/v2/health/ready").status_code == 200
        assert httpx.get(f"{server.url}/v2/models/{MODEL}").status_code == 404


def streamed_error(client: triton.InferenceServerClient, model: str, image: triton.InferInput, headers: dict) -> Any:
    """One request on a stream started with `headers`: None when answered, else what its error says first."""
    answers: queue.Queue = queue.Queue()
    client.start_stream(lambda result, error: answers.put(error), headers=headers)
    try:
        # A refused stream may end before its first request is sent: the client then raises here, and the refusal
        # is what its callback got.
        with contextlib.suppress(InferenceServerException):
            client.async_stream_infer(model, [image], request_id="s1")
        error = answers.get(timeout=30)
    finally:
        client.stop_stream()
    return None if error is None else error.status() or error.message()


def test_kserves_clients(server: Server, tmp_path) -> None:
    """KServe's InferenceRESTClient reads the health bodies, infers over binary and JSON and shows our message;
    its InferenceGRPCClient (its own stubs, from grpc_predict_v2.proto) reads readiness and infers."""
    path = tmp_path / "photo.jpg"
    path.write_bytes(image_bytes(40, 30, "JPEG"))
    command = [sys.executable, str(SUPPORT / "kserve_client.py"), server.url, MODEL, str(path)]
    run = subprocess.run([*command, f"127.0.0.1:{server.grpc_port}"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    found = json.loads(run.stdout)
    assert found["live"] and found["ready"] and found["model_ready"]
    assert found["binary"] == {"id": "k1", "size": [40, 30]}
    assert found["json"] == {"size": [40, 30]}
    assert "unknown model: 'no-such-model'" in found["error"] and "404" in found["error"]
    assert found["grpc"] == {"ready": True, "model_ready": True, "infer": {"id": "g1", "size": [40, 30]}}
