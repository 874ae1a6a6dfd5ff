"""Less to decode: a JPEG decoded whole against decoded at a reduced DCT scale, for ImageNet preprocessing.

`python -m loadtests.decode [--seconds 2] [--out loadtests/results/decode.md]`

For 500x375, 1024x1024 and 1920x1080 JPEGs (quality 90; photo-like synthetic images, and the same with strong pixel
noise, which a reduced decode smooths most), on one thread: the decode alone and the decode with the front end's
resize and crop (`--preprocess imagenet`), whole (`codec.open_image`) and reduced (`at_least=256`, what the
built-in API asks for), timed in alternating rounds (median ms); and how far the model's uint8 input is from the
whole decode's (mean, 99th percentile and largest absolute difference, on the 0-255 scale). Target: mean <= 1 on
the photo-like images.
"""

from __future__ import annotations

import argparse
import datetime
import io
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from PIL import Image

from imgserve import codec
from imgserve.models.preprocess import Preprocess
from imgserve.models.synthetic import add_noise, clean_image
from loadtests.lib.report import machine, publish

SIZES = ((500, 375), (1024, 1024), (1920, 1080))
NOISE = {"photo-like": 0.0, "noisy": 0.08}
PREPROCESS = Preprocess(256, 224, "bilinear")  # --preprocess imagenet
TOLERANCE = 1.0  # mean |difference| of the model's input on photo-like images, 0-255 scale
LIMIT = 10**8


def jpeg(width: int, height: int, noise: float) -> bytes:
    rng = np.random.default_rng(width * height)
    pixels = clean_image(rng, height, width)
    if noise:
        pixels = add_noise(rng, pixels, noise)
    buffer = io.BytesIO()
    Image.fromarray((pixels * 255).round().astype(np.uint8)).save(buffer, format="JPEG", quality=90)
    return buffer.getvalue()


def median_ms(work: dict[str, Callable[[], object]], seconds: float) -> dict[str, float]:
    """Each piece of work timed in alternating rounds of a tenth of `seconds` each: the median call, in ms."""
    times: dict[str, list[float]] = {name: [] for name in work}
    for _ in range(5):
        for name, call in work.items():
            until = time.perf_counter() + seconds / 10
            while time.perf_counter() < until:
                started = time.perf_counter()
                call()
                times[name].append(time.perf_counter() - started)
    return {name: 1000 * statistics.median(values) for name, values in times.items()}


def row(width: int, height: int, kind: str, seconds: float) -> tuple[str, float]:
    """The table's row for one upload, and the mean difference of the model's input."""
    data = jpeg(width, height, NOISE[kind])
    least = PREPROCESS.least_side

    def whole() -> np.ndarray:
        return PREPROCESS(codec.open_image(data, LIMIT)).pixels

    def reduced() -> np.ndarray:
        return PREPROCESS(codec.open_image(data, LIMIT, least)).pixels

    ms = median_ms(
        {
            "decode": lambda: codec.open_image(data, LIMIT),
            "decode reduced": lambda: codec.open_image(data, LIMIT, least),
            "input": whole,
            "input reduced": reduced,
        },
        seconds,
    )
    difference = np.abs(whole().astype(np.float32) - reduced().astype(np.float32))
    decoded = codec.open_image(data, LIMIT, least).size
    text = (
        f"| {width}x{height} | {kind} | {decoded[0]}x{decoded[1]} | {ms['decode']:.2f} | {ms['decode reduced']:.2f} "
        f"| {ms['decode'] / ms['decode reduced']:.2f}x | {ms['input']:.2f} | {ms['input reduced']:.2f} "
        f"| {ms['input'] / ms['input reduced']:.2f}x | {difference.mean():.2f} | {np.percentile(difference, 99):.0f} "
        f"| {difference.max():.0f} |"
    )
    return text, float(difference.mean())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtests.decode", description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=2.0, help="timed seconds per case and way")
    parser.add_argument("--out", type=Path, default=Path("loadtests/results/decode.md"), help="markdown report")
    args = parser.parse_args(argv)
    lines = [
        "| upload | image | decoded at | decode ms | reduced ms | faster | decode + resize + crop ms | reduced ms "
        "| faster | input diff mean | p99 | max |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    rows = {(width, height, kind): row(width, height, kind, args.seconds) for width, height in SIZES for kind in NOISE}
    lines += [text for text, _ in rows.values()]
    worst = max(mean for (_, _, kind), (_, mean) in rows.items() if kind == "photo-like")
    met = "met" if worst <= TOLERANCE else "missed"
    lines += [
        "",
        f"Target: the model's input within a mean of {TOLERANCE:g}/255 of a whole decode's on the photo-like "
        f"images: largest mean {worst:.2f} — **{met}**",
    ]
    command = shlex.join(["python", "-m", "loadtests.decode", *(argv if argv is not None else sys.argv[1:])])
    header = f"# Decode ({datetime.date.today()})\n\n`{command}` on {machine()}, one thread.\n\n"
    return publish(header + "\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    sys.exit(main())
