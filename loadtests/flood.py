"""The overload figures of the admission design: `python -m loadtests.flood [--users 8] [--factor 10] [--seconds 20]`.

Serves the built-in model with a small queue bound, measures accepted latency at capacity and under a flood of
`factor` times as many users, and the server's process-tree RSS before and after; prints a markdown table.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from imgserve.testing import free_port, serve_command
from loadtests.lib.closed_loop import LoadResult, run_closed_loop
from loadtests.lib.report import machine
from loadtests.lib.servers import ResourceSampler, running_server

SETTINGS = {"IMGSERVE_MAX_BATCH_SIZE": "4", "IMGSERVE_MAX_QUEUE_DEPTH": "8"}


def _row(name: str, result: LoadResult, pss_mib: float) -> str:
    return (
        f"| {name} | {result.users} | {len(result.outcomes)} | {len(result.answered)} | {result.shed} | {result.failed}"
        f" | {result.rps:.1f} | {result.latency_ms(0.5):.0f} | {result.latency_ms(0.99):.0f} | {pss_mib:.0f} |"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--users", type=int, default=8, help="users at capacity")
    parser.add_argument("--factor", type=int, default=10, help="flood = factor x users")
    parser.add_argument("--seconds", type=float, default=20, help="measured seconds per phase")
    args = parser.parse_args(argv)
    port = free_port()
    with (
        tempfile.TemporaryDirectory() as logs,
        running_server(serve_command(port), port, Path(logs) / "server.log", "/health/ready", SETTINGS) as server,
    ):
        url = f"{server.url}/predict"
        run_closed_loop(url, users=args.users, seconds=2)  # warm-up
        rows = []
        for name, users in (("at capacity", args.users), ("flood", args.users * args.factor)):
            with ResourceSampler(server) as sampler:
                result = run_closed_loop(url, users=users, seconds=args.seconds)
            rows.append(_row(name, result, sampler.peak_pss_bytes / 2**20))
    print(f"{machine()}; settings {SETTINGS}\n")
    print("| phase | users | sent | 200 | 503/504 | failed | ok/s | p50 ms | p99 ms | peak PSS MiB |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
