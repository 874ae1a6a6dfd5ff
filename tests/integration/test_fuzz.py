"""Mutation fuzz of every accepted image format against one real server: any bytes get 200, 400, 413 or 415."""

from __future__ import annotations

import base64
import copy
import gzip
import io
import json
import random
import re
import struct
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
from PIL import Image
from serving import Server, running_server

SEED, CASES, BUDGET_S = 14, 4000, 60
ALLOWED = {200, 400, 413, 415}


def seeds() -> dict[str, bytes]:
    """Small valid images of each accepted format and of the modes and codecs that take other decoder paths."""
    rng = np.random.default_rng(SEED)
    rgb = Image.fromarray(rng.integers(0, 256, (24, 32, 3), dtype=np.uint8))
    out: dict[str, bytes] = {}

    def save(name: str, image: Image.Image, fmt: str, **options: object) -> None:
        buffer = io.BytesIO()
        image.save(buffer, format=fmt, **options)
        out[name] = buffer.getvalue()

    save("jpeg", rgb, "JPEG", quality=80)
    save("jpeg-progressive", rgb, "JPEG", progressive=True)
    save("jpeg-cmyk", rgb.convert("CMYK"), "JPEG")
    save("png", rgb, "PNG")
    save("png-palette-alpha", rgb.convert("P"), "PNG", transparency=0)
    save("png-16bit", Image.fromarray(np.asarray(rgb.convert("L"), dtype=np.uint16) * 257), "PNG")
    save("webp", rgb, "WEBP", quality=70)
    save("webp-lossless", rgb.convert("RGBA"), "WEBP", lossless=True)
    save("bmp", rgb, "BMP")
    save("bmp-rle", rgb.convert("P"), "BMP")
    save("gif", rgb.convert("P"), "GIF")
    save("gif-animated", rgb.convert("P"), "GIF", save_all=True, append_images=[rgb.rotate(90).convert("P")])
    save("tiff", rgb, "TIFF")
    save("tiff-lzw", rgb, "TIFF", compression="tiff_lzw")
    save("tiff-deflate", rgb.convert("L"), "TIFF", compression="tiff_adobe_deflate")
    return out


def mutate(data: bytes, rng: random.Random) -> bytes:
    """One mutation: a cut, overwritten header bytes, bit flips, a duplicated or removed slice, or a size field."""
    kind = rng.randrange(6)
    buffer = bytearray(data)
    if kind == 0:
        return bytes(buffer[: rng.randrange(len(buffer))])
    if kind == 1:  # header fields: sizes, depths, offsets, codes live in the first bytes
        for _ in range(rng.randint(1, 4)):
            buffer[rng.randrange(min(64, len(buffer)))] = rng.choice((0, 1, 0x7F, 0x80, 0xFF, rng.randrange(256)))
    elif kind == 2:
        for _ in range(rng.randint(1, 16)):
            position = rng.randrange(len(buffer))
            buffer[position] ^= 1 << rng.randrange(8)
    elif kind == 3:
        start = rng.randrange(len(buffer))
        buffer[start:start] = buffer[start : start + rng.randint(1, 256)]
    elif kind == 4:
        start = rng.randrange(len(buffer))
        del buffer[start : start + rng.randint(1, 64)]
    else:  # a 16- or 32-bit field set to an extreme
        position = rng.randrange(max(1, min(128, len(buffer) - 4)))
        buffer[position : position + 4] = rng.choice((b"\xff\xff\xff\xff", b"\x00\x00\x00\x00", b"\x7f\xff\x00\x01"))
    return bytes(buffer)


def cases() -> Iterator[tuple[str, bytes]]:
    rng = random.Random(SEED)
    originals = seeds()
    names = sorted(originals)
    for index in range(CASES):
        name = names[index % len(names)]
        data = originals[name]
        for _ in range(rng.choice((1, 1, 1, 2, 3))):
            data = mutate(data, rng)
        yield name, data


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with running_server(tmp_path_factory.mktemp("logs"), max_image_pixels=1_000_000, batch_timeout_ms=2) as running:
        yield running


