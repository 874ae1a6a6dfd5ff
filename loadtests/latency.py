"""One request in flight: imgserve's c=1 latency against the same work done in-process, one image at a time.

`python -m loadtests.latency [--quick] --out loadtests/results/latency.md`

Three cells, each next to its in-process reference measured right before and right after it (the faster one is
kept): the built-in denoiser at 128x128 (decode, channels-last model, JPEG encode on one thread), and the near-free
model (loadtests/overhead.py) at 128x128 and 1024x1024. A closed-loop client with one user sends one JPEG after the
other. The targets (docs/benchmarks.md): denoiser 128 p50 <= 1.15x the in-process single-image time, near-free 1024
p50 <= 1.3x, near-free 128 at least 450 answers/s on a 2-core VM.
"""

from __future__ import annotations

import argparse
import datetime
import shlex
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from imgserve.testing import free_port, serve_command
from loadtests.lib.closed_loop import LoadResult, run_closed_loop
from loadtests.lib.images import square_jpegs
from loadtests.lib.report import failures_seen, machine, publish
from loadtests.lib.servers import running_server
from loadtests.overhead import InProcess, measure_inprocess, write_clamp_model


class DenoiserInProcess(InProcess):
    """The built-in denoiser in this process, channels-last as imgserve runs it."""

    def __init__(self) -> None:
        from imgserve.models.loader import load_model

        self.device = torch.device("cpu")
        self.model = load_model("builtin:denoiser").to(memory_format=torch.channels_last).eval()


@dataclass(frozen=True)
class Case:
    """One cell: a model at one image size, and the target its c=1 result is held to."""

    name: str
    side: int
    p50_factor: float | None = None  # p50 <= this x the in-process single-image time
    min_rps: float | None = None  # answers/s at least this


CASES = (
    Case("denoiser", 128, p50_factor=1.15),
    Case("near-free", 128, min_rps=450.0),
    Case("near-free", 1024, p50_factor=1.3),
)


@dataclass(frozen=True)
class Row:
    case: Case
    single_image_ms: float
    result: LoadResult

    def verdict(self) -> str:
        p50, rps = self.result.latency_ms(0.5), self.result.rps
        if self.case.p50_factor is not None:
            met = p50 is not None and p50 <= self.case.p50_factor * self.single_image_ms
            goal = f"p50 <= {self.case.p50_factor}x the in-process single-image time"
            got = f"{p50 or 0:.2f} vs {self.single_image_ms:.2f} ms ({(p50 or 0) / self.single_image_ms:.2f}x)"
        else:
            met = rps >= (self.case.min_rps or 0)
            goal, got = f"answers/s >= {self.case.min_rps:g}", f"{rps:.1f}/s"
        return f"- {self.case.name} {self.case.side}px c=1 {goal}: {got} — **{'met' if met else 'missed'}**"


def measure(case: Case, pipeline: InProcess, model: str, seconds: float, log_dir: Path) -> Row:
    """The in-process single-image time around a c=1 run of imgserve serving `model`."""
    images = square_jpegs(case.side)
    before = measure_inprocess(pipeline, images, 1, seconds).median_ms
    port = free_port()
    env = {"IMGSERVE_MODEL": model}
    log = log_dir / f"latency-{case.name}-{case.side}.log"
    with running_server(serve_command(port), port, log, "/health/ready", env) as server:
        result = run_closed_loop(server.url + "/predict", 1, seconds, min(2.0, seconds / 3), images=images)
    after = measure_inprocess(pipeline, images, 1, seconds).median_ms
    return Row(case, min(before, after), result)


def render(rows: list[Row], command: str, host: str) -> str:
    lines = [
        "# One request in flight: imgserve vs in-process",
        "",
        f"`{command}` on {host}, {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC.",
        "",
        "| model | side | in-process single image ms | imgserve p50 ms | p99 ms | answers/s | p50 / single | failed |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        r, p50 = row.result, row.result.latency_ms(0.5) or 0
        lines.append(
            f"| {row.case.name} | {row.case.side}x{row.case.side} | {row.single_image_ms:.2f} | {p50:.2f} | "
            f"{r.latency_ms(0.99) or 0:.2f} | {r.rps:.1f} | {p50 / row.single_image_ms:.2f}x | {r.failed} |"
        )
    lines += ["", "Targets (measured):", *(row.verdict() for row in rows), *failures_seen(rows)]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtests.latency", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 s per cell instead of 15 s: a smoke run")
    parser.add_argument("--out", type=Path, default=Path("loadtests/results/latency.md"), help="markdown report")
    args = parser.parse_args(argv)
    seconds = 3.0 if args.quick else 15.0
    rows = []
    with tempfile.TemporaryDirectory(prefix="imgserve-latency-") as logs:
        clamp = write_clamp_model(Path(logs) / "clamp.pt")
        pipelines = {"denoiser": DenoiserInProcess(), "near-free": InProcess(clamp, "cpu")}
        models = {"denoiser": "builtin:denoiser", "near-free": str(clamp)}
        for case in CASES:
            print(f"{case.name} {case.side}px...", file=sys.stderr, flush=True)
            rows.append(measure(case, pipelines[case.name], models[case.name], seconds, Path(logs)))
    command = shlex.join(["python", "-m", "loadtests.latency", *(argv if argv is not None else sys.argv[1:])])
    return publish(render(rows, command, machine()), args.out)


if __name__ == "__main__":
    sys.exit(main())
