"""The Open Inference Protocol over HTTP against a real server, with Triton's own client (tritonclient.http) and raw
requests for what the client would never send: metadata, config, JSON and binary tensors, batches, errors."""

from __future__ import annotations

import base64
import gzip
import io
import json
import struct

import httpx
import numpy as np
import pytest
import tritonclient.http as triton
from PIL import Image
from serving import Server, image_bytes, running_server
from tritonclient.utils import InferenceServerException

MODEL = "denoiser"
INFER = f"/v2/models/{MODEL}/infer"


@pytest.fixture(scope="module")
def client(server: Server) -> triton.InferenceServerClient:
    return triton.InferenceServerClient(server.address, network_timeout=60)


def images_input(*images: bytes, binary: bool = True) -> triton.InferInput:
    tensor = triton.InferInput("image", [len(images), 1], "BYTES")
    tensor.set_data_from_numpy(np.array([[image] for image in images], dtype=object), binary_data=binary)
    return tensor


def decoded(data: bytes) -> Image.Image:
    image = Image.open(io.BytesIO(data))
    image.load()
    return image


def test_health_metadata_and_config_agree(client: triton.InferenceServerClient) -> None:
    assert client.is_server_live() and client.is_server_ready() and client.is_model_ready(MODEL)
    server = client.get_server_metadata()
    assert server["name"] == "imgserve"
    assert set(server["extensions"]) == {
        "binary_tensor_data",
        "model_configuration",
        "classification",
        "statistics",
        "model_repository",
    }
    metadata = client.get_model_metadata(MODEL)
    assert metadata["inputs"] == [
        {"name": "image", "datatype": "BYTES", "shape": [-1, 1]},
        {"name": "pixels", "datatype": "UINT8", "shape": [-1, -1, -1, 3]},
    ]
    config = client.get_model_config(MODEL, model_version="1")
    assert [i["name"] for i in config["input"]] == [i["name"] for i in metadata["inputs"]]
    assert [o["name"] for o in config["output"]] == [o["name"] for o in metadata["outputs"]]
    assert config["max_batch_size"] == 8 and "dynamic_batching" in config


def test_a_binary_batch_answers_each_image_at_its_size(client: triton.InferenceServerClient) -> None:
    """Images of different sizes in one request: each encoded answer at its size; `output_pixels`, one tensor, cannot
    hold them, so a request that leaves the outputs to the default (all of them) is told to name output_image."""
    sizes = [(64, 48), (33, 71), (120, 90)]
    images = [image_bytes(w, h, fmt, seed=w) for (w, h), fmt in zip(sizes, ["JPEG", "PNG", "WEBP"], strict=True)]
    with pytest.raises(InferenceServerException, match="output_pixels.*share one shape"):
        client.infer(MODEL, [images_input(*images)])
    output = triton.InferRequestedOutput("output_image")
    result = client.infer(MODEL, [images_input(*images)], outputs=[output], request_compression_algorithm="gzip")
    answers = result.as_numpy("output_image")
    assert answers.shape == (3, 1)
    assert [(decoded(a[0]).format, decoded(a[0]).size) for a in answers] == [("JPEG", size) for size in sizes]


def test_json_outputs_carry_base64_in_the_asked_format(client: triton.InferenceServerClient) -> None:
    output = triton.InferRequestedOutput("output_image", binary_data=False)
    result = client.infer(MODEL, [images_input(image_bytes(40, 30))], outputs=[output], parameters={"format": "png"})
    (entry,) = result.get_response()["outputs"]
    assert (entry["datatype"], entry["shape"]) == ("BYTES", [1, 1]) and "parameters" not in entry
    assert decoded(base64.b64decode(entry["data"][0])).format == "PNG"


