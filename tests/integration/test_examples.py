"""The APIs in examples/ run: each is served by a real `imgserve serve --api examples.<module>:<Class>`, and the
model repository examples/repository by `imgserve serve --model-repository`, and answered end to end by real clients
(httpx; Triton's HTTP client for the Open Inference Protocol), as docs/custom-api.md and docs/several-models.md show
them."""

from __future__ import annotations

import io
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
import tritonclient.http as triton
from PIL import Image
from serving import REPO, Server, image_bytes, running_server

from imgserve import Request
from imgserve.testing import InProcess


def serve_example(factory: pytest.TempPathFactory, api: str, **settings: object) -> Iterator[Server]:
    with running_server(factory.mktemp("logs"), api=api, **settings) as server:
        yield server


def predict(server: Server, **request: Any) -> httpx.Response:
    return httpx.post(f"{server.url}/predict", timeout=60, **request)


def upload(data: bytes, name: str = "photo.png", kind: str = "image/png") -> dict[str, Any]:
    return {"file": (name, data, kind)}


# The embedding API: a transformers ViT with seeded random weights


@pytest.fixture(scope="module")
def embedding_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from serve_example(tmp_path_factory, "examples.embedding:EmbeddingAPI", batch_timeout_ms=20)


def test_embedding_over_predict_is_the_models_vector(embedding_server: Server) -> None:
    """Each image's answer is a unit vector of the model's width, the same from every worker and the same as the
    API computes in this process (the weights come from a seed, nothing is downloaded)."""
    from examples.embedding import CONFIG, EmbeddingAPI

    images = [image_bytes(w, h, seed=w) for w, h in [(80, 50), (64, 64), (33, 120)]]
    with ThreadPoolExecutor(6) as pool:  # twice each, concurrently: batched together, on either worker
        responses = list(pool.map(lambda data: predict(embedding_server, files=upload(data)), images * 2))
    assert [response.status_code for response in responses] == [200] * 6
    vectors = np.array([response.json()["embedding"] for response in responses], dtype=np.float32)
    assert vectors.shape == (6, CONFIG.hidden_size)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, rtol=1e-5)
    np.testing.assert_allclose(vectors[:3], vectors[3:], atol=1e-5)
    assert np.abs(vectors[0] - vectors[1]).max() > 1e-3  # different images, different vectors
    here = InProcess(EmbeddingAPI()).setup().run([Request(body=data, content_type="image/png") for data in images])
    np.testing.assert_allclose(vectors[:3], [answer["embedding"] for answer in here], atol=1e-5)


def test_embedding_over_v2_is_a_declared_fp32_tensor(embedding_server: Server) -> None:
    """Triton's client sees the declared tensors in the metadata, and gets one FP32 [N, D] tensor for N images,
    equal to what /predict answers for each."""
    client = triton.InferenceServerClient(embedding_server.address, network_timeout=60)
    metadata = client.get_model_metadata("embedding")
    assert metadata["inputs"] == [{"name": "image", "datatype": "BYTES", "shape": [-1, 1]}]
    assert metadata["outputs"] == [{"name": "embedding", "datatype": "FP32", "shape": [-1, 64]}]
    images = [image_bytes(w, h, seed=w) for w, h in [(80, 50), (64, 64), (33, 120)]]
    tensor = triton.InferInput("image", [len(images), 1], "BYTES")
    tensor.set_data_from_numpy(np.array([[data] for data in images], dtype=object))
    embeddings = client.infer("embedding", [tensor]).as_numpy("embedding")
    assert embeddings.shape == (3, 64) and embeddings.dtype == np.float32
    over_http = [predict(embedding_server, files=upload(data)).json()["embedding"] for data in images]
    np.testing.assert_allclose(embeddings, over_http, atol=1e-5)


# The detector: letterbox, a conv head, NMS in torch, boxes mapped back to the upload


@pytest.fixture(scope="module")
def detector_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from serve_example(tmp_path_factory, "examples.detector:DetectorAPI")


