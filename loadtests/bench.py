"""Side-by-side benchmark on one machine and model: in-process limit, FastAPI baseline, plain LitServe, imgserve.

`python -m loadtests.bench [--quick] --out loadtests/results/bench.md`

Each server is started by the harness on a free loopback port, warmed up, driven by the closed-loop client
at each concurrency (plus a 10x overload; imgserve also under a retry storm: 10x overload with clients that
resend at once on 503), and killed with its whole process tree. The markdown table with the ratios
imgserve/limit, imgserve/baseline and imgserve/plain LitServe is printed and written to --out.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import shlex
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

from imgserve.testing import free_port, serve_command
from loadtests.lib.closed_loop import LoadResult, run_closed_loop
from loadtests.lib.inprocess import BATCH_SIZES, Limit, measure_limit
from loadtests.lib.report import failures_seen, machine, publish
from loadtests.lib.servers import CpuWindow, ResourceSampler, running_server

CONCURRENCIES = (1, 3, 20, 64)
OVERLOAD_FACTOR = 10
BASELINE, PLAIN, IMGSERVE = "FastAPI baseline", "plain LitServe", "imgserve"
STORM = "imgserve, retrying at once"  # the same server under the overload, with clients that resend on 503 at once
STORM_GOODPUT_FACTOR = 0.9  # the target: under a retry storm the pod keeps this share of its top throughput


@dataclass(frozen=True)
class Contender:
    """A server to benchmark: how to start it on a port, and its readiness path."""

    name: str
    command: Callable[[int], list[str]]
    ready_path: str


def _module(name: str) -> Callable[[int], list[str]]:
    return lambda port: [sys.executable, "-m", name, "--port", str(port)]


CONTENDERS = (
    Contender(BASELINE, _module("loadtests.contenders.baseline_fastapi"), "/health"),
    Contender(PLAIN, _module("loadtests.contenders.plain_litserve"), "/health"),
    Contender(IMGSERVE, serve_command, "/health/ready"),
)


@dataclass(frozen=True)
class Cell:
    """One server at one concurrency: the load result and the server's peak memory during it."""

    server: str
    result: LoadResult
    peak_pss_bytes: int
    peak_gpu_bytes: int | None
    client_cores: float  # CPU the load generator itself used: it shares the machine with the server
    server_cores: float  # CPU the server's whole process tree used


@dataclass(frozen=True)
class Plan:
    """How long and how hard to push: concurrencies (the last is the overload), seconds per cell."""

    concurrencies: tuple[int, ...]
    seconds: float
    warmup_s: float
    limit_seconds: float
    batch_sizes: tuple[int, ...]

    @classmethod
    def make(cls, quick: bool) -> Plan:
        levels = (1, 20) if quick else CONCURRENCIES
        if quick:
            return cls((*levels, OVERLOAD_FACTOR * levels[-1]), 1.0, 0.5, 1.0, (1, 8))
        return cls((*levels, OVERLOAD_FACTOR * levels[-1]), 10.0, 2.0, 3.0, BATCH_SIZES)

    @property
    def overload(self) -> int:
        return self.concurrencies[-1]


def bench_server(contender: Contender, plan: Plan, log_dir: Path) -> tuple[list[Cell], dict]:
    """Start `contender`, warm it up, run every cell, stop it; returns the cells and its GET /info (or {}).

    imgserve also gets the retry-storm cell: the overload's users resending at once on 503/504.
    """
    port = free_port()
    with running_server(contender.command(port), port, log_dir / f"{port}.log", contender.ready_path) as server:
        info = {}
        with contextlib.suppress(httpx.HTTPError, ValueError):
            info = httpx.get(server.url + "/info", timeout=5).json()
        url = server.url + "/predict"
        run_closed_loop(url, users=4, seconds=plan.warmup_s)
        cells = []
        runs = [(contender.name, users, False) for users in plan.concurrencies]
        if contender.name == IMGSERVE:
            runs.append((STORM, plan.overload, True))
        for name, users, retry_at_once in runs:
            with ResourceSampler(server) as sampler, CpuWindow(server, plan.warmup_s, plan.seconds) as cpu:
                result = run_closed_loop(url, users, plan.seconds, plan.warmup_s, retry_at_once=retry_at_once)
            cells.append(
                Cell(name, result, sampler.peak_pss_bytes, sampler.peak_gpu_bytes, cpu.client_cores, cpu.server_cores)
            )
            print(f"  {name:26s} users {users:4d}: {_summary(cells[-1])}", flush=True)
    return cells, info


def _summary(cell: Cell) -> str:
    r = cell.result
    return f"{r.rps:7.1f}/s p50 {_ms(r.latency_ms(0.5))} p99 {_ms(r.latency_ms(0.99))} shed {r.shed} failed {r.failed}"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b else "-"


