"""imgserve's own cost per image: a near-free model served by imgserve against the same work done in-process.

`python -m loadtests.overhead [--quick] --out loadtests/results/overhead.md`

The model is a TorchScript `x.clamp(0, 1)`, so what is measured is HTTP, decode, moving pixels, tensor conversion
and encode. The in-process limit runs decode -> tensor -> model -> uint8 -> JPEG with plain Pillow and torch in
1 and 2 threads (each on its own images), right before and right after imgserve at each image size; imgserve is
held to the higher throughput and to the lower single-image time.
"""

from __future__ import annotations

import argparse
import datetime
import io
import itertools
import shlex
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import torch
from PIL import Image

from imgserve.config import Settings
from imgserve.testing import RunningServer, free_port, serve_command
from loadtests.lib.closed_loop import LoadResult, run_closed_loop
from loadtests.lib.images import SampleImage, square_jpegs
from loadtests.lib.report import failures_seen, machine, publish
from loadtests.lib.servers import CpuWindow, ResourceSampler, running_server

SIDES = (128, 512, 1024)
CONCURRENCIES = (1, 16, 64)
JPEG_QUALITY = Settings().jpeg_quality  # imgserve's default answer quality
MAX_IMAGES_PER_THREAD = 100_000
MAX_WARMUP_S = 10.0


class Clamp(torch.nn.Module):
    """The near-free model: the input, clamped to [0, 1]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.clamp(0, 1)


def write_clamp_model(path: Path) -> Path:
    """Save the near-free model as TorchScript (what `imgserve serve --model` loads without a factory)."""
    torch.jit.save(torch.jit.script(Clamp()), str(path))
    return path


class InProcess:
    """The limit: the whole per-image pipeline in this process, plain Pillow + torch, no HTTP, no IPC."""

    def __init__(self, model_path: Path, device: str) -> None:
        self.device = torch.device(device)
        self.model = torch.jit.load(str(model_path), map_location=self.device).eval()

    def run(self, data: bytes) -> bytes:
        """JPEG bytes -> decode -> 1x3xHxW float -> model -> uint8 -> JPEG bytes."""
        with Image.open(io.BytesIO(data)) as image:
            pixels = np.array(image.convert("RGB"))
        batch = torch.from_numpy(pixels).to(self.device).permute(2, 0, 1)[None].float().div_(255)
        with torch.inference_mode():
            output = self.model(batch)[0]
        quantised = output.clamp(0, 1).mul(255).round().to(torch.uint8).permute(1, 2, 0).cpu().numpy()
        buffer = io.BytesIO()
        Image.fromarray(quantised).save(buffer, format="JPEG", quality=JPEG_QUALITY)
        return buffer.getvalue()


@dataclass(frozen=True)
class LimitRun:
    """In-process throughput with `threads` threads, and the per-image times (only meaningful for one thread)."""

    threads: int
    images_per_s: float
    median_ms: float


@contextmanager
def _torch_threads(count: int) -> Iterator[None]:
    """One torch thread per pipeline thread, as imgserve runs one single-threaded worker per core."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def measure_inprocess(pipeline: InProcess, images: tuple[SampleImage, ...], threads: int, seconds: float) -> LimitRun:
    """`threads` threads each run the pipeline over its own images, one at a time, for `seconds`."""
    pipeline.run(images[0].data)  # warm-up
    stop_at = time.perf_counter() + seconds
    times: list[list[float]] = [[] for _ in range(threads)]

    def worker(index: int) -> None:
        own = images[index::threads] or images
        for done in range(MAX_IMAGES_PER_THREAD):  # at least one image each, however late the thread starts
            started = time.perf_counter()
            pipeline.run(own[done % len(own)].data)
            times[index].append(time.perf_counter() - started)
            if time.perf_counter() >= stop_at:
                return

    with _torch_threads(1):
        started = time.perf_counter()
        pool = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(threads)]
        for thread in pool:
            thread.start()
        for thread in pool:
            thread.join(timeout=seconds + 60)
        elapsed = time.perf_counter() - started
    every = [t for own in times for t in own]
    return LimitRun(threads, len(every) / elapsed, 1000 * statistics.median(every))