def test_pixels_in_and_out_match_predict(server: Server, client: triton.InferenceServerClient) -> None:
    """The decoded-pixels input and output give what /predict gives for the same image (PNG, so lossless)."""
    png = image_bytes(48, 32, seed=3)
    pixels = np.stack([np.asarray(decoded(png).convert("RGB"))] * 2)
    tensor = triton.InferInput("pixels", list(pixels.shape), "UINT8")
    tensor.set_data_from_numpy(pixels)
    result = client.infer(MODEL, [tensor], outputs=[triton.InferRequestedOutput("output_pixels")])
    answer = result.as_numpy("output_pixels")
    assert answer.shape == (2, 32, 48, 3) and answer.dtype == np.uint8
    predicted = httpx.post(
        f"{server.url}/predict", content=png, params={"format": "png"}, headers={"Content-Type": "image/png"}
    )
    expected = np.asarray(decoded(predicted.content), dtype=np.int16)
    assert np.abs(answer.astype(np.int16) - expected).max() <= 1  # batched vs alone: rounding at most


def test_each_image_goes_to_the_batcher_on_its_own(server: Server, client: triton.InferenceServerClient) -> None:
    before = server.metric("imgserve_batch_size_sum")
    client.infer(MODEL, [images_input(*[image_bytes(32, 32, seed=i) for i in range(5)])])
    assert server.metric("imgserve_batch_size_sum") - before == 5


def test_a_raw_binary_body_is_one_image_answered_in_binary(server: Server) -> None:
    """extension_binary_data.md, "Raw Binary Request": the body is the model's one input, and the outputs come back
    as binary tensor data after a JSON header of Inference-Header-Content-Length bytes."""
    png = image_bytes(20, 10)
    for body in (png, struct.pack("<I", len(png)) + png):  # as is, or as one serialized BYTES element
        response = httpx.post(f"{server.url}{INFER}", content=body, headers={"Inference-Header-Content-Length": "0"})
        assert response.status_code == 200, response.text
        length = int(response.headers["Inference-Header-Content-Length"])
        header = json.loads(response.content[:length])
        assert header["model_name"] == MODEL and header["outputs"][0]["shape"] == [1, 1]
        assert all("binary_data_size" in output["parameters"] for output in header["outputs"])


def test_unknown_keys_are_ignored_and_the_id_echoed(server: Server) -> None:
    body = {
        "model_name": MODEL,
        "id": "42",
        "inputs": [
            {"name": "image", "datatype": "BYTES", "shape": [1], "data": [base64.b64encode(image_bytes(8, 8)).decode()]}
        ],
    }
    answer = httpx.post(f"{server.url}{INFER}", json=body).json()
    assert answer["id"] == "42" and answer["model_version"] == "1"


def _binary_body(header: dict, blob: bytes) -> tuple[bytes, dict[str, str]]:
    text = json.dumps(header).encode()
    return text + blob, {"Inference-Header-Content-Length": str(len(text))}


def _bytes_input(data: list, datatype: str = "BYTES", shape: list | None = None, **extra: object) -> dict:
    return {
        "inputs": [{"name": "image", "datatype": datatype, "shape": shape or [len(data), 1], "data": data}],
        **extra,
    }