def _targets(plan: Plan, limit: float, by_key: dict[tuple[str, int], Cell]) -> list[str]:
    by_name = (BASELINE, PLAIN, IMGSERVE)
    top = plan.concurrencies[-2]
    imgserve = by_key[IMGSERVE, top].result
    lines = []
    for name, reference, factor in (
        ("in-process limit", limit, 0.8),
        (BASELINE, by_key[BASELINE, top].result.rps, 1.2),
        (PLAIN, by_key[PLAIN, top].result.rps, 1.2),
    ):
        met = imgserve.rps >= factor * reference
        lines.append(
            f"- throughput at {top} users >= {factor}x {name}: {imgserve.rps:.1f} vs {reference:.1f}/s "
            f"({_ratio(imgserve.rps, reference)}) — **{'met' if met else 'missed'}**"
        )
    for name in (IMGSERVE, BASELINE):
        at_capacity = by_key[name, top].result  # the load that the overload is 10x of
        overload = by_key[name, plan.overload].result
        p99_cap, p99_over = at_capacity.latency_ms(0.99), overload.latency_ms(0.99)
        growth = _ratio(p99_over or 0, p99_cap or 0)
        verdict = ""
        if name == IMGSERVE:
            met = p99_cap is not None and p99_over is not None and p99_over <= 2 * p99_cap
            verdict = f" — **{'met' if met else 'missed'}** (target <= 2x)"
        lines.append(
            f"- {name} accepted p99 under {plan.overload} users vs at capacity ({at_capacity.users} users): "
            f"{_ms(p99_over)} vs {_ms(p99_cap)} ms ({growth}){verdict}"
        )
    at_capacity, in_storm = by_key[IMGSERVE, top], by_key[STORM, plan.overload]
    capacity, storm = at_capacity.result, in_storm.result
    met = storm.rps >= STORM_GOODPUT_FACTOR * capacity.rps
    lines.append(
        f"- goodput at {plan.overload} users ({OVERLOAD_FACTOR}x overload) with immediate retries >= "
        f"{STORM_GOODPUT_FACTOR}x capacity ({top} users): {storm.rps:.1f} vs {capacity.rps:.1f}/s "
        f"({_ratio(storm.rps, capacity.rps)}; {storm.shed} rejections, {storm.shed / plan.seconds:.0f}/s) "
        f"— **{'met' if met else 'missed'}**"
    )
    p99_storm, p99_cap = storm.latency_ms(0.99), capacity.latency_ms(0.99)
    met = p99_storm is not None and p99_cap is not None and p99_storm <= 2 * p99_cap
    lines.append(
        f"- imgserve accepted p99 in the retry storm vs at capacity ({top} users): {_ms(p99_storm)} vs "
        f"{_ms(p99_cap)} ms ({_ratio(p99_storm or 0, p99_cap or 0)}) — **{'met' if met else 'missed'}** (target <= 2x)"
    )
    lines.append(f"- {storm_costs(at_capacity, in_storm, plan.seconds)}")
    failed = {name: sum(c.result.failed for c in by_key.values() if c.server == name) for name in by_name}
    failed[IMGSERVE] += storm.failed
    lines.append(
        f"- failed requests other than 503/504: imgserve {failed[IMGSERVE]} — "
        f"**{'met' if failed[IMGSERVE] == 0 else 'missed'}** (baseline {failed[BASELINE]}, "
        f"plain LitServe {failed[PLAIN]})"
    )
    return lines


def storm_costs(capacity: Cell, storm: Cell, seconds: float) -> str:
    """Where the retry storm's CPU goes: the extra CPU of the server and of the clients over the capacity cell,
    per rejection (both sides' work per answer is about the same in the two cells)."""
    rejections_per_s = storm.result.shed / seconds
    if not rejections_per_s:
        return "retry storm: no rejection"
    answers = storm.result.rps / max(capacity.result.rps, 1e-9)  # the storm's answers, in capacity cells
    extra_server = storm.server_cores - capacity.server_cores * answers
    extra_client = storm.client_cores - capacity.client_cores * answers
    return (
        f"retry storm's CPU per rejection, beyond the work of its answers: server "
        f"{1e6 * extra_server / rejections_per_s:.0f} us, clients {1e6 * extra_client / rejections_per_s:.0f} us "
        f"({rejections_per_s:.0f} rejections/s: server +{extra_server:.2f}, clients +{extra_client:.2f} cores)"
    )


@dataclass(frozen=True)
class Limits:
    """The in-process limit measured right before imgserve, in NCHW, and again right after imgserve."""

    limit: Limit
    nchw: Limit
    after_images_per_s: float

    @property
    def reference(self) -> float:
        """What imgserve is held to: the higher of the two measurements, as the machine's speed drifts."""
        return max(self.limit.images_per_s, self.after_images_per_s)


