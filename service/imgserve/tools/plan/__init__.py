"""`imgserve plan`: replay a load profile through the chart's HPA/KEDA settings before deploying.

inputs (values, capacity, profile) -> simulate (the cluster second by second, the autoscaler per hpa) -> report.
Runs in the `imgserve plan` process alone, never beside a server.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from imgserve.tools.plan import inputs, report
from imgserve.tools.plan.simulate import simulate


def register(subparsers: argparse._SubParsersAction[Any]) -> None:
    """Add the `plan` subcommand."""
    p = subparsers.add_parser(
        "plan",
        help="replay a load profile through the chart's autoscaling settings",
        description=__doc__.splitlines()[0],
    )
    p.add_argument("-f", "--values", type=Path, action="append", default=[], help="chart values file (repeatable)")
    p.add_argument("--capacity", type=Path, required=True, help="per-pod capacity JSON (python -m loadtests.capacity)")
    p.add_argument("--startup-seconds", type=float, default=60, help="pod creation until Ready (default 60)")
    p.add_argument("--profile", default="step", help="step, spike, diurnal, or locust:PATH (*_stats_history.csv)")
    p.add_argument("--base-rps", type=float, default=1.0, help="load before/after the rise (default 1)")
    p.add_argument("--peak-rps", type=float, help="load at the peak (step/spike/diurnal)")
    p.add_argument("--duration", type=int, default=1800, help="seconds to replay (default 1800)")
    p.add_argument("--rise-at", type=int, default=300, help="step/spike: second the load rises (default 300)")
    p.add_argument("--spike-seconds", type=int, default=60, help="spike: how long the peak lasts (default 60)")
    p.add_argument("--period", type=int, help="diurnal: seconds per cycle (default: the duration)")
    p.add_argument("--metrics-lag", type=int, default=15, help="scrape + adapter delay in seconds (default 15)")
    p.add_argument(
        "--max-queue-depth", type=float, help="per-pod queue depth where shedding starts (default: measured)"
    )
    p.add_argument("--out", type=Path, default=Path("imgserve-plan"), help="writes plan.png and summary.md here")
    p.add_argument("--strict", action="store_true", help="exit 1 when there are warnings")
    p.set_defaults(func=run)


def _profile(args: argparse.Namespace) -> inputs.Profile:
    if args.profile.startswith("locust:"):
        return inputs.locust_profile(Path(args.profile.removeprefix("locust:")))
    if args.peak_rps is None:
        raise ValueError(f"--profile {args.profile} needs --peak-rps")
    return inputs.synthetic_profile(
        args.profile,
        args.base_rps,
        args.peak_rps,
        args.duration,
        args.rise_at,
        args.spike_seconds,
        args.period or args.duration,
    )


def run(args: argparse.Namespace) -> int:
    """Simulate, print the summary and warnings, write the plot and the summary under --out."""
    try:
        scaler = inputs.load_values(args.values)
        pod = inputs.load_capacity(args.capacity, args.max_queue_depth)
        profile = _profile(args)
    except (OSError, ValueError) as exc:  # pydantic's ValidationError is a ValueError
        print(f"imgserve plan: {exc}", file=sys.stderr)
        return 2
    timeline = simulate(scaler, pod, profile.rps, args.startup_seconds, args.metrics_lag)
    summary = report.summarize(timeline, pod, scaler)
    warnings = report.warnings(scaler, pod, timeline, args.startup_seconds)
    header = [
        f"Autoscaler: {scaler.describe()}",
        f"Pod: {pod.max_rps:g} requests/s at most, sheds above {pod.max_queue:.1f} queued, "
        f"Ready {args.startup_seconds:g} s after creation",
        f"Load: {profile.label}",
        *(f"Note: {note}" for note in pod.notes),
    ]
    text = "\n\n".join(
        ["\n".join(f"- {line}" for line in header), report.table(summary, timeline, scaler)]
        + (["Warnings:\n" + "\n".join(f"- {w}" for w in warnings)] if warnings else [])
    )
    args.out.mkdir(parents=True, exist_ok=True)
    report.plot(timeline, pod, scaler, f"{scaler.describe()}\n{profile.label}", args.out / "plan.png")
    (args.out / "summary.md").write_text(text + "\n")
    print(text)
    print(f"\nwrote {args.out / 'plan.png'} and {args.out / 'summary.md'}")
    return 1 if warnings and args.strict else 0