B64 = base64.b64encode(image_bytes(16, 16)).decode()
BIG = base64.b64encode(image_bytes(400, 300, seed=9)).decode()  # decoded in the thread pool (over 32 KiB)
BAD_REQUESTS = {
    "not json": (dict(content=b"{"), 400),
    "no inputs": (dict(json={"inputs": []}), 400),
    "two inputs": (dict(json={"inputs": [_bytes_input([B64])["inputs"][0]] * 2}), 400),
    "unknown input": (dict(json={"inputs": [{"name": "x", "datatype": "BYTES", "shape": [1, 1], "data": [B64]}]}), 400),
    "wrong datatype": (dict(json=_bytes_input([1.5], "FP32")), 400),
    "shape mismatch": (dict(json=_bytes_input([B64], shape=[2, 1])), 400),
    "negative shape": (dict(json=_bytes_input([B64], shape=[-1, 1])), 400),
    "not base64": (dict(json=_bytes_input(["hello world!"])), 400),
    "not ASCII": (dict(json=_bytes_input(["caf\u00e9 au lait"])), 400),
    "not an image": (dict(json=_bytes_input([base64.b64encode(b"hello world").decode()])), 400),
    "unknown output": (dict(json=_bytes_input([B64], outputs=[{"name": "nope"}])), 400),
    "bad format": (dict(json=_bytes_input([B64], parameters={"format": "gif"})), 400),
    "bad timeout": (dict(json=_bytes_input([B64], parameters={"timeout": -5})), 422),
    "classification on images": (
        dict(json=_bytes_input([B64], outputs=[{"name": "output_image", "parameters": {"classification": 2}}])),
        400,
    ),
    "pixels of mixed sizes": (
        dict(
            json=_bytes_input([B64, base64.b64encode(image_bytes(8, 16)).decode()], outputs=[{"name": "output_pixels"}])
        ),
        400,
    ),
    "binary size past the body": (
        dict(
            zip(
                ("content", "headers"),
                _binary_body(
                    {
                        "inputs": [
                            {
                                "name": "image",
                                "datatype": "BYTES",
                                "shape": [1, 1],
                                "parameters": {"binary_data_size": 99},
                            }
                        ]
                    },
                    b"abc",
                ),
                strict=True,
            )
        ),
        400,
    ),
    "header length past the body": (dict(content=b"{}", headers={"Inference-Header-Content-Length": "99"}), 400),
    "unsupported encoding": (dict(content=b"{}", headers={"Content-Encoding": "br"}), 415),
    "broken gzip": (dict(content=gzip.compress(b'{"inputs": []}')[:-8], headers={"Content-Encoding": "gzip"}), 400),
    "too many images": (dict(json=_bytes_input([B64] * 300)), 413),
    "one bad image in a batch": (dict(json=_bytes_input([B64, base64.b64encode(b"hello world").decode(), B64])), 400),
    "one truncated large image in a batch": (dict(json=_bytes_input([BIG, BIG[: len(BIG) // 2], BIG])), 400),
}


@pytest.mark.parametrize("case", BAD_REQUESTS)
def test_bad_requests_get_the_protocols_error(server: Server, case: str) -> None:
    kwargs, status = BAD_REQUESTS[case]
    response = httpx.post(f"{server.url}{INFER}", timeout=30, **kwargs)
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    assert list(response.json()) == ["error"] and isinstance(response.json()["error"], str)
    assert httpx.get(f"{server.url}/v2/health/ready").json() == {"ready": True}
    assert server.slots_freed() and server.metric("imgserve_queue_depth") == 0


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [
        ("GET", "/v2/models/other", 404),
        ("GET", "/v2/models/other/config", 404),
        ("GET", f"/v2/models/{MODEL}/versions/7", 404),
        ("POST", "/v2/models/other/infer", 404),
        ("GET", INFER, 405),
        ("GET", "/v2/nothing/here", 404),
    ],
)
def test_unknown_models_and_routes_answer_the_protocols_error(
    server: Server, method: str, path: str, status: int
) -> None:
    response = httpx.request(method, f"{server.url}{path}", json={"inputs": []})
    assert response.status_code == status
    assert list(response.json()) == ["error"]


def test_shared_memory_is_not_supported(server: Server, client: triton.InferenceServerClient) -> None:
    """reuse_infer_objects_client.py's calls: the shared-memory routes, and a tensor that names a region, answer 501
    with the protocol's error and why; the server stays ready."""
    with pytest.raises(InferenceServerException, match="shared memory is not supported") as caught:
        client.register_system_shared_memory("input0_data", "/input_simple", 64)
    assert caught.value.status() == "501"
    for path in ("/v2/systemsharedmemory/status", "/v2/cudasharedmemory/region/r0/unregister"):
        response = httpx.post(f"{server.url}{path}")
        assert response.status_code == 501 and "not supported" in response.json()["error"]
    tensor = triton.InferInput("image", [1, 1], "BYTES")
    tensor.set_shared_memory("input0_data", 64)
    with pytest.raises(InferenceServerException, match="'image': shared memory is not supported"):
        client.infer(MODEL, [tensor])
    assert client.is_server_ready()


def test_client_sees_the_servers_message(client: triton.InferenceServerClient) -> None:
    with pytest.raises(InferenceServerException, match="not an image"):
        client.infer(MODEL, [images_input(b"hello world")])


def test_v2_routes_have_their_own_metric_labels(server: Server, client: triton.InferenceServerClient) -> None:
    client.infer(MODEL, [images_input(image_bytes(8, 8))])
    client.get_model_metadata(MODEL)
    assert server.metric("imgserve_requests_total", route="/v2/infer", code="200") >= 1
    assert server.metric("imgserve_requests_total", route="/v2", code="200") >= 1
    assert server.metric("imgserve_requests_total", route="other") == 0


def test_classifier_scores_and_the_classification_extension(tmp_path, toy_model) -> None:
    labels = tmp_path / "labels.txt"
    labels.write_text("cat\ndog\nfish\nbird\n")
    with running_server(tmp_path, labels=str(labels), **toy_model("TinyClassifier")) as server:
        client = triton.InferenceServerClient(server.address)
        assert "classification" in client.get_server_metadata()["extensions"]
        images = images_input(image_bytes(16, 16, seed=1), image_bytes(24, 16, seed=2))
        scores = client.infer("TinyClassifier", [images]).as_numpy("scores")
        assert scores.shape == (2, 4) and scores.dtype == np.float32
        assert np.allclose(scores.sum(axis=1), 1, atol=1e-5)
        top = client.infer("TinyClassifier", [images], outputs=[triton.InferRequestedOutput("scores", class_count=2)])
        strings = top.as_numpy("scores")
        assert strings.shape == (2, 2)
        for row, expected in zip(strings, scores, strict=True):
            score, index, label = row[0].decode().split(":")
            best = int(expected.argmax())
            assert int(index) == best and label == ["cat", "dog", "fish", "bird"][best]
            assert float(score) == pytest.approx(expected[best], abs=1e-5)


def test_classification_past_the_class_count_answers_every_class_once(tmp_path, toy_model) -> None:
    """k above the class count: the shape says [N, class count] and the data holds exactly that, binary or JSON."""
    with running_server(tmp_path, **toy_model("TinyClassifier")) as server:
        client = triton.InferenceServerClient(server.address)
        images = images_input(image_bytes(16, 16, seed=1), image_bytes(24, 16, seed=2))
        for binary in (True, False):
            output = triton.InferRequestedOutput("scores", binary_data=binary, class_count=10)
            result = client.infer("TinyClassifier", [images], outputs=[output])
            assert result.get_output("scores")["shape"] == [2, 4]
            top = result.as_numpy("scores")  # reshaped by the answer's shape: fails if the data does not fit it
            assert top.shape == (2, 4)
            for row in top:
                texts = [entry.decode() if isinstance(entry, bytes) else entry for entry in row]  # JSON: str
                scores, indices = zip(*(text.split(":") for text in texts), strict=True)
                assert sorted(map(int, indices)) == [0, 1, 2, 3]
                assert list(map(float, scores)) == sorted(map(float, scores), reverse=True)


def test_segmentation_answers_a_mask_per_image(tmp_path, toy_model) -> None:
    with running_server(tmp_path, task="segment", **toy_model("TinySegmenter")) as server:
        client = triton.InferenceServerClient(server.address)
        pixels = np.zeros((2, 6, 9, 3), dtype=np.uint8)
        pixels[0, ..., 1] = 255  # all green: class 1
        pixels[1, ..., 2] = 255  # all blue: class 2
        tensor = triton.InferInput("pixels", list(pixels.shape), "UINT8")
        tensor.set_data_from_numpy(pixels)
        mask = client.infer("TinySegmenter", [tensor]).as_numpy("mask")
        assert mask.shape == (2, 6, 9) and mask.dtype == np.uint8
        assert (mask[0] == 1).all() and (mask[1] == 2).all()


def test_detections_come_with_a_count_per_image(tmp_path, toy_model) -> None:
    with running_server(tmp_path, **toy_model("TinyDetector")) as server:
        client = triton.InferenceServerClient(server.address)
        images = images_input(image_bytes(40, 20), image_bytes(20, 40))
        result = client.infer("TinyDetector", [images])
        assert result.as_numpy("count").tolist() == [[1], [1]]
        assert result.as_numpy("boxes").tolist() == [[[0, 0, 20, 10]], [[0, 0, 10, 20]]]
        assert result.as_numpy("labels").tolist() == [[1], [1]]
        every = client.infer("TinyDetector", [images], parameters={"score_threshold": 0.05})
        assert every.as_numpy("count").tolist() == [[2], [2]] and every.as_numpy("scores").shape == (2, 2)