@pytest.mark.parametrize("size", [(600, 240), (150, 400), (320, 320)], ids=["landscape", "portrait", "square"])
def test_detections_lie_inside_the_upload(detector_server: Server, size: tuple[int, int]) -> None:
    from examples.detector import CLASSES, SCORE_THRESHOLD

    width, height = size
    response = predict(detector_server, files=upload(image_bytes(width, height, "JPEG", seed=1), "a.jpg", "image/jpeg"))
    assert response.status_code == 200, response.text
    answer = response.json()
    assert (answer["width"], answer["height"]) == size
    detections = answer["detections"]
    assert detections, "the seeded head finds something in every test image"
    for found in detections:
        left, top, right, bottom = found["box"]
        assert 0 <= left < right <= width and 0 <= top < bottom <= height, found
        assert SCORE_THRESHOLD < found["score"] <= 1 and found["class"] in range(CLASSES)
    scores = [found["score"] for found in detections]
    assert scores == sorted(scores, reverse=True)


def test_boxes_are_mapped_back_from_the_letterbox(detector_server: Server) -> None:
    """A 600x240 upload is scaled by 320/600 and padded by (320 - 128) / 2 = 96 rows on top: the served boxes are
    the model's letterbox boxes, unpadded, unscaled and clipped to the upload (computed here from the model's raw
    output, not by the example's own encode_response)."""
    from examples.detector import DetectorAPI

    data = image_bytes(600, 240, seed=2)
    api = DetectorAPI()
    runner = InProcess(api).setup()
    (raw,) = runner.predict([api.decode_request(Request(body=data, content_type="image/png"))])
    scale, offset = 320 / 600, np.array([0, 96, 0, 96])
    boxes = ((raw[:, :4] - offset) / scale).clip(0, [600, 240, 600, 240])
    visible = (boxes[:, 2] > boxes[:, 0]) & (boxes[:, 3] > boxes[:, 1])
    served = predict(detector_server, files=upload(data)).json()["detections"]
    assert len(served) == visible.sum() > 0
    np.testing.assert_allclose([found["box"] for found in served], boxes[visible], atol=0.06)
    assert [found["class"] for found in served] == raw[visible, 5].astype(int).tolist()


def test_nms_keeps_what_torchvision_keeps() -> None:
    """Greedy NMS: B overlaps A (IoU 0.54) and goes; C overlapped only B, which is gone, so C stays; D is apart."""
    from examples.detector import nms

    boxes = torch.tensor([[0, 0, 10, 10], [3, 0, 13, 10], [6, 0, 16, 10], [50, 50, 60, 60]], dtype=torch.float32)
    scores = torch.tensor([0.9, 0.8, 0.7, 0.95])
    assert nms(boxes, scores, 0.45).tolist() == [3, 0, 2]
    assert nms(boxes[:0], scores[:0], 0.45).tolist() == []


def test_the_detector_over_v2_answers_the_predict_json(detector_server: Server) -> None:
    """An API that declares no tensors takes one encoded image and answers one BYTES output: its /predict JSON."""
    import json

    data = image_bytes(200, 100, seed=4)
    tensor = triton.InferInput("image", [1, 1], "BYTES")
    tensor.set_data_from_numpy(np.array([[data]], dtype=object))
    client = triton.InferenceServerClient(detector_server.address, network_timeout=60)
    ((answer,),) = client.infer("detector", [tensor]).as_numpy("output")
    assert json.loads(answer) == predict(detector_server, files=upload(data)).json()


# Request fields validated with pydantic: a threshold and a crop box


@pytest.fixture(scope="module")
def fields_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from serve_example(tmp_path_factory, "examples.fields:FieldsAPI", batch_timeout_ms=20)


def expected_fields(data: bytes, threshold: float, box: tuple[int, ...]) -> dict[str, Any]:
    pixels = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"), dtype=np.float64)[box[1] : box[3], box[0] : box[2]]
    pixels /= 255
    luma = pixels @ np.array([0.299, 0.587, 0.114])
    return {"bright_fraction": float((luma > threshold).mean()), "mean_rgb": pixels.mean(axis=(0, 1)).tolist()}


def assert_fields_answer(answer: dict[str, Any], data: bytes, threshold: float, box: tuple[int, ...]) -> None:
    assert (answer["threshold"], answer["box"]) == (threshold, list(box))
    expected = expected_fields(data, threshold, box)
    assert answer["bright_fraction"] == pytest.approx(expected["bright_fraction"], abs=2e-3)
    assert answer["mean_rgb"] == pytest.approx(expected["mean_rgb"], abs=1e-5)