def test_mutated_images_get_a_clear_answer_and_the_server_stays_healthy(server: Server) -> None:
    end = time.monotonic() + BUDGET_S
    statuses: Counter[int] = Counter()
    wrong: list[str] = []

    def post_all(share: list[tuple[str, bytes]]) -> None:
        with httpx.Client(timeout=60) as client:  # keep-alive: an error must not cost the next request
            for name, data in share:
                if time.monotonic() > end:
                    return
                response = client.post(f"{server.url}/predict", content=data, headers={"Content-Type": "image/png"})
                statuses[response.status_code] += 1
                if response.status_code not in ALLOWED:
                    wrong.append(f"{name}: {response.status_code} {response.text[:200]}")
                elif response.status_code != 200:
                    assert response.headers["content-type"] == "application/json"
                    assert json.loads(response.content)["error"]["code"]

    all_cases = list(cases())
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(post_all, [all_cases[i::4] for i in range(4)]))
    assert wrong == [], wrong[:10]
    assert sum(statuses.values()) >= 1000, statuses  # enough cases ran within the time budget
    assert statuses[200] and statuses[400], statuses
    assert httpx.get(f"{server.url}/health/ready").status_code == 200
    assert server.metric("imgserve_requests_total", route="/predict", code="500") == 0
    assert "Traceback" not in server.log()


V2_ALLOWED = {200, 400, 413, 415, 422}


def v2_seeds() -> list[tuple[bytes, dict[str, str]]]:
    """Valid Open Inference Protocol bodies: JSON with base64, binary BYTES, binary pixels, gzip, raw binary."""
    images = seeds()
    jpeg, png = images["jpeg"], images["png"]
    pixels = np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))
    found = []
    as_json = {
        "inputs": [
            {
                "name": "image",
                "datatype": "BYTES",
                "shape": [2, 1],
                "data": [base64.b64encode(jpeg).decode(), base64.b64encode(png).decode()],
            }
        ],
        "outputs": [{"name": "output_image"}],
        "parameters": {"format": "png"},
    }
    found.append((json.dumps(as_json).encode(), {}))
    for name, datatype, shape, blob in (
        ("image", "BYTES", [1, 1], struct.pack("<I", len(jpeg)) + jpeg),
        ("pixels", "UINT8", [1, *pixels.shape], pixels.tobytes()),
    ):
        header = json.dumps(
            {
                "inputs": [
                    {"name": name, "datatype": datatype, "shape": shape, "parameters": {"binary_data_size": len(blob)}}
                ],
                "parameters": {"binary_data_output": True},
            }
        ).encode()
        found.append((header + blob, {"Inference-Header-Content-Length": str(len(header))}))
    found.append((gzip.compress(found[0][0]), {"Content-Encoding": "gzip"}))
    found.append((jpeg, {"Inference-Header-Content-Length": "0"}))
    found.append((json.dumps(pixels_json(pixels[:4, :5])).encode(), {}))
    return found


def pixels_json(pixels: np.ndarray) -> dict:
    """A JSON infer body carrying decoded pixels as UINT8 numbers."""
    item = {"name": "pixels", "datatype": "UINT8", "shape": [1, *pixels.shape], "data": pixels.reshape(-1).tolist()}
    return {"inputs": [item], "outputs": [{"name": "output_pixels"}]}


NON_ASCII_DIGITS = "¹²³١٢٣٠۴५０９߁"  # str.isdigit() takes each; only the first three survive latin-1 headers
DEEP_PLACES = ("document", "inputs", "data", "shape", "parameters", "outputs", "id")
NOT_INTEGERS = ("NaN", "Infinity", "-Infinity", "1.5", "2.0", "-0.0", "1e2", "1e400", "-1e400", "256", "-1", "true")


