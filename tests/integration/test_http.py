"""The HTTP contract against a real server: round trips, formats, batching of mixed sizes, and every bad input."""

from __future__ import annotations

import io
import random
import re
import struct
import zlib
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from PIL import Image
from serving import Server, image_bytes

from imgserve.config import MAX_CPU_WORKERS
from imgserve.pod import usable_cpus

SIZES = [(64, 48), (96, 96), (128, 80), (33, 71), (160, 120), (48, 64), (100, 100), (17, 23)]


def post(server: Server, content: bytes | None = None, *, files=None, params=None, headers=None) -> httpx.Response:
    return httpx.post(f"{server.url}/predict", content=content, files=files, params=params, headers=headers, timeout=60)


def error_code(response: httpx.Response) -> str:
    return response.json()["error"]["code"]


def test_multipart_jpeg_round_trip_keeps_size(server: Server) -> None:
    response = post(server, files={"file": ("photo.jpg", image_bytes(120, 90, "JPEG"), "image/jpeg")})
    assert response.status_code == 200
    assert response.headers["content-type"] == "image/jpeg"
    image = Image.open(io.BytesIO(response.content))
    assert (image.format, image.size) == ("JPEG", (120, 90))


@pytest.mark.parametrize(
    ("params", "accept", "expected"),
    [
        ({"format": "png"}, None, "PNG"),
        ({"format": "webp"}, None, "WEBP"),
        ({}, "image/png", "PNG"),
        ({}, "text/html, image/webp;q=0.9", "WEBP"),
        ({}, "*/*", "JPEG"),
    ],
)
def test_output_format_by_query_or_accept(server: Server, params: dict, accept: str | None, expected: str) -> None:
    headers = {"Content-Type": "image/png", **({"Accept": accept} if accept else {})}
    response = post(server, image_bytes(64, 64), params=params, headers=headers)
    assert response.status_code == 200
    assert Image.open(io.BytesIO(response.content)).format == expected


def test_raw_body_and_v1_alias(server: Server) -> None:
    response = httpx.post(
        f"{server.url}/v1/images:predict", content=image_bytes(50, 40), headers={"Content-Type": "image/png"}
    )
    assert response.status_code == 200
    assert Image.open(io.BytesIO(response.content)).size == (50, 40)


def test_denoises_over_http(server: Server) -> None:
    """The served model really restores: its answer is closer to the clean image than the noisy upload."""
    import numpy as np

    from imgserve.models.synthetic import add_noise, clean_image, psnr

    rng = np.random.default_rng(7)
    clean = clean_image(rng, 96, 128)
    noisy = (add_noise(rng, clean, 0.1) * 255).round().astype("uint8")
    buffer = io.BytesIO()
    Image.fromarray(noisy).save(buffer, format="PNG")
    response = post(server, buffer.getvalue(), params={"format": "png"}, headers={"Content-Type": "image/png"})
    denoised = np.asarray(Image.open(io.BytesIO(response.content)), dtype=np.float32) / 255
    assert psnr(denoised, clean) > psnr(noisy / 255.0, clean) + 3


def test_concurrent_mixed_sizes_all_succeed_and_are_batched(server: Server) -> None:
    batches_before = server.metric("imgserve_batch_size_count")
    images_before = server.metric("imgserve_batch_size_sum")
    jobs = [SIZES[i % len(SIZES)] for i in range(48)]

    def one(size: tuple[int, int]) -> tuple[int, tuple[int, int]]:
        response = post(server, image_bytes(*size, seed=size[0]), headers={"Content-Type": "image/png"})
        return response.status_code, Image.open(io.BytesIO(response.content)).size

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, jobs))
    assert results == [(200, size) for size in jobs]
    batches = server.metric("imgserve_batch_size_count") - batches_before
    images = server.metric("imgserve_batch_size_sum") - images_before
    assert images == len(jobs)
    assert batches < len(jobs), "no two requests ever shared a batch"


