"""What oneDNN runs in each call of the model alone, eager and as `--compile` runs it on a CPU: its convolutions and
its reorders per call, with their milliseconds, at each batch size.

`python -m loadtests.weight_reorders [--ways eager aoti-frozen] [--batches 1 2 4 8] [--threads 1] [--calls 3]
[--out ...md]`

The benchmark's ResNet-50 (loadtests/lib/resnet.py), each way as loadtests.compile_ways builds it, in a fresh
process with ONEDNN_VERBOSE=1: oneDNN logs each primitive it executes, with its milliseconds. The package is made for
every thread count given (`--threads 2 1`: a worker's on 2 cores), then each batch size is called on each count; its
first call is a warm-up, and the report gives the median of the calls after it. A reorder copies a tensor
into the layout a primitive wants: in these models, a convolution's weights into oneDNN's blocked layout, so it
costs the same whatever the batch, and it is paid at every call where the weights were not packed in advance.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from loadtests import compile_ways
from loadtests.lib import resnet
from loadtests.lib.report import machine, publish

MARK = "imgserve-call"  # the line the measured process prints after each call: batch and milliseconds
COUNTED = ("convolution", "reorder")  # the primitives reported; the rest are counted in the call's time only


@dataclass
class Call:
    """One call: its batch, its milliseconds end to end, and oneDNN's primitives in it: count and milliseconds."""

    threads: int
    batch: int
    ms: float = 0.0
    count: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COUNTED, 0))
    primitive_ms: dict[str, float] = field(default_factory=lambda: dict.fromkeys(COUNTED, 0.0))


def run_calls(
    way: str, path: Path, folder: Path, size: int, batches: Sequence[int], threads: Sequence[int], calls: int
) -> None:
    """In the measured process: on each thread count, a warm-up and `calls` calls per batch size, each followed by
    its MARK line."""
    folder.mkdir(mode=0o700, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder)
    torch.set_num_threads(threads[0])
    model = compile_ways.model_for(way, path, folder, max(batches), threads)
    with torch.inference_mode():
        for count in threads:
            torch.set_num_threads(count)
            for batch in batches:
                pixels = compile_ways.pixels(batch, size)
                model(pixels)
                print(f"{MARK} warm-up", flush=True)
                for _ in range(calls):
                    started = time.perf_counter()
                    model(pixels)
                    print(f"{MARK} {count} {batch} {1000 * (time.perf_counter() - started):.3f}", flush=True)


def parse(log: str) -> list[Call]:
    """The calls in a measured process's output: oneDNN's `primitive,exec` lines before each MARK line are its."""
    found, pending = [], Call(0, 0)
    for line in log.splitlines():
        if line.startswith(MARK):
            fields = line.split()
            if fields[1] != "warm-up":
                pending.threads, pending.batch, pending.ms = int(fields[1]), int(fields[2]), float(fields[3])
                found.append(pending)
            pending = Call(0, 0)
        elif line.startswith("onednn_verbose") and ",primitive,exec," in line:
            fields = line.split(",")
            kind = fields[5]
            if kind in pending.count:
                pending.count[kind] += 1
                pending.primitive_ms[kind] += float(fields[-1])
    return found


def measure(
    way: str, path: Path, folder: Path, size: int, batches: Sequence[int], threads: Sequence[int], calls: int
) -> list[Call]:
    """`way`'s calls, run in a fresh process with oneDNN's log on."""
    options = ("--calls", str(calls), "--threads", *map(str, threads))
    module = "loadtests.weight_reorders"
    return parse(compile_ways.in_a_process(module, way, path, folder, size, batches, *options, ONEDNN_VERBOSE="1"))


def report(found: dict[str, list[Call]], batches: Sequence[int], threads: Sequence[int]) -> list[str]:
    """Per way, thread count and batch: the call's milliseconds, and oneDNN's convolutions and reorders in it
    (medians)."""
    lines = [
        "| way | threads | batch | call ms | convolutions | their ms | reorders | their ms | reorders' share |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for way, calls in found.items():
        for count, batch in ((count, batch) for count in threads for batch in batches):
            mine = [call for call in calls if (call.threads, call.batch) == (count, batch)]
            ms = statistics.median(call.ms for call in mine)
            cells = [f"{ms:.1f}"]
            for kind in COUNTED:
                cells.append(f"{statistics.median(call.count[kind] for call in mine):g}")
                cells.append(f"{statistics.median(call.primitive_ms[kind] for call in mine):.1f}")
            share = statistics.median(call.primitive_ms["reorder"] / call.ms for call in mine)
            lines.append(f"| {way} | {count} | {batch} | {' | '.join(cells)} | {100 * share:.0f}% |")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtests.weight_reorders", description=__doc__.split("\n")[0])
    parser.add_argument("--ways", nargs="+", choices=compile_ways.WAYS, default=["eager", "aoti-frozen"])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8], help="batch sizes called")
    parser.add_argument("--threads", type=int, nargs="+", default=[1], help="torch thread counts, the package's too")
    parser.add_argument("--calls", type=int, default=3, help="calls counted per batch size, after a warm-up")
    parser.add_argument("--out", type=Path, default=Path("loadtests/results/weight_reorders.md"), help="report")
    compile_ways.add_process_arguments(parser)
    args = parser.parse_args(argv)
    if args.one:
        run_calls(args.one, args.model, args.work, args.size, args.batches, args.threads, args.calls)
        return 0
    with tempfile.TemporaryDirectory(prefix="weight-reorders-") as work:
        model = args.model or resnet.export(Path(work, "resnet50.pt2"))
        found = {
            way: measure(way, model, Path(work, way), args.size, args.batches, args.threads, args.calls)
            for way in args.ways
        }
    command = shlex.join(["python", "-m", "loadtests.weight_reorders", *(argv or sys.argv[1:])])
    text = (
        f"# oneDNN's work in each call, the model alone ({datetime.date.today()})\n\n`{command}` on {machine()}: "
        f"{args.calls} calls per thread count and batch size after a warm-up, medians.\n\n"
        + "\n".join(report(found, args.batches, args.threads))
        + "\n"
    )
    return publish(text, args.out)


if __name__ == "__main__":
    sys.exit(main())