@dataclass(frozen=True)
class SideLimits:
    """The limit at one image size, measured right before and right after imgserve."""

    before: tuple[LimitRun, LimitRun]  # 1 thread, 2 threads
    after: tuple[LimitRun, LimitRun]

    def images_per_s(self, threads: int) -> float:
        """What imgserve is held to: the higher of the two measurements, as the machine's speed drifts."""
        return max(runs[threads - 1].images_per_s for runs in (self.before, self.after))

    @property
    def single_image_ms(self) -> float:
        """One image at a time, one thread: the lower (stricter) of the two measurements."""
        return min(runs[0].median_ms for runs in (self.before, self.after))


@dataclass(frozen=True)
class Plan:
    """Which (side, users) cells to run and how long."""

    cells: tuple[tuple[int, int], ...]
    seconds: float
    warmup_s: float
    limit_seconds: float

    @classmethod
    def make(cls, quick: bool) -> Plan:
        cells = tuple(itertools.product(SIDES, CONCURRENCIES))
        return cls(cells, 3.0, 1.0, 1.0) if quick else cls(cells, 10.0, 2.0, 3.0)

    @classmethod
    def targets_only(cls, seconds: float) -> Plan:
        """Only the cells the targets read, for a short run (the GPU check on a CPU)."""
        return cls(tuple(sorted({(t.side, t.users) for t in TARGETS})), seconds, seconds / 3, seconds / 2)

    def warmup_for(self, users: int, limit_per_s: float) -> float:
        """Long enough for every user's first answer (two rounds at the limit's rate), so the window is steady."""
        return min(max(self.warmup_s, 2 * users / max(limit_per_s, 1e-3)), MAX_WARMUP_S)

    @property
    def sides(self) -> tuple[int, ...]:
        return tuple(sorted({side for side, _ in self.cells}))


@dataclass(frozen=True)
class Cell:
    """imgserve at one image size and concurrency."""

    side: int
    result: LoadResult
    peak_pss_bytes: int
    client_cores: float


@dataclass(frozen=True)
class Target:
    """A target: throughput >= factor x the 2-thread limit, or p50 <= factor x one image's time."""

    side: int
    users: int
    factor: float
    latency: bool = False

    def describe(self) -> str:
        if self.latency:
            return f"{self.side}px c={self.users} p50 <= {self.factor}x the in-process single-image time"
        return f"{self.side}px c={self.users} throughput >= {self.factor}x the in-process 2-thread limit"


TARGETS = (Target(1024, 16, 0.6), Target(128, 64, 0.6), Target(1024, 1, 1.3, latency=True))


@dataclass(frozen=True)
class Verdict:
    """A target as measured: the numbers compared and whether it was met."""

    target: Target
    measured: float
    reference: float
    met: bool

    @property
    def ratio(self) -> float:
        return self.measured / self.reference if self.reference else float("inf")

    def result(self) -> str:
        unit = "ms" if self.target.latency else "/s"
        return f"{self.measured:.1f} vs {self.reference:.1f} {unit} ({self.ratio:.2f}x)"


@dataclass(frozen=True)
class OverheadRun:
    """Everything one overhead run measured."""

    plan: Plan
    limits: dict[int, SideLimits]
    cells: list[Cell]
    info: dict

    def verdicts(self) -> list[Verdict]:
        """Each target whose cell was run, as measured."""
        by_key = {(c.side, c.result.users): c for c in self.cells}
        verdicts = []
        for target in TARGETS:
            cell, limits = by_key.get((target.side, target.users)), self.limits.get(target.side)
            if cell is None or limits is None:
                continue
            if target.latency:
                p50 = cell.result.latency_ms(0.5)
                measured, reference = (p50 or float("inf")), limits.single_image_ms
                met = measured <= target.factor * reference
            else:
                measured, reference = cell.result.rps, limits.images_per_s(2)
                met = measured >= target.factor * reference
            verdicts.append(Verdict(target, measured, reference, met))
        return verdicts


def run_overhead(plan: Plan, log_dir: Path, env: dict[str, str] | None = None) -> OverheadRun:
    """Serve the near-free model with imgserve and measure every cell of `plan` next to the in-process limit."""
    model_path = write_clamp_model(log_dir / "clamp.pt")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    pipeline = InProcess(model_path, device)
    port = free_port()
    command, settings = serve_command(port), {**(env or {}), "IMGSERVE_MODEL": str(model_path)}
    limits, cells = {}, []
    with running_server(command, port, log_dir / "overhead-imgserve.log", "/health/ready", settings) as server:
        info = server_info(server)
        for side in plan.sides:
            images = square_jpegs(side)
            print(f"{side}px: in-process limit ({plan.limit_seconds:g} s per run)...", file=sys.stderr, flush=True)
            before = _limit_pair(pipeline, images, plan.limit_seconds)
            for users in (u for s, u in plan.cells if s == side):
                warmup_s = plan.warmup_for(users, before[1].images_per_s)
                cells.append(_measure_cell(server, side, users, images, plan.seconds, warmup_s))
                print(f"  {side}px users {users:3d}: {_summary(cells[-1])}", file=sys.stderr, flush=True)
            limits[side] = SideLimits(before, _limit_pair(pipeline, images, plan.limit_seconds))
    return OverheadRun(plan, limits, cells, info)