def test_fields_from_the_form_or_the_query(fields_server: Server) -> None:
    data = image_bytes(160, 120, seed=5)
    form = predict(fields_server, files=upload(data), data={"threshold": "0.4", "box": "10,20,110,80"})
    assert form.status_code == 200, form.text
    assert_fields_answer(form.json(), data, 0.4, (10, 20, 110, 80))
    query = predict(
        fields_server,
        content=data,
        headers={"content-type": "image/png"},
        params={"threshold": "0.4", "box": "[10, 20, 110, 80]"},
    )
    assert query.json() == form.json()
    default = predict(fields_server, files=upload(data), params={"threshold": "0.9"}, data={"threshold": "0.2"})
    assert_fields_answer(default.json(), data, 0.2, (0, 0, 160, 120))  # the form wins; no box: the whole image


def test_each_request_of_a_batch_keeps_its_own_fields(fields_server: Server) -> None:
    """Eight concurrent crops of one shape, batched together: each answered for its own threshold and box."""
    data = image_bytes(200, 100, seed=6)
    asks = [(0.1 * (index + 1), (index * 10, 0, index * 10 + 64, 48)) for index in range(8)]

    def ask(threshold: float, box: tuple[int, ...]) -> httpx.Response:
        return predict(fields_server, files=upload(data), data={"threshold": str(threshold), "box": str(list(box))})

    with ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(lambda pair: ask(*pair), asks))
    for (threshold, box), response in zip(asks, responses, strict=True):
        assert response.status_code == 200, response.text
        assert_fields_answer(response.json(), data, threshold, box)


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"threshold": "1.5"}, "threshold"),
        ({"threshold": "bright"}, "threshold"),
        ({"box": "1,2,3"}, "box"),
        ({"box": "50,0,10,10"}, "box"),
        ({"box": "0,0,500,50"}, "box"),  # outside the 160x120 image
        ({"treshold": "0.5"}, "treshold"),  # a misspelt field
    ],
)
def test_bad_fields_are_422_and_the_server_stays_healthy(
    fields_server: Server, fields: dict[str, str], named: str
) -> None:
    response = predict(fields_server, files=upload(image_bytes(160, 120)), data=fields)
    assert response.status_code == 422
    error = response.json()["error"]
    assert error["code"] == "invalid_fields" and error["message"].startswith(named), error
    assert httpx.get(f"{fields_server.url}/health/ready").status_code == 200
    assert predict(fields_server, files=upload(image_bytes(160, 120))).status_code == 200


# Plain LitServe APIs, served unchanged


def test_the_plain_litserve_api(tmp_path: Path) -> None:
    with running_server(tmp_path, api="examples.litserve_api:InferencePipeline") as server:
        response = predict(server, json={"input": 4.0})
    assert (response.status_code, response.json()) == (200, {"output": 80.0})


def test_the_plain_litserve_image_api(tmp_path: Path) -> None:
    data = image_bytes(90, 60, seed=7)
    with running_server(tmp_path, api="examples.litserve_api:GrayscaleLitAPI") as server:
        response = predict(server, files=upload(data))
        not_an_image = predict(server, files=upload(b"plain text", "notes.txt", "text/plain"))
    assert (response.status_code, response.headers["content-type"]) == (200, "image/png")
    gray = np.asarray(Image.open(io.BytesIO(response.content)))
    rgb = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"), dtype=np.float64)
    np.testing.assert_allclose(gray, (rgb @ [0.299, 0.587, 0.114]).round(), atol=1)
    assert (not_an_image.status_code, not_an_image.json()) == (400, {"detail": "file is not an image"})


# A model repository: a detector, a classifier and an embedder in one server


REPOSITORY = REPO / "examples" / "repository"


@pytest.fixture(scope="module")
def repository_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """`imgserve serve --model-repository examples/repository`, one worker and one front end (light on a CPU)."""
    with running_server(
        tmp_path_factory.mktemp("logs"), model_repository=str(REPOSITORY), workers_per_device=1, api_servers=1
    ) as server:
        yield server