def _png_header_only(width: int, height: int) -> bytes:
    """A PNG that declares huge dimensions (a decompression bomb) with almost no data."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


BAD_INPUTS = {
    "empty body": (dict(content=b"", headers={"Content-Type": "image/png"}), 400, "empty_body"),
    "not an image": (dict(content=b"hello world" * 10, headers={"Content-Type": "image/jpeg"}), 400, "not_an_image"),
    "truncated jpeg": (
        dict(content=image_bytes(200, 150, "JPEG")[:1500], headers={"Content-Type": "image/jpeg"}),
        400,
        "corrupt_image",
    ),
    "unsupported content type": (
        dict(content=b'{"a": 1}', headers={"Content-Type": "application/json"}),
        415,
        "unsupported_media_type",
    ),
    "unsupported image type": (
        dict(content=image_bytes(32, 32, "ICO"), headers={"Content-Type": "image/x-icon"}),
        415,
        "unsupported_image_type",
    ),
    "decompression bomb": (
        dict(content=_png_header_only(50_000, 50_000), headers={"Content-Type": "image/png"}),
        413,
        "image_too_large",
    ),
    "over the pixel limit": (
        dict(content=image_bytes(1200, 1000), headers={"Content-Type": "image/png"}),
        413,
        "image_too_large",
    ),
    "oversized body": (
        dict(content=b"\xff" * 2_500_000, headers={"Content-Type": "image/jpeg"}),
        413,
        "body_too_large",
    ),
    "wrong field name": (dict(files={"image": ("a.png", image_bytes(8, 8), "image/png")}), 422, "missing_file"),
    "bad format": (
        dict(content=image_bytes(8, 8), headers={"Content-Type": "image/png"}, params={"format": "gif"}),
        422,
        "bad_parameters",
    ),
    "unknown parameter": (
        dict(content=image_bytes(8, 8), headers={"Content-Type": "image/png"}, params={"size": "3"}),
        422,
        "bad_parameters",
    ),
    "bad timeout header": (
        dict(content=image_bytes(8, 8), headers={"Content-Type": "image/png", "X-Request-Timeout": "soon"}),
        422,
        "bad_timeout",
    ),
}


@pytest.mark.parametrize("case", BAD_INPUTS, ids=list(BAD_INPUTS))
def test_bad_input_gets_clear_4xx_and_server_stays_healthy(server: Server, case: str) -> None:
    kwargs, status, code = BAD_INPUTS[case]
    response = post(server, **kwargs)
    assert (response.status_code, error_code(response)) == (status, code)
    assert response.json()["error"]["message"]
    assert httpx.get(f"{server.url}/health/ready").status_code == 200
    assert post(server, image_bytes(16, 16), headers={"Content-Type": "image/png"}).status_code == 200


def test_chunked_body_over_limit_is_413(server: Server) -> None:
    def chunks():
        for _ in range(40):
            yield b"\xff" * 100_000

    response = httpx.post(f"{server.url}/predict", content=chunks(), headers={"Content-Type": "image/jpeg"})
    assert (response.status_code, error_code(response)) == (413, "body_too_large")


PNG = {"Content-Type": "image/png"}
UNCLOSED_MULTIPART = b'--XyZ\r\nContent-Disposition: form-data; name="file"; filename="a.png"\r\n\r\n'
# Each kind of bad input the suite sends, varied by a random generator: (rng, a valid image) -> post()'s arguments.
BAD_KINDS: dict[str, Callable[[random.Random, bytes], dict[str, Any]]] = {
    "truncated": lambda rng, image: dict(content=image[: rng.randrange(len(image) // 2)], headers=PNG),
    "corrupt": lambda rng, image: dict(content=rng.randbytes(rng.randint(1, 4096)), headers=PNG),
    "empty": lambda rng, image: dict(content=b"", headers={"Content-Type": rng.choice(["image/png", "image/jpeg"])}),
    "wrong type": lambda rng, image: dict(
        content=image, headers={"Content-Type": rng.choice(["application/json", "text/plain", "application/xml"])}
    ),
    "unsupported image type": lambda rng, image: dict(
        content=image_bytes(rng.randint(8, 64), rng.randint(8, 64), "ICO"), headers={"Content-Type": "image/x-icon"}
    ),
    "bomb": lambda rng, image: dict(
        content=_png_header_only(rng.randint(20_000, 65_535), rng.randint(20_000, 65_535)), headers=PNG
    ),
    "unclosed multipart": lambda rng, image: dict(
        content=UNCLOSED_MULTIPART + image[: rng.randrange(len(image))],
        headers={"Content-Type": "multipart/form-data; boundary=XyZ"},
    ),
    "wrong multipart field": lambda rng, image: dict(
        files={rng.choice(["image", "upload", "files"]): ("a.png", image, "image/png")}
    ),
    "bad format": lambda rng, image: dict(
        content=image, headers=PNG, params={"format": rng.choice(["gif", "bmp", "jpeg2000", ""])}
    ),
    "unknown parameter": lambda rng, image: dict(
        content=image, headers=PNG, params={rng.choice(["size", "scale", "model"]): "3"}
    ),
    "bad timeout": lambda rng, image: dict(
        content=image, headers={**PNG, "X-Request-Timeout": rng.choice(["soon", "-1", "nan"])}
    ),
}


def test_no_bad_input_reached_a_500(server: Server) -> None:
    """A seeded spread of every kind of bad input gets only 4xx answers, each counted by the server under its code,
    and the server has counted no 500 (from these or from any other test's requests before them)."""
    rng = random.Random(38)
    kinds = [kind for kind in BAD_KINDS for _ in range(2)]
    rng.shuffle(kinds)

    def counted(code: str) -> float:
        return server.metric("imgserve_requests_total", route="/predict", code=code)

    before = {code: counted(code) for code in ("400", "413", "415", "422")}
    answers: Counter[str] = Counter()
    for kind in kinds:
        image = image_bytes(rng.randint(8, 96), rng.randint(8, 96), rng.choice(["PNG", "JPEG"]), rng.randrange(99))
        answers[str(post(server, **BAD_KINDS[kind](rng, image)).status_code)] += 1
    assert set(answers) <= set(before), f"answers other than {sorted(before)}: {answers}"
    assert {code: counted(code) - before[code] for code in answers} == answers
    assert counted("500") == 0


def test_health_info_and_metrics(server: Server) -> None:
    assert httpx.get(f"{server.url}/health/live").json() == {"status": "alive"}
    assert httpx.get(f"{server.url}/health").status_code == 200
    info = httpx.get(f"{server.url}/info").json()
    assert info["model"] == "builtin:denoiser"
    assert (info["device"], info["precision"], info["max_batch_size"]) == ("cpu", "fp32", 8)
    assert info["batch_element_budget"] > 0
    assert server.metric("imgserve_model_info", model="denoiser", source="builtin:denoiser", device="cpu") == 1


def test_cpu_workers_may_each_use_twice_their_share_of_the_cores_and_wait_passively(server: Server) -> None:
    info = httpx.get(f"{server.url}/info").json()
    workers, threads, busy = (
        info["workers"],
        info["torch_threads_per_worker"],
        info["torch_threads_per_worker_under_load"],
    )
    assert workers == min(usable_cpus(), MAX_CPU_WORKERS)
    assert threads == min(usable_cpus(), 2 * max(1, usable_cpus() // workers))
    assert busy == max(1, usable_cpus() // workers)
    applied = re.findall(r"worker ready on cpu \((\d+) torch threads, (\d+) while", server.log())
    assert [(int(t), int(b)) for t, b in applied] == [(threads, busy)] * workers
    for pid in server.worker_pids():
        environment = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        assert b"OMP_WAIT_POLICY=PASSIVE" in environment, "a worker's OpenMP threads would spin on the others' cores"
