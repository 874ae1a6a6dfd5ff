"""The ways to compile a model on a CPU, the model alone: what `--compile` does against the ways imgserve does not take.

`python -m loadtests.compile_ways [--rounds 4] [--seconds 3] [--batches 1 5 8] [--out loadtests/results/...md]`

The benchmark's ResNet-50 (loadtests/lib/resnet.py) on pre-decoded channels-last tensors, on one thread, each way in
its own compile cache:
- `eager`: the exported program as it is;
- `compiled`: `torch.compile` with the batch dimension dynamic, as imgserve compiles it (models/compiled.py);
- `static`: one graph per batch size (`dynamic=False`);
- `frozen`: Inductor's freezing (batch norms folded into the convolutions; the weights packed for oneDNN where a
  graph's input size is fixed, as torch.compile's graph for a batch of one is), the config set
  around the compile (`torch.compile(options={"freezing": True})` does not freeze);
- `aoti-frozen`: what `--compile` does on a CPU (models/compiled.py): the program exported again with its batch
  dynamic and frozen into an AOTInductor package, loaded back.
Each round runs every way in a fresh process, in the other order from the round before, so the rounds after the first
find the way's cache filled. Reported per way: images/s at each batch (median of the rounds) and over eager's, the
first round's seconds to warm up (the compile) and the later rounds' (what a restart with the cache costs), the
process's PSS once warm, and the largest difference from eager's logits.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import psutil
import torch

from imgserve.models.compiled import CompiledModel
from loadtests.lib import resnet
from loadtests.lib.report import machine, publish

WAYS = ("eager", "compiled", "static", "frozen", "aoti-frozen")
PROBE_BATCH = 3  # the batch whose logits are held against eager's
Measured = dict[str, Any]  # one process's figures for one way, as its JSON line carries them


@contextlib.contextmanager
def _freezing() -> Iterator[None]:
    import torch._inductor.config as inductor

    with inductor.patch(freezing=True):
        yield


def model_for(
    way: str, path: Path, folder: Path, largest: int, threads: Sequence[int] = ()
) -> Callable[[torch.Tensor], torch.Tensor]:
    """The exported program at `path`, run `way` on batches of up to `largest` (a package packed for the thread
    counts `threads`; none given: the count it is made at); `folder` keeps what the way compiles."""
    if way == "eager":
        return resnet.program(path)
    if way == "compiled":
        return torch.compile(resnet.program(path))
    if way == "static":
        return torch.compile(resnet.program(path), dynamic=False)
    if way == "frozen":
        function = torch.compile(resnet.program(path))

        def frozen(pixels: torch.Tensor) -> torch.Tensor:
            with _freezing():  # read when a graph is compiled, not when torch.compile is called
                return function(pixels)

        return frozen
    if way == "aoti-frozen":  # imgserve's own way, on its first call (models/compiled.py)
        return CompiledModel(resnet.program(path), folder, False, "ways", True, largest, threads)
    raise ValueError(f"unknown way {way!r}")


def pixels(batch: int, size: int, dynamic: bool = True) -> torch.Tensor:
    """A channels-last batch, its batch dimension marked dynamic as imgserve marks it."""
    tensor = torch.rand(batch, 3, size, size).contiguous(memory_format=torch.channels_last)
    if dynamic:
        torch._dynamo.maybe_mark_dynamic(tensor, 0)
    return tensor


def measure_way(way: str, path: Path, folder: Path, size: int, batches: Sequence[int], seconds: float) -> Measured:
    """One way in this process: its warm-up (every batch size once) in seconds, images/s per batch, PSS once warm,
    and its logits on a seeded probe batch (for the comparison with eager's)."""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder / "cache")
    (folder / "cache").mkdir(mode=0o700, exist_ok=True)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    probe = pixels(PROBE_BATCH, size)
    with torch.inference_mode():
        started = time.perf_counter()
        model = model_for(way, path, folder / "cache", max(PROBE_BATCH, *batches))
        for batch in sorted({1, PROBE_BATCH, *batches}):
            model(pixels(batch, size))
        if isinstance(model, CompiledModel) and model.frozen is None:
            raise RuntimeError("the program was not frozen: torch.export could not trace it again")
        warm_s = time.perf_counter() - started
        logits = model(probe)
        rates = {batch: resnet.images_per_s(model, pixels(batch, size), seconds, lambda: None) for batch in batches}
    pss = psutil.Process().memory_full_info().pss
    return {"warm_s": warm_s, "rates": rates, "pss": pss, "logits": logits.flatten()[:2000].tolist()}


def add_process_arguments(parser: argparse.ArgumentParser) -> None:
    """The model, its input size, and the hidden arguments of a measured process (one way, its work folder), which
    `in_a_process` passes."""
    parser.add_argument("--model", type=Path, help="an exported program (default: the benchmark's ResNet-50)")
    parser.add_argument("--size", type=int, default=resnet.INPUT, help="the input's height and width")
    parser.add_argument("--one", choices=WAYS, help=argparse.SUPPRESS)  # the measured process: one way
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)


