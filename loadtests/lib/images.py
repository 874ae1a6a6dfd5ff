"""The test images every load generator sends, and the checks of their answers (an image, or a classifier's
scores)."""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from functools import cache

import numpy as np
from PIL import Image

from imgserve.models.synthetic import add_noise, clean_image

# (width, height, format): mixed sizes and both common upload formats.
SPECS = [
    (64, 64, "JPEG"),
    (96, 128, "PNG"),
    (128, 128, "JPEG"),
    (160, 120, "PNG"),
    (192, 192, "JPEG"),
    (128, 96, "PNG"),
    (80, 112, "JPEG"),
    (144, 144, "PNG"),
]
REJECT_STATUSES = (503, 504)
MAX_RETRY_AFTER_S = 1.0  # a rejected client waits Retry-After, at most this long
ANSWERED = "/predict"  # the Locust stats name of answers; rejects get rejected_name(status)
REJECTED = "rejected"
NOISE_SIGMA = 0.08


@dataclass(frozen=True)
class SampleImage:
    """One encoded upload and the size the answer must have."""

    name: str
    width: int
    height: int
    content_type: str
    data: bytes


def synthetic_image(seed: int, width: int, height: int, fmt: str) -> SampleImage:
    """A deterministic noisy synthetic photo (gradients, shapes, texture), encoded in memory."""
    rng = np.random.default_rng(seed)
    pixels = add_noise(rng, clean_image(rng, height, width), NOISE_SIGMA)
    buffer = io.BytesIO()
    Image.fromarray((pixels * 255).round().astype(np.uint8)).save(buffer, format=fmt)
    return SampleImage(f"{width}x{height}.{fmt.lower()}", width, height, f"image/{fmt.lower()}", buffer.getvalue())


@cache
def sample_images() -> tuple[SampleImage, ...]:
    """The eight mixed-size test images, encoded once per process."""
    return tuple(synthetic_image(seed, width, height, fmt) for seed, (width, height, fmt) in enumerate(SPECS))


@cache
def square_jpegs(side: int, count: int = 4) -> tuple[SampleImage, ...]:
    """`count` different side x side JPEGs (seeded), encoded once per process."""
    return tuple(synthetic_image(1000 * side + seed, side, side, "JPEG") for seed in range(count))


def check_answer(image: SampleImage, status: int, content_type: str, body: bytes, decode: bool = True) -> str | None:
    """None when the answer is a decodable image of the input's size, else what is wrong with it.

    decode=False reads only the image's header (format and size), to spare the load generator's CPU.
    """
    if status != 200:
        return f"HTTP {status}: {body[:200]!r}"
    if not content_type.startswith("image/"):
        return f"content type {content_type!r} is not an image"
    try:
        with Image.open(io.BytesIO(body)) as answer:
            if decode:
                answer.load()
            size = answer.size
    except (OSError, SyntaxError, ValueError) as exc:
        return f"the answer does not decode: {exc}"
    if size != (image.width, image.height):
        return f"answer is {size[0]}x{size[1]}, expected {image.width}x{image.height}"
    return None


def check_scores(image: SampleImage, status: int, content_type: str, body: bytes, decode: bool = True) -> str | None:
    """None when the answer is a classifier's JSON with its top scores, else what is wrong with it."""
    if status != 200:
        return f"HTTP {status}: {body[:200]!r}"
    try:
        scores = json.loads(body)["top_k"]
    except (ValueError, KeyError, TypeError):
        return f"not a classifier's answer: {body[:200]!r}"
    return None if isinstance(scores, list) and scores else f"no scores in {body[:200]!r}"


def rejected_name(status: int) -> str:
    """Locust stats name for an explicit rejection, kept apart from answers and failures."""
    return f"{REJECTED} {status}"