def server_info(server: RunningServer) -> dict:
    """GET /info of a running imgserve."""
    return httpx.get(server.url + "/info", timeout=10).json()


def _limit_pair(pipeline: InProcess, images: tuple[SampleImage, ...], seconds: float) -> tuple[LimitRun, LimitRun]:
    return measure_inprocess(pipeline, images, 1, seconds), measure_inprocess(pipeline, images, 2, seconds)


def _measure_cell(
    server: RunningServer, side: int, users: int, images: tuple[SampleImage, ...], seconds: float, warmup_s: float
) -> Cell:
    with ResourceSampler(server) as sampler, CpuWindow(server, warmup_s, seconds) as cpu:
        result = run_closed_loop(server.url + "/predict", users, seconds, warmup_s, images=images, decode_answers=False)
    return Cell(side, result, sampler.peak_pss_bytes, cpu.client_cores)


def _summary(cell: Cell) -> str:
    r = cell.result
    return f"{r.rps:7.1f}/s p50 {_ms(r.latency_ms(0.5))} p99 {_ms(r.latency_ms(0.99))} shed {r.shed} failed {r.failed}"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def render(run: OverheadRun, command: str, host: str) -> str:
    """The markdown report: setup, one row per cell with the limits and ratios, the targets."""
    plan, info = run.plan, run.info
    settings = ", ".join(
        f"{k} {info[k]}" for k in ("device", "max_batch_size", "workers", "max_queue_depth") if k in info
    )
    lines = [
        f"Command: `{command}`  ",
        f"Machine: {host}  ",
        f"Run: {datetime.datetime.now().isoformat(timespec='minutes')}, closed loop, {plan.seconds:g} s per cell "
        f"after a warm-up of {plan.warmup_s:g} s or two rounds of the users at the limit's rate (<= {MAX_WARMUP_S:g} s)"
        ", 4 seeded synthetic JPEGs per size as multipart, answers checked "
        f"(status, JPEG header, size); in-process limit {plan.limit_seconds:g} s per run, before and after imgserve.  ",
        f"Model: TorchScript `x.clamp(0, 1)`; imgserve: {settings or 'defaults'}.",
        "",
        "| image | users | limit 1 thread /s | limit 2 threads /s | imgserve /s | imgserve / 2-thread limit "
        "| p50 ms | p99 ms | single image in-process ms | p50 / single image | shed | failed | peak PSS MiB "
        "| client CPU cores |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for cell in run.cells:
        limits, r = run.limits[cell.side], cell.result
        two, single, p50 = limits.images_per_s(2), limits.single_image_ms, r.latency_ms(0.5)
        lines.append(
            f"| {cell.side}x{cell.side} | {r.users} | {limits.images_per_s(1):.1f} | {two:.1f} | {r.rps:.1f} "
            f"| {r.rps / two:.2f}x | {_ms(p50)} | {_ms(r.latency_ms(0.99))} | {single:.1f} "
            f"| {'-' if p50 is None else f'{p50 / single:.2f}x'} | {r.shed} | {r.failed} "
            f"| {cell.peak_pss_bytes / 2**20:.0f} | {cell.client_cores:.2f} |"
        )
    lines += ["", "Targets (measured):"]
    lines += [f"- {v.target.describe()}: {v.result()} — **{'met' if v.met else 'missed'}**" for v in run.verdicts()]
    return "\n".join([*lines, *failures_seen(run.cells)]) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtests.overhead", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 s cells, 1 s limit runs: about 2 minutes")
    parser.add_argument("--out", type=Path, default=Path("loadtests/results/overhead.md"), help="markdown report")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="imgserve-overhead-") as logs:
        run = run_overhead(Plan.make(args.quick), Path(logs))
    command = shlex.join(["python", "-m", "loadtests.overhead", *(argv if argv is not None else sys.argv[1:])])
    return publish(render(run, command, machine()), args.out)


if __name__ == "__main__":
    sys.exit(main())
