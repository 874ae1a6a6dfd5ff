"""The headline model: a ResNet-50 classifying 500x375 JPEG photos, served eager and compiled, against the model alone.

`python -m loadtests.resnet50 [--pairs 3] [--seconds 10] [--restarts 2] [--quick] --out loadtests/results/resnet50.md`

- The model alone (loadtests/lib/resnet.py): the exported program on pre-decoded channels-last tensors, on one
  thread at batch 8, eager and compiled (its batch dimension dynamic, as imgserve compiles it), at the start of the
  run and again at its end (the higher is kept). A pod runs one single-thread worker per core, so its limit is that
  rate times its workers.
- Served: `imgserve serve --model resnet50.pt2 --preprocess imagenet`, with --no-compile and with --compile, both
  up at once and loaded in turns, a pair of cells after the other (each pair in the other order), so a shared
  machine's drift falls on both alike: the 500x375 JPEGs from 1, 16 and 64 closed-loop clients, answers/s, p50 and
  p99, and the CPU of the loaded server's processes per answer; from the server's /metrics, its mean batch and the
  model's milliseconds per image in it, against the model alone's.
- Start: the time to ready of the eager server, of the compiled one with an empty compile cache, and of fresh
  compiled servers afterwards, which find the cache filled.
Targets: the compiled server >= 1.2x the eager one at 16 and 64 clients (medians of the pairs); a start with the
cache faster than the first.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import re
import shlex
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch

from imgserve.pod import usable_cpus
from loadtests.lib import resnet
from loadtests.lib.images import check_scores
from loadtests.lib.report import machine, publish
from loadtests.lib.scrape import read_totals
from loadtests.lib.servers import SOURCE
from loadtests.sidebyside import Cell, Contender, Results, report, run_cell, serving, turns

EAGER, COMPILED = "eager", "compiled"
USERS = (1, 16, 64)
ALONE_BATCH = 8
SERVED_GOAL = 1.2  # the compiled server's answers/s over the eager one's, at 16 and 64 clients
COMPILE_READY_S = 900.0  # a first compile of every batch size, on a busy 2-core machine
MAX_WARMUP_S = 30.0
BATCH_FIGURES = ("imgserve_batch_size_sum", "imgserve_batch_size_count", "imgserve_inference_duration_seconds_sum")
COMPILED_LINE = re.compile(
    r"model compiled for .* in ([\d.]+) s: (\d+ graphs, \d+ of them from the cache|frozen into a package, [a-z ]+)"
)


@dataclass
class Alone:
    """The model alone: images/s per thread (the higher of the two measurements) and the first call's seconds."""

    per_thread: dict[str, float]
    first_call_s: dict[str, float]

    def add(self, name: str, images_per_s: float, first_s: float) -> None:
        self.per_thread[name] = max(self.per_thread.get(name, 0.0), images_per_s)
        self.first_call_s.setdefault(name, first_s)


def measure_alone(model: Path, seconds: float, alone: Alone, cache: Path) -> None:
    """Each way of running the model, on one thread at batch ALONE_BATCH; compiled code is cached in `cache`, apart
    from the servers' (whose first start must find none)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for name in (EAGER, COMPILED):
            rate, first_s = resnet.ModelAlone(model, name == COMPILED, cache).images_per_s(ALONE_BATCH, seconds)
            alone.add(name, rate, first_s)
    finally:
        torch.set_num_threads(threads)


def servers(model: Path, cache: Path) -> list[Contender]:
    common = {"model": str(model), "preprocess": "imagenet", "compile_cache_dir": str(cache)}
    return [
        Contender(EAGER, SOURCE, {**common, "compile": "false"}),
        Contender(COMPILED, SOURCE, {**common, "compile": "true"}, ready_timeout_s=COMPILE_READY_S),
    ]


def cells(limit_per_s: float) -> list[Cell]:
    """The three loads, each warmed up long enough for every user's first two answers at the limit's rate."""
    photos = resnet.photos()
    return [
        Cell(
            f"ResNet-50, 500x375 JPEG, c={users}",
            photos,
            users,
            (EAGER, COMPILED),
            check=check_scores,
            warmup_s=min(max(2.0, 2 * users / limit_per_s), MAX_WARMUP_S),
        )
        for users in USERS
    ]


@dataclass
class Batching:
    """Per (cell, contender), each run's mean batch and the model's ms per image, as the server counted them."""

    runs: dict[tuple[str, str], list[tuple[float, float]]]

    def add(self, key: tuple[str, str], before: dict[str, float], after: dict[str, float]) -> None:
        images, batches, model_s = (after[name] - before[name] for name in BATCH_FIGURES)
        self.runs.setdefault(key, []).append((images / max(batches, 1), 1000 * model_s / max(images, 1)))

    def medians(self, key: tuple[str, str]) -> tuple[float, float]:
        runs = self.runs.get(key) or [(0.0, 0.0)]
        return statistics.median(run[0] for run in runs), statistics.median(run[1] for run in runs)


class Started(NamedTuple):
    """How a server started: the seconds until it was ready, its log then, and its processes' summed PSS then."""

    ready_s: float
    log: str
    pss: int = 0


def measure_served(
    contenders: list[Contender], plan: list[Cell], seconds: float, pairs: int, work: Path
) -> tuple[Results, Batching, dict[str, list[Started]]]:
    """Both servers up; each cell run `pairs` times on each, in turns; how each batched, and how each started."""
    results, batching, starts = Results(), Batching({}), {}
    with contextlib.ExitStack() as stack:
        running = {}
        for contender in contenders:
            server, ready_s = stack.enter_context(serving(contender, work))
            running[contender.name] = server
            starts[contender.name] = [Started(ready_s, server.log(), server.tree_pss())]
        for cell in plan:
            for index in range(pairs):
                for name in turns(list(running), index):
                    before = read_totals(running[name].url, BATCH_FIGURES)
                    run_cell(running[name], name, cell, seconds, results)
                    batching.add((cell.name, name), before, read_totals(running[name].url, BATCH_FIGURES))
    return results, batching, starts