def test_the_repository_serves_each_model_at_its_own_path(repository_server: Server) -> None:
    """Each folder is a model named by it, answering at its config's api_path (none at /predict), READY in /info
    and counted under its own name in the metrics."""
    data = image_bytes(120, 90, seed=8)
    models = {m["name"]: m for m in httpx.get(f"{repository_server.url}/info", timeout=10).json()["models"]}
    assert {name: (m["path"], m["state"]) for name, m in models.items()} == {
        "classifier": ("/classifier/predict", "READY"),
        "detector": ("/detector/predict", "READY"),
        "embedder": ("/embedder/predict", "READY"),
    }
    assert (models["detector"]["max_batch_size"], models["classifier"]["max_batch_size"]) == (4, 8)
    url = repository_server.url
    detected = httpx.post(f"{url}/detector/predict", files=upload(data), timeout=60)
    assert detected.status_code == 200 and (detected.json()["width"], detected.json()["height"]) == (120, 90)
    classified = httpx.post(f"{url}/classifier/predict", files=upload(data), params={"top_k": "2"}, timeout=60)
    assert classified.status_code == 200, classified.text
    top = classified.json()["top_k"]
    assert [t["label"] for t in top] == [("cat", "dog", "bird", "car", "tree")[t["index"]] for t in top]
    assert len(top) == 2 and top[0]["score"] >= top[1]["score"] > 0
    embedded = httpx.post(f"{url}/embedder/predict", files=upload(data), timeout=60)
    assert embedded.status_code == 200 and len(embedded.json()["embedding"]) == 64
    assert httpx.post(f"{url}/predict", files=upload(data), timeout=60).status_code == 404
    bad = httpx.post(f"{url}/classifier/predict", files=upload(data), params={"top_k": "9"}, timeout=60)
    assert bad.status_code == 422 and bad.json()["error"]["code"] == "invalid_top_k"
    for name in models:
        route = models[name]["path"]
        assert repository_server.metric("imgserve_requests_total", route=route, code="200", model=name) >= 1


def test_the_repository_over_v2(repository_server: Server) -> None:
    """Triton's client sees the three models in the repository index and gets from each, under the folder's name,
    what its path answers: the detector's JSON, the classifier's FP32 scores (and its labels through the
    classification extension), the embedder's vector."""
    import json

    client = triton.InferenceServerClient(repository_server.address, network_timeout=60)
    index = client.get_model_repository_index()
    assert {(m["name"], m["state"]) for m in index} == {
        ("classifier", "READY"),
        ("detector", "READY"),
        ("embedder", "READY"),
    }
    data = image_bytes(100, 70, seed=9)
    tensor = triton.InferInput("image", [1, 1], "BYTES")
    tensor.set_data_from_numpy(np.array([[data]], dtype=object))
    url = repository_server.url

    def over_http(model: str, **params: str) -> Any:
        return httpx.post(f"{url}/{model}/predict", files=upload(data), params=params, timeout=60).json()

    ((detections,),) = client.infer("detector", [tensor]).as_numpy("output")
    assert json.loads(detections) == over_http("detector")
    assert client.get_model_metadata("classifier")["outputs"] == [
        {"name": "scores", "datatype": "FP32", "shape": [-1, 5]}
    ]
    (scores,) = client.infer("classifier", [tensor]).as_numpy("scores")
    assert scores.sum() == pytest.approx(1, abs=1e-5)
    top = over_http("classifier", top_k="5")["top_k"]
    np.testing.assert_allclose([scores[t["index"]] for t in top], [t["score"] for t in top], atol=1e-4)
    asked = triton.InferRequestedOutput("scores", class_count=2)
    ((best, second),) = client.infer("classifier", [tensor], outputs=[asked]).as_numpy("scores")
    assert best.decode().split(":")[1:] == [str(top[0]["index"]), top[0]["label"]]
    assert second.decode().split(":")[2] == top[1]["label"]
    (embedding,) = client.infer("embedder", [tensor]).as_numpy("embedding")
    np.testing.assert_allclose(embedding, over_http("embedder")["embedding"], atol=1e-5)
    assert not client.is_model_ready("embedding")  # the folder's name, not the class's


def test_the_served_classifier_is_the_folders_module(
    repository_server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The classifier answers the probabilities its module computes in this process (seeded weights, nothing
    downloaded), for images batched together."""
    monkeypatch.syspath_prepend(str(REPOSITORY / "classifier"))
    from classifier_api import ClassifierAPI

    images = [image_bytes(w, h, seed=w) for w, h in [(80, 50), (64, 64), (33, 120)]]
    requests = [Request(body=data, content_type="image/png", query={"top_k": "5"}) for data in images]
    here = InProcess(ClassifierAPI()).setup().run(requests)
    with ThreadPoolExecutor(3) as pool:
        served = list(
            pool.map(
                lambda data: httpx.post(
                    f"{repository_server.url}/classifier/predict", files=upload(data), params={"top_k": "5"}, timeout=60
                ).json(),
                images,
            )
        )
    for mine, theirs in zip(here, served, strict=True):
        expected = {t["index"]: t["score"] for t in mine["top_k"]}
        assert {t["index"]: t["score"] for t in theirs["top_k"]} == pytest.approx(expected, abs=2e-4)
