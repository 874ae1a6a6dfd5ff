"""The in-process limit: decode + model at its best batch size + encode in one Python process, no HTTP, no IPC."""

from __future__ import annotations

import time
from dataclasses import dataclass

from loadtests.lib import pipeline
from loadtests.lib.images import sample_images

BATCH_SIZES = (1, 2, 4, 8, 16)


@dataclass(frozen=True)
class Limit:
    """Images per second at each batch size tried, and the best of them."""

    by_batch: dict[int, float]

    @property
    def best_batch(self) -> int:
        return max(self.by_batch, key=self.by_batch.__getitem__)

    @property
    def images_per_s(self) -> float:
        return self.by_batch[self.best_batch]


def measure_limit(
    batch_sizes: tuple[int, ...] = BATCH_SIZES,
    seconds: float = 3.0,
    max_batches: int = 10_000,
    channels_last: bool = pipeline.DEFAULTS.channels_last,
) -> Limit:
    """Run the whole per-image pipeline over the test images for `seconds` (or `max_batches`) per batch size.

    channels_last=False runs the model in PyTorch's default NCHW memory, as the baseline and plain LitServe do.
    """
    running = pipeline.built_in(pipeline.best_device(), channels_last)
    images = sample_images()

    def one_batch(first: int, size: int) -> None:
        running.run([pipeline.upload(images[(first + i) % len(images)].data) for i in range(size)])

    by_batch = {}
    for size in batch_sizes:
        one_batch(0, size)  # warm-up
        started, done = time.perf_counter(), 0
        while done < max_batches and time.perf_counter() - started < seconds:
            one_batch(done * size, size)
            done += 1
        by_batch[size] = done * size / (time.perf_counter() - started)
    return Limit(by_batch)