def in_a_process(
    module: str, way: str, path: Path, folder: Path, size: int, batches: Sequence[int], *options: str, **env: str
) -> str:
    """What `python -m module --one way ...` printed: `way` measured in a fresh process (with `options` and the
    environment variables `env`); its last error line if it failed."""
    command = [sys.executable, "-m", module, "--one", way, "--model", str(path), "--work", str(folder)]
    command += ["--size", str(size), *options, "--batches", *map(str, batches)]
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, **env})
    if done.returncode != 0:
        raise RuntimeError(f"{way} failed: {done.stderr.strip().splitlines()[-1:]}")
    return done.stdout


def report(found: dict[str, list[Measured]], batches: Sequence[int]) -> list[str]:
    """The table: per way, the median images/s at each batch and over eager's, the warm-ups, PSS and logits' gap."""
    eager = {b: statistics.median(r["rates"][str(b)] for r in found["eager"]) for b in batches}
    reference = torch.tensor(found["eager"][0]["logits"])
    head = " | ".join(f"batch {b} /s (x eager)" for b in batches)
    lines = [
        f"| way | {head} | warm-up, first s | warm-up, later s | PSS MiB | largest logit difference |",
        "|---|" + "---|" * (len(batches) + 4),
    ]
    for way, runs in found.items():
        cells = []
        for batch in batches:
            median = statistics.median(r["rates"][str(batch)] for r in runs)
            cells.append(f"{median:.2f} ({median / eager[batch]:.2f}x)")
        later = ", ".join(f"{r['warm_s']:.1f}" for r in runs[1:]) or "-"
        pss = statistics.median(r["pss"] for r in runs) / 2**20
        gap = float((torch.tensor(runs[0]["logits"]) - reference).abs().max())
        lines.append(f"| {way} | {' | '.join(cells)} | {runs[0]['warm_s']:.1f} | {later} | {pss:.0f} | {gap:.2g} |")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtests.compile_ways", description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=4, help="processes per way, in alternating order")
    parser.add_argument("--seconds", type=float, default=3.0, help="timed seconds per batch size")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 5, 8], help="batch sizes timed")
    parser.add_argument("--ways", nargs="+", choices=WAYS, default=list(WAYS), help="the ways run (eager always)")
    parser.add_argument("--out", type=Path, default=Path("loadtests/results/compile_ways.md"), help="markdown report")
    add_process_arguments(parser)  # a round's process prints a JSON line
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(measure_way(args.one, args.model, args.work, args.size, args.batches, args.seconds)))
        return 0
    ways = ["eager", *(way for way in args.ways if way != "eager")]
    with tempfile.TemporaryDirectory(prefix="compile-ways-") as work:
        model = args.model or resnet.export(Path(work, "resnet50.pt2"))
        found: dict[str, list[Measured]] = {way: [] for way in ways}
        for index in range(args.rounds):
            for way in ways if index % 2 == 0 else ways[::-1]:
                folder = Path(work, way)
                folder.mkdir(exist_ok=True)
                seconds = ("--seconds", str(args.seconds))
                printed = in_a_process("loadtests.compile_ways", way, model, folder, args.size, args.batches, *seconds)
                found[way].append(json.loads(printed.splitlines()[-1]))
    command = shlex.join(["python", "-m", "loadtests.compile_ways", *(argv or sys.argv[1:])])
    text = (
        f"# The ways to compile, the model alone ({datetime.date.today()})\n\n`{command}` on {machine()}: one "
        f"thread, {args.rounds} rounds of a fresh process per way, {args.seconds:g} s per batch size.\n\n"
        + "\n".join(report(found, args.batches))
        + "\n"
    )
    return publish(text, args.out)


if __name__ == "__main__":
    sys.exit(main())
