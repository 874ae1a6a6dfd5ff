"""Measure a server's capacity in steps of rising concurrency and write capacity.json for `imgserve plan`.

    python -m loadtests.capacity --host http://127.0.0.1:8000 --out capacity.json \\
        [--users 1,4,16,64] [--step-seconds 10]

Contract (version 1): {"version", "target", "model", "device", "steps": [{"users", "rps", "p50_ms", "p99_ms",
"queue_depth", "shed_rate", "gpu_utilization"}], "max_rps"}. rps counts correct answers per second; the
latencies are of those answers; queue_depth and gpu_utilization are means of imgserve_queue_depth and
imgserve_gpu_utilization_ratio scraped during the step (gpu_utilization is null without that metric);
shed_rate is the share of 503/504 answers.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from loadtests.lib.closed_loop import run_closed_loop
from loadtests.lib.scrape import GPU_UTILIZATION, QUEUE_DEPTH, MetricsScraper

VERSION = 1


def _describe(host: str) -> tuple[str, str]:
    """model and device from GET /info, "unknown" for whatever is missing."""
    info: Any = {}
    with contextlib.suppress(httpx.HTTPError, ValueError):
        info = httpx.get(host + "/info", timeout=10).json()
    info = info if isinstance(info, dict) else {}
    return str(info.get("model") or "unknown"), str(info.get("device") or "unknown")


def _round(value: float | None, digits: int = 2) -> float | None:
    return None if value is None else round(value, digits)


def measure_capacity(host: str, users: list[int], step_seconds: float) -> dict[str, Any]:
    """Run one closed-loop step per user count (a short warm-up each) and return the capacity document."""
    host = host.rstrip("/")
    model, device = _describe(host)
    warmup_s = min(1.0, step_seconds / 4)
    interval_s = min(1.0, step_seconds / 8)
    steps = []
    for count in users:
        with MetricsScraper(host, (QUEUE_DEPTH, GPU_UTILIZATION), interval_s, max_s=step_seconds + 120) as scraper:
            started = time.time()
            result = run_closed_loop(host + "/predict", count, step_seconds, warmup_s)
            ended = time.time()
        window = (started + warmup_s, ended)
        steps.append(
            {
                "users": count,
                "rps": round(result.rps, 2),
                "p50_ms": _round(result.latency_ms(0.5), 1),
                "p99_ms": _round(result.latency_ms(0.99), 1),
                "queue_depth": _round(scraper.mean(QUEUE_DEPTH, *window)),
                "shed_rate": round(result.shed_rate, 4),
                "gpu_utilization": _round(scraper.mean(GPU_UTILIZATION, *window), 3),
            }
        )
        print(f"users {count:4d}: {json.dumps(steps[-1])}", flush=True)
    return {
        "version": VERSION,
        "target": host,
        "model": model,
        "device": device,
        "steps": steps,
        "max_rps": max((step["rps"] for step in steps), default=0.0),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtests.capacity", description=__doc__.splitlines()[0])
    parser.add_argument("--host", required=True, help="base URL of the server, e.g. http://127.0.0.1:8000")
    parser.add_argument("--out", type=Path, default=Path("capacity.json"))
    parser.add_argument("--users", default="1,4,16,64", help="comma-separated concurrency steps")
    parser.add_argument("--step-seconds", type=float, default=10.0, help="measured seconds per step (>= 1)")
    args = parser.parse_args(argv)
    users = [int(u) for u in args.users.split(",") if u.strip()]
    if not users or min(users) < 1 or args.step_seconds < 1:
        parser.error("--users needs positive integers and --step-seconds at least 1")
    document = measure_capacity(args.host, users, args.step_seconds)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(document, indent=2) + "\n")
    print(f"max {document['max_rps']} answers/s; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