def restarts(contender: Contender, count: int, work: Path) -> list[Started]:
    """Fresh servers of `contender`, one after the other, each stopped once it is ready."""
    found = []
    for _ in range(count):
        with serving(contender, work) as (server, ready_s):
            found.append(Started(ready_s, server.log(), server.tree_pss()))
    return found


def compile_summary(start: Started) -> str:
    """What each worker's log says of its compile: seconds, and the graphs the cache held or where the package came
    from."""
    found = COMPILED_LINE.findall(start.log)
    return " + ".join(f"{seconds} s ({how})" for seconds, how in found) or "-"


def render(
    alone: Alone, results: Results, batching: Batching, plan: list[Cell], starts: dict[str, list[Started]], workers: int
) -> str:
    """The model alone, the served table with each contender against its limit (and how it batched), the start times
    and the targets."""
    lines = [
        "| model alone, 1 thread, batch 8 | images/s | first call s | x workers = the pod's limit /s |",
        "|---|---|---|---|",
    ]
    for name in (EAGER, COMPILED):
        rate = alone.per_thread[name]
        lines.append(f"| {name} | {rate:.1f} | {alone.first_call_s[name]:.1f} | {rate * workers:.1f} |")
    lines += [
        "",
        report(results, plan),
        "",
        "| served | limit /s | median /s | of the limit | mean batch | model ms per image (alone, batch 8) |",
        "|---|---|---|---|---|---|",
    ]
    for cell in plan:
        for name in cell.contenders:
            served, limit = statistics.median(results.rps[cell.name, name]), alone.per_thread[name] * workers
            batch, model_ms = batching.medians((cell.name, name))
            lines.append(
                f"| {cell.name}, {name} | {limit:.1f} | {served:.1f} | {served / max(limit, 1e-9):.2f}x | {batch:.1f} "
                f"| {model_ms:.1f} ({1000 / max(alone.per_thread[name], 1e-9):.1f}) |"
            )
    first, *later = starts[COMPILED]
    lines += [
        "",
        f"Time to ready: eager {', '.join(f'{s.ready_s:.1f}' for s in starts[EAGER])} s; compiled, empty cache "
        f"{first.ready_s:.1f} s (its workers' compile, one at a time: {compile_summary(first)}), the same cache again "
        + ("; ".join(f"{s.ready_s:.1f} s ({compile_summary(s)})" for s in later) or "-")
        + ".",
        "",
        f"Summed PSS of the server's processes at ready: eager {_mib(starts[EAGER])}; compiled {_mib([first])} "
        f"(empty cache), {_mib(later)} (with the cache).",
        "",
        "Targets (measured):",
    ]
    for cell in plan[1:]:
        eager, fast = (statistics.median(results.rps[cell.name, name]) for name in (EAGER, COMPILED))
        met = fast >= SERVED_GOAL * eager > 0
        lines.append(
            f"- {cell.name}: compiled >= {SERVED_GOAL}x eager: {fast:.1f} vs {eager:.1f}/s "
            f"({fast / max(eager, 1e-9):.2f}x) — **{'met' if met else 'missed'}**"
        )
    if later:
        second = statistics.median(s.ready_s for s in later)
        met = second < first.ready_s
        lines.append(
            f"- a start with the cache faster than the first (median): {second:.1f} vs {first.ready_s:.1f} s "
            f"— **{'met' if met else 'missed'}**"
        )
    return "\n".join(lines)


def _mib(starts: list[Started]) -> str:
    return ", ".join(f"{start.pss / 2**20:.0f}" for start in starts) + " MiB" if starts else "-"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtests.resnet50", description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=3, help="cells run on each server, in turns, per load")
    parser.add_argument("--seconds", type=float, default=10.0, help="measured seconds per cell")
    parser.add_argument("--restarts", type=int, default=2, help="compiled servers started after, with the cache")
    parser.add_argument("--quick", action="store_true", help="one pair of 2 s cells, one restart: a smoke run")
    parser.add_argument("--out", type=Path, default=Path("loadtests/results/resnet50.md"), help="markdown report")
    args = parser.parse_args(argv)
    pairs, seconds, restart_count = (1, 2.0, 1) if args.quick else (args.pairs, args.seconds, args.restarts)
    alone = Alone({}, {})
    workers = min(usable_cpus(), 4)  # workers_per_device auto on a CPU
    with tempfile.TemporaryDirectory(prefix="imgserve-resnet50-") as directory:
        work = Path(directory)
        model = resnet.export(work / "resnet50.pt2")
        measure_alone(model, seconds, alone, work / "alone-cache")
        plan = cells(alone.per_thread[EAGER] * workers)
        contenders = servers(model, work / "compiled")
        results, batching, starts = measure_served(contenders, plan, seconds, pairs, work)
        starts[COMPILED] += restarts(contenders[1], restart_count, work)
        measure_alone(model, seconds, alone, work / "alone-cache")
    command = shlex.join(["python", "-m", "loadtests.resnet50", *(argv if argv is not None else sys.argv[1:])])
    header = (
        f"# ResNet-50 ({datetime.date.today()})\n\n`{command}` on {machine()}: {pairs} pairs of {seconds:g} s "
        f"cells per load; imgserve with {workers} workers.\n\n"
    )
    return publish(header + render(alone, results, batching, plan, starts, workers) + "\n", args.out)


if __name__ == "__main__":
    sys.exit(main())
