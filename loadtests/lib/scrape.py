"""Scrape a few metrics from a server's /metrics at a fixed interval, in a background thread, for a bounded time."""

from __future__ import annotations

import contextlib
import csv
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from loadtests.lib.servers import Periodic

QUEUE_DEPTH = "imgserve_queue_depth"
GPU_UTILIZATION = "imgserve_gpu_utilization_ratio"


def read_metrics(text: str, names: tuple[str, ...]) -> dict[str, float]:
    """For each wanted metric present in the exposition: the mean over its label sets (one per device or pod)."""
    values: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in names:
                values.setdefault(sample.name, []).append(sample.value)
    return {name: sum(found) / len(found) for name, found in values.items()}


def read_totals(url: str, names: tuple[str, ...]) -> dict[str, float]:
    """Each wanted metric of the server at `url` now, summed over its label sets (0 where it has none)."""
    found = dict.fromkeys(names, 0.0)
    for family in text_string_to_metric_families(httpx.get(url.rstrip("/") + "/metrics", timeout=10).text):
        for sample in family.samples:
            if sample.name in found:
                found[sample.name] += sample.value
    return found


class MetricsScraper(Periodic):
    """`with MetricsScraper(url) as s:` samples /metrics every `interval_s` (at most `max_s`) while the block runs."""

    def __init__(
        self,
        url: str,
        names: tuple[str, ...] = (QUEUE_DEPTH, GPU_UTILIZATION),
        interval_s: float = 1.0,
        max_s: float = 3600,
    ) -> None:
        self.url, self.names = url.rstrip("/") + "/metrics", names
        self.samples: list[tuple[float, dict[str, float]]] = []  # (unix time, values)
        super().__init__(self._scrape, interval_s, max_s)

    def _scrape(self) -> None:
        with contextlib.suppress(httpx.HTTPError):
            response = httpx.get(self.url, timeout=max(self.interval_s, 1.0))
            if response.status_code == 200:
                self.samples.append((time.time(), read_metrics(response.text, self.names)))

    def mean(self, name: str, since: float = 0.0, until: float = float("inf")) -> float | None:
        """Mean of `name` over the samples taken in [since, until] (unix time); None if it was never there."""
        found = [values[name] for t, values in self.samples if since <= t <= until and name in values]
        return sum(found) / len(found) if found else None

    def write_csv(self, path: Path) -> None:
        """One row per sample: unix time, then each metric (empty when absent)."""
        with path.open("w", newline="") as out:
            writer = csv.writer(out)
            writer.writerow(["timestamp", *self.names])
            for t, values in self.samples:
                writer.writerow([f"{t:.3f}", *(values.get(name, "") for name in self.names)])