def hostile(rng: random.Random, binary: tuple[bytes, dict[str, str]], pixels: dict) -> tuple[str, bytes, dict]:
    """A structured attack on the v2 parser: (its class, body, headers). Classes: non-ASCII digits in the header
    length, JSON nested past the recursion limit somewhere in the request, non-integers in integer data."""
    kind = rng.choice(("non-ASCII digits", "deep nesting", "non-integers"))
    if kind == "non-ASCII digits":
        body, headers = binary
        digits = list(headers["Inference-Header-Content-Length"])
        for _ in range(rng.randint(1, 3)):
            digits.insert(rng.randrange(len(digits) + 1), rng.choice(NON_ASCII_DIGITS))
        value = "".join(digits)
        encoded = value.encode("latin-1") if all(ord(c) < 256 for c in value) else value.encode()
        return kind, body, {"Inference-Header-Content-Length": encoded}
    document = copy.deepcopy(pixels)
    if kind == "deep nesting":
        depth, place = rng.choice((999, 1000, 1001, 3000, 100_000)), rng.choice(DEEP_PLACES)
        if place in ("inputs", "parameters", "id"):
            document[place] = "@"
        elif place == "outputs":
            document["outputs"][0]["parameters"] = {"classification": "@"}
        elif place != "document":
            document["inputs"][0][place] = "@"
        text = json.dumps("@" if place == "document" else document)
        body = text.replace('"@"', "[" * depth + rng.choice(("0", '""', "{}")) + "]" * depth).encode()
    else:
        data = document["inputs"][0]["data"]
        for _ in range(rng.randint(1, 3)):
            data[rng.randrange(len(data))] = "@"
        document["inputs"][0]["datatype"] = rng.choice(("UINT8", "UINT8", "INT32", "INT8", "UINT16", "INT64", "BOOL"))
        body = re.sub('"@"', lambda _: rng.choice(NOT_INTEGERS), json.dumps(document)).encode()
    if rng.random() < 0.5:  # large or compressed bodies are parsed on the codec threads, small ones on the loop
        return kind, gzip.compress(body), {"Content-Encoding": "gzip"}
    return kind, body, {}


def test_mutated_v2_bodies_get_the_protocols_error_and_the_server_stays_healthy(server: Server) -> None:
    """The v2 body parser (JSON header, binary tensors, gzip, raw) fuzzed: 200 or a 4xx `{"error": "..."}`. Every
    fourth case is a structured attack (see `hostile`), the rest random byte mutations of valid bodies."""
    rng = random.Random(SEED + 1)
    originals = v2_seeds()
    binary = [seed for seed in originals if seed[1].get("Inference-Header-Content-Length", "0") != "0"]
    pixels = json.loads(originals[-1][0])
    end = time.monotonic() + BUDGET_S / 2
    statuses: Counter[int] = Counter()
    attacks: Counter[str] = Counter()
    wrong: list[str] = []
    with httpx.Client(timeout=60) as client:
        for index in range(CASES // 2):
            if time.monotonic() > end:
                break
            if index % 4 == 3:
                kind, body, headers = hostile(rng, rng.choice(binary), pixels)
                attacks[kind] += 1
            else:
                kind, (body, headers) = "mutation", originals[index % len(originals)]
                for _ in range(rng.choice((1, 1, 2))):
                    body = mutate(body, rng)
            response = client.post(f"{server.url}/v2/models/denoiser/infer", content=body, headers=headers)
            statuses[response.status_code] += 1
            if response.status_code not in V2_ALLOWED:
                wrong.append(f"{index} ({kind}): {response.status_code} {response.text[:200]}")
            elif response.status_code != 200:
                error = json.loads(response.content)
                assert list(error) == ["error"] and isinstance(error["error"], str), error
    assert wrong == [], wrong[:10]
    assert sum(statuses.values()) >= 300 and statuses[400] and statuses[200], statuses
    assert len(attacks) == 3 and min(attacks.values()) >= 20, attacks
    assert httpx.get(f"{server.url}/v2/health/ready").json() == {"ready": True}
    assert server.metric("imgserve_requests_total", route="/v2/infer", code="500") == 0
    assert "Traceback" not in server.log()