def render(plan: Plan, limits: Limits, cells: list[Cell], info: dict, command: str, host: str) -> str:
    """The markdown report: setup, throughput with ratios, latency/errors/memory per cell, targets."""
    limit, nchw, reference = limits.limit, limits.nchw, limits.reference
    by_key = {(c.server, c.result.users): c for c in cells}
    by_batch = ", ".join(f"{b}: {v:.1f}" for b, v in limit.by_batch.items())
    settings = ", ".join(
        f"{k} {info[k]}"
        for k in ("device", "max_batch_size", "batch_timeout_ms", "max_queue_depth", "workers")
        if k in info
    )
    label = {u: f"{u} (10x overload)" if u == plan.overload else str(u) for u in plan.concurrencies}
    lines = [
        f"Command: `{command}`  ",
        f"Machine: {host}  ",
        f"Run: {datetime.datetime.now().isoformat(timespec='minutes')}, closed loop, {plan.seconds:g} s per cell "
        f"after {plan.warmup_s:g} s warm-up, 8 mixed-size images (64x64 to 192x192, JPEG/PNG) as multipart, "
        "JPEG answers checked (decodes, right size); rejected clients wait Retry-After (<= 1 s), except in the "
        f"retry storm ({STORM!r}: the overload's users resend at once on 503/504; answers/s there is the goodput).  ",
        f"In-process limit, measured right before imgserve: **{limit.images_per_s:.1f} images/s** "
        f"(best batch {limit.best_batch}; images/s by batch {by_batch}); right after imgserve: "
        f"{limits.after_images_per_s:.1f}; ratios use the higher, {reference:.1f}. The same in NCHW memory, as the "
        f"baseline and plain LitServe run the model: {nchw.images_per_s:.1f} images/s at batch {nchw.best_batch}.  ",
        f"imgserve: {settings or 'defaults'}.",
        "",
        "| users | baseline /s | plain LitServe /s | imgserve /s "
        "| imgserve/limit | imgserve/baseline | imgserve/plain |",
        "|---|---|---|---|---|---|---|",
    ]
    for users in plan.concurrencies:
        base, plain, ours = (by_key[name, users].result.rps for name in (BASELINE, PLAIN, IMGSERVE))
        lines.append(
            f"| {label[users]} | {base:.1f} | {plain:.1f} | {ours:.1f} | {_ratio(ours, reference)} "
            f"| {_ratio(ours, base)} | {_ratio(ours, plain)} |"
        )
    with_gpu = any(c.peak_gpu_bytes is not None for c in cells)
    lines += [
        "",
        "| server | users | answers/s | p50 ms | p99 ms | answered | shed 503/504 | failed | client CPU cores "
        "| server CPU cores | peak PSS MiB" + (" | peak GPU MiB |" if with_gpu else " |"),
        "|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if with_gpu else ""),
    ]
    for cell in cells:
        r = cell.result
        row = (
            f"| {cell.server} | {label[r.users]} | {r.rps:.1f} | {_ms(r.latency_ms(0.5))} | {_ms(r.latency_ms(0.99))} "
            f"| {len(r.answered)} | {r.shed} | {r.failed} | {cell.client_cores:.2f} | {cell.server_cores:.2f} "
            f"| {cell.peak_pss_bytes / 2**20:.0f} |"
        )
        if with_gpu:
            row += f" {(cell.peak_gpu_bytes or 0) / 2**20:.0f} |"
        lines.append(row)
    lines += ["", "Targets (measured):", *_targets(plan, reference, by_key), *failures_seen(cells)]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtests.bench", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short cells at 1 and 20 users (+10x): a smoke run")
    parser.add_argument("--out", type=Path, default=None, help="markdown report (default loadtests/results/...)")
    args = parser.parse_args(argv)
    args.out = args.out or Path("loadtests/results/bench.md")
    plan = Plan.make(args.quick)
    cells, info = [], {}
    with tempfile.TemporaryDirectory(prefix="imgserve-bench-") as logs:
        for contender in CONTENDERS:
            if contender.name == IMGSERVE:  # next to the server it is compared with: this machine's speed drifts
                print(f"in-process limit ({plan.limit_seconds:g} s per batch size)...", flush=True)
                limit = measure_limit(plan.batch_sizes, plan.limit_seconds)
                nchw = measure_limit((limit.best_batch,), plan.limit_seconds, channels_last=False)
            print(f"{contender.name}:", flush=True)
            server_cells, server_info = bench_server(contender, plan, Path(logs))
            cells += server_cells
            if contender.name == IMGSERVE:
                info = server_info
    after = measure_limit((limit.best_batch,), plan.limit_seconds)
    command = shlex.join(["python", "-m", "loadtests.bench", *(argv if argv is not None else sys.argv[1:])])
    return publish(render(plan, Limits(limit, nchw, after.images_per_s), cells, info, command, machine()), args.out)


if __name__ == "__main__":
    sys.exit(main())
