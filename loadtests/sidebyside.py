"""imgserve against imgserve: the same cells served in turns by different source trees or settings, in one run.

`python -m loadtests.sidebyside [--before DIR] [--tracing] [--storm] [--rounds 3] [--seconds 10] --out FILE.md`

What a change did to speed is read side by side, never against a figure measured earlier on a machine whose speed
drifts: each round starts a fresh server of every contender in turn (in reverse order every other round, so none
always runs first) and runs every cell on it.
- With `--before DIR` (a checkout of the code before a change, e.g. `git worktree add /tmp/before <commit>`), the
  built-in denoiser of that tree against this one's: one user (c=1) and 64 users on the benchmark's images; and the
  near-free model file of that tree against this one's.
- With `--tracing`, also this tree's denoiser with OpenTelemetry tracing on, 10% of the requests sampled
  (parentbased_traceidratio 0.1), its spans exported over OTLP/HTTP to a sink in this process
  (loadtests/lib/otlp_sink.py), at 64 users.
- With `--storm`, also a retry storm on each denoiser: 640 users (10x the 64) resending at once on 503; its
  goodput (answers/s) is divided by the same server's 64-user answers/s.
Each cell's first contender is the reference the others are divided by (the code before, when given). Every server's
summed PSS is read once it is ready and has idled (IDLE_S), before any load: the idle server's memory.
- Always, in this tree: a near-free model (x.clamp(0, 1)) served as a model file by the built-in API, against the
  same work written as a user's own ImageAPI (loadtests/lib/toy_apis.py), 128x128 JPEGs at 64 users; and the CPU
  the server used per answer, with the workers' part of it, which shows where the work ran.
A ratio row gives each round's ratio (its two cells measured minutes apart) beside the ratio of the medians.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from imgserve.testing import RunningServer, free_port, serve_command
from loadtests.lib.closed_loop import Check, run_closed_loop
from loadtests.lib.images import SampleImage, sample_images, square_jpegs
from loadtests.lib.otlp_sink import otlp_sink
from loadtests.lib.report import machine, publish
from loadtests.lib.servers import SOURCE, CpuWindow, running_server
from loadtests.overhead import write_clamp_model

REPO = SOURCE.parent
IDLE_S = 2.0  # a fresh server idles this long before its idle PSS is read
STORM_USERS = 640
T = TypeVar("T")


@dataclass(frozen=True)
class Contender:
    """A server: the source tree it runs, its settings, any other environment (OTEL_* variables), and how long it
    may take to be ready."""

    name: str
    source: Path
    settings: dict[str, str]
    env: dict[str, str] = field(default_factory=dict)
    ready_timeout_s: float = 180


@dataclass(frozen=True)
class Cell:
    """A load: images and users, against some of the contenders; how its answers are checked (default: an image of
    the upload's size) and how long it warms up."""

    name: str
    images: tuple[SampleImage, ...]
    users: int
    contenders: tuple[str, ...]
    retry_at_once: bool = False  # a retry storm: a refused user resends at once
    check: Check | None = None
    warmup_s: float = 2.0


@dataclass
class Results:
    """Answers/s, p50 and p99 (ms) and server CPU ms per answer, per (cell, contender), one value per round."""

    rps: dict[tuple[str, str], list[float]] = field(default_factory=dict)
    p50: dict[tuple[str, str], list[float]] = field(default_factory=dict)
    p99: dict[tuple[str, str], list[float]] = field(default_factory=dict)
    cpu_ms: dict[tuple[str, str], list[float]] = field(default_factory=dict)
    worker_ms: dict[tuple[str, str], list[float]] = field(default_factory=dict)  # the workers' part of cpu_ms
    idle_pss: dict[str, list[int]] = field(default_factory=dict)  # per contender, bytes

    def add(self, key: tuple[str, str], rps: float, p50: float, p99: float, cpu_ms: float, worker_ms: float) -> None:
        tables = (self.rps, self.p50, self.p99, self.cpu_ms, self.worker_ms)
        for table, value in zip(tables, (rps, p50, p99, cpu_ms, worker_ms), strict=True):
            table.setdefault(key, []).append(value)


def contenders(before: Path | None, work: Path, traces_to: str | None = None) -> list[Contender]:
    """Every server of the run; with `traces_to` (an OTLP/HTTP endpoint) also the traced denoiser."""
    clamp = str(write_clamp_model(work / "clamp.ts"))
    found = [
        Contender("denoiser", SOURCE, {}),
        Contender("near-free model file", SOURCE, {"model": clamp}),
        Contender("near-free ImageAPI", SOURCE, {"api": "loadtests.lib.toy_apis:NearFree"}),
    ]
    if before is not None:
        found.append(Contender("denoiser before", before / "service", {}))
        found.append(Contender(NEAR_FREE_BEFORE, before / "service", {"model": clamp}))
    if traces_to is not None:
        sampled = {"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.1"}
        found.append(Contender(TRACED, SOURCE, {}, {"OTEL_EXPORTER_OTLP_ENDPOINT": traces_to, **sampled}))
    return found


TRACED = "denoiser traced 10%"
NEAR_FREE_BEFORE = "near-free model file before"
C64, STORM = "denoiser, bench images, c=64", f"denoiser, retry storm, c={STORM_USERS} resending at once"


def cells(before: Path | None, traced: bool = False, storm: bool = False) -> list[Cell]:
    denoisers = ("denoiser before", "denoiser") if before is not None else ("denoiser",)
    near_free: tuple[str, ...] = ("near-free model file", "near-free ImageAPI")
    if before is not None:
        near_free = (NEAR_FREE_BEFORE, *near_free)
    found = [
        Cell("denoiser, bench images, c=1", sample_images(), 1, denoisers),
        Cell(C64, sample_images(), 64, (*denoisers, *([TRACED] if traced else []))),
        Cell("near-free, 128x128, c=64", square_jpegs(128), 64, near_free),
    ]
    if storm:
        found.append(Cell(STORM, sample_images(), STORM_USERS, denoisers, retry_at_once=True))
    return found


def turns(servers: list[T], index: int) -> list[T]:
    """The contenders in round `index`'s order: reversed every other round, so none always runs first."""
    return servers if index % 2 == 0 else servers[::-1]


@contextlib.contextmanager
def serving(contender: Contender, work: Path) -> Iterator[tuple[RunningServer, float]]:
    """A fresh server of `contender` until the block ends, and the seconds it took to be ready."""
    port = free_port()
    env = {f"IMGSERVE_{key.upper()}": value for key, value in contender.settings.items()} | contender.env
    env["PYTHONPATH"] = str(REPO)  # loadtests.lib.toy_apis for the user API
    log = work / f"{contender.name.replace(' ', '-')}-{port}.log"
    started = time.monotonic()
    command, ready = serve_command(port), contender.ready_timeout_s
    with running_server(command, port, log, "/health/ready", env, ready, contender.source) as server:
        yield server, time.monotonic() - started


def run_cell(server: RunningServer, name: str, cell: Cell, seconds: float, results: Results) -> None:
    """One cell's load on a running server (contender `name`): its answers/s, p50/p99 and the server's CPU per answer
    go into `results`; an answer that fails its check stops the run."""
    with CpuWindow(server, cell.warmup_s, seconds) as window:
        result = run_closed_loop(
            f"{server.url}/predict",
            cell.users,
            seconds,
            cell.warmup_s,
            images=cell.images,
            check=cell.check,
            retry_at_once=cell.retry_at_once,
        )
    print(
        f"  {name}, {cell.name}: {result.rps:.1f}/s, {len(result.answered)} answered, {result.shed} shed, "
        f"{result.failed} failed",
        flush=True,
    )
    if result.failed:
        raise RuntimeError(f"{name}, {cell.name}: {result.errors()}")
    per_answer_ms = 1000 * seconds / max(len(result.answered), 1)
    p50, p99 = result.latency_ms(0.5) or 0.0, result.latency_ms(0.99) or 0.0
    cpu_ms, worker_ms = window.server_cores * per_answer_ms, window.worker_cores * per_answer_ms
    results.add((cell.name, name), result.rps, p50, p99, cpu_ms, worker_ms)


def run_round(contender: Contender, plan: list[Cell], seconds: float, work: Path, results: Results) -> None:
    """A fresh server of `contender`: its idle PSS, then every cell of the plan it is in."""
    with serving(contender, work) as (server, _):
        time.sleep(IDLE_S)
        results.idle_pss.setdefault(contender.name, []).append(server.tree_pss())
        for cell in plan:
            if contender.name in cell.contenders:
                run_cell(server, contender.name, cell, seconds, results)


def report(results: Results, plan: list[Cell]) -> str:
    lines = [
        "| cell | contender | answers/s (each round) | median /s | p50 ms | p99 ms | server CPU ms/answer "
        "| of it, the workers' |"
    ]
    lines.append("|---|---|---|---|---|---|---|---|")
    for cell in plan:
        for name in cell.contenders:
            key = (cell.name, name)
            rounds_text = ", ".join(f"{value:.1f}" for value in results.rps[key])
            medians = [statistics.median(table[key]) for table in (results.rps, results.p50, results.p99)]
            cpu, workers = statistics.median(results.cpu_ms[key]), statistics.median(results.worker_ms[key])
            lines.append(
                f"| {cell.name} | {name} | {rounds_text} | {medians[0]:.1f} | {medians[1]:.1f} | "
                f"{medians[2]:.1f} | {cpu:.2f} | {workers:.2f} |"
            )
        reference = results.rps[(cell.name, cell.contenders[0])]
        for name in cell.contenders[1:]:
            lines.append(_ratio_line(f"{name} / {cell.contenders[0]}", results.rps[(cell.name, name)], reference))
        if cell.name == STORM:
            for name in cell.contenders:
                storm, own = results.rps[(cell.name, name)], results.rps[(C64, name)]
                lines.append(_ratio_line(f"{name}: storm goodput / its c=64", storm, own))
    if results.idle_pss:
        lines += ["", "| contender | idle PSS MiB (each round) | median MiB |", "|---|---|---|"]
    for name, values in results.idle_pss.items():
        each = ", ".join(f"{value / 2**20:.0f}" for value in values)
        lines.append(f"| {name} | {each} | {statistics.median(values) / 2**20:.0f} |")
    return "\n".join(lines)


def _ratio_line(name: str, values: list[float], reference: list[float]) -> str:
    """A ratio row: each round's ratio (the two measured minutes apart, on a machine whose speed drifts by the hour),
    and the ratio of the medians."""
    each = ", ".join(f"{value / ref:.3f}" if ref else "-" for value, ref in zip(values, reference, strict=True))
    first = statistics.median(reference)
    medians = f"{statistics.median(values) / first:.3f}x" if first else "-"
    return f"| | {name} | {each} | {medians} | | | | |"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, help="a checkout of the code before a change (its denoiser cells)")
    parser.add_argument("--tracing", action="store_true", help="also the denoiser traced, 10%% sampled (c=64)")
    parser.add_argument(
        "--storm", action="store_true", help=f"also a retry storm on the denoisers ({STORM_USERS} users)"
    )
    parser.add_argument("--rounds", type=int, default=3, help="fresh servers of every contender, in turns")
    parser.add_argument("--seconds", type=float, default=10.0, help="measured seconds per cell")
    parser.add_argument("--out", type=Path, help="write the report here too")
    args = parser.parse_args(argv)
    plan = cells(args.before, args.tracing, args.storm)
    results = Results()
    with tempfile.TemporaryDirectory() as directory, otlp_sink() as (endpoint, received):
        work = Path(directory)
        servers = contenders(args.before, work, endpoint if args.tracing else None)
        for index in range(args.rounds):
            for contender in turns(servers, index):
                run_round(contender, plan, args.seconds, work, results)
    exported = f" The traced servers exported {received.exports} batches of spans ({received.bytes} bytes)."
    traces = exported if args.tracing else ""
    command = shlex.join(["python", "-m", "loadtests.sidebyside", *(argv or sys.argv[1:])])
    text = (
        f"# Side by side ({datetime.date.today()})\n\n`{command}` on {machine()}, {args.rounds} rounds of "
        f"{args.seconds:.0f} s per cell.{traces}\n\n{report(results, plan)}\n"
    )
    if args.out is None:
        print(text)
        return 0
    return publish(text, args.out)


if __name__ == "__main__":
    sys.exit(main())
