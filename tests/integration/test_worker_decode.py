"""Uploads decoded in the worker, next to their batch, on a CPU (the path a GPU takes with nvJPEG, here with the
CPU decoder): the built-in model with `decode_in: worker` answers exactly what the front-end decode answers, for
JPEG, PNG and WebP in one batch, with a corrupt JPEG answered 400 alone; over v2 too; and a user's ImageAPI that
leaves its uploads encoded gets them decoded in `batch`."""

from __future__ import annotations

import io
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
from PIL import Image
from serving import image_bytes, running_server

MIXED = [image_bytes(300, 220, "JPEG", 1), image_bytes(180, 240, "PNG", 2), image_bytes(256, 256, "WEBP", 3)]
TYPES = {"JPEG": "image/jpeg", "PNG": "image/png", "WEBP": "image/webp"}


def corrupt_jpeg() -> bytes:
    """Its header is sound (the front end takes it), its scan is cut short (the decode fails)."""
    data = image_bytes(120, 90, "JPEG", 4)
    return data[: data.index(b"\xff\xda") + 20]


def kind(data: bytes) -> str:
    return TYPES[Image.open(io.BytesIO(data)).format]


def answers(url: str, uploads: list[bytes]) -> list[tuple[int, bytes]]:
    """All uploads posted at once (so that they share batches): each answer's status and body."""

    def post(data: bytes) -> tuple[int, bytes]:
        answer = httpx.post(f"{url}/predict?format=png", content=data, headers={"Content-Type": kind(data)}, timeout=60)
        return answer.status_code, answer.content

    with ThreadPoolExecutor(len(uploads)) as pool:
        return list(pool.map(post, uploads))


def test_the_built_in_model_decoding_in_the_worker_answers_as_the_front_end_decode(tmp_path: Path) -> None:
    """ImageNet preprocessing (resize 256, crop 224) done in the worker: the same PNG answers, byte for byte, as a
    server that decodes in its front ends; the corrupt JPEG 400 and the rest of its batch 200. The corrupt JPEG
    passes the front end's header check and fails in the worker (the front-end decode stops it before)."""
    uploads = [*MIXED, corrupt_jpeg(), *MIXED]
    settings = {"preprocess": "imagenet", "max_batch_size": 8, "batch_timeout_ms": 200, "workers_per_device": 1}
    settings["compile"] = False  # the decode is under test; compiling is test_compiled.py's
    with running_server(tmp_path, decode_in="worker", **settings) as worker:
        in_worker = answers(worker.url, uploads)
        batches = worker.metric("imgserve_batch_size_count")
        batched_items = worker.metric("imgserve_batch_size_sum")
        v2 = httpx.post(
            f"{worker.url}/v2/models/denoiser/infer",
            json={"inputs": [{"name": "pixels", "datatype": "UINT8", "shape": [1, 8, 8, 3], "data": [7] * 192}]},
            timeout=30,
        )
    with running_server(tmp_path, decode_in="front-end", **settings) as front_end:
        in_front_end = answers(front_end.url, uploads)
        reached_the_worker = front_end.metric("imgserve_batch_size_sum")
    statuses = [status for status, _ in in_worker]
    assert statuses == [200, 200, 200, 400, 200, 200, 200], statuses
    assert b"corrupt_image" in in_worker[3][1]
    assert in_worker == in_front_end, "decoding in the worker changed an answer"
    assert Image.open(io.BytesIO(in_worker[0][1])).size == (224, 224)
    assert batched_items > batches, "no two uploads shared a batch"
    assert (batched_items, reached_the_worker) == (7, 6), "the corrupt JPEG is found in the worker, not before"
    assert v2.status_code == 200, v2.text  # decoded pixels (v2 `pixels`) still taken as they are


def test_a_user_api_that_leaves_its_uploads_encoded_gets_them_decoded_in_batch(tmp_path: Path) -> None:
    with running_server(tmp_path, api="user_apis:DecodedInWorker", max_batch_size=4, batch_timeout_ms=100) as server:
        got = answers(server.url, [MIXED[0], MIXED[1], corrupt_jpeg()])
    (first_status, first), (second_status, second), (bad_status, _) = got
    assert (first_status, second_status, bad_status) == (200, 200, 400)
    described = httpx.Response(200, content=first).json()
    expected = np.asarray(Image.open(io.BytesIO(MIXED[0])).convert("RGB"))
    assert described["type"] == "Tensor" and described["shape"] == [220, 300, 3]
    assert abs(described["mean"] - float(expected.mean())) < 1e-3
    assert httpx.Response(200, content=second).json()["shape"] == [240, 180, 3]
