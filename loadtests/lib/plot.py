"""One PNG per Locust run: throughput (answered and rejected), p50/p99 latency, users and queue depth over time."""

from __future__ import annotations

import csv
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from loadtests.lib.images import ANSWERED, REJECTED  # noqa: E402
from loadtests.lib.scrape import QUEUE_DEPTH  # noqa: E402


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def _per_second(rows: list[dict[str, str]], names: Callable[[str], bool], column: str, start: float) -> list:
    """(seconds, rate) from the growth of a cumulative count, summed over the stats entries `names` picks."""
    totals: dict[float, float] = defaultdict(float)
    for row in rows:
        if names(row["Name"]):
            totals[float(row["Timestamp"]) - start] += float(row[column])
    times = sorted(totals)
    return [(b, (totals[b] - totals[a]) / (b - a)) for a, b in zip(times, times[1:], strict=False) if b > a]


def plot_run(history_csv: Path, metrics_csv: Path, out_png: Path) -> None:
    """Draw Locust's per-second stats history and the scraped queue depth on one shared time axis."""
    with history_csv.open() as f:
        rows = list(csv.DictReader(f))
    with metrics_csv.open() as f:
        scraped = list(csv.DictReader(f))
    start = min((float(r["Timestamp"]) for r in rows), default=0.0)
    answered = [r for r in rows if r["Name"] == ANSWERED]
    users = [(float(r["Timestamp"]) - start, float(r["User Count"])) for r in rows if r["Name"] == "Aggregated"]
    depth = [(float(r["timestamp"]) - start, _number(r[QUEUE_DEPTH])) for r in scraped]
    depth = [(t, value) for t, value in depth if value is not None]
    series = {
        "answered /s": (lambda name: name == ANSWERED, "Total Request Count"),
        "failed /s": (lambda name: name == ANSWERED, "Total Failure Count"),
        "rejected 503/504 /s": (lambda name: name.startswith(REJECTED), "Total Request Count"),
    }
    rates = {label: _per_second(rows, names, column, start) for label, (names, column) in series.items()}
    failed = dict(rates["failed /s"])
    rates["answered /s"] = [(t, rate - failed.get(t, 0.0)) for t, rate in rates["answered /s"]]

    fig, (ax_rps, ax_lat, ax_queue) = plt.subplots(3, 1, sharex=True, figsize=(9, 8))
    for label, points in rates.items():
        ax_rps.plot([t for t, _ in points], [rate for _, rate in points], label=label)
    ax_rps.set_ylabel("requests/s")
    ax_rps.legend(loc="upper left")
    t = [float(r["Timestamp"]) - start for r in answered]
    for quantile in ("50%", "99%"):
        ax_lat.plot(t, [_number(r[quantile]) for r in answered], label=f"p{quantile[:-1]} of answers (10 s window)")
    ax_lat.set_ylabel("latency ms")
    ax_lat.legend(loc="upper left")
    ax_queue.plot([x for x, _ in users], [y for _, y in users], label="users", color="grey")
    ax_queue.plot([x for x, _ in depth], [y for _, y in depth], label=QUEUE_DEPTH)
    ax_queue.set_ylabel("count")
    ax_queue.set_xlabel("seconds")
    ax_queue.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(out_png, dpi=100)
    plt.close(fig)
