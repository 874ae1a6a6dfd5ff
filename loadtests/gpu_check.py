"""The prepared GPU check: one call on a machine with an NVIDIA GPU, one table of checks with their goals.

`python -m loadtests.gpu_check [--cell-seconds 3] [--out-dir loadtests/results/gpu_check]`

Each check starts the imgserve it needs on loopback (sequentially, so only one holds the GPU at a time) and
stops it. Without CUDA the GPU rows are `skipped`, saying why; the seed case is measured (`info`: on a CPU the
model's cost grows with the batch, so its goal is a GPU's) and the overhead targets run in a short form. A row
whose check raised is `error`. Exit status: 0 all goals met (or skipped), 1 a goal missed, 2 a check raised.
The table is printed and written to --out-dir as checks.md, with the tables of the overhead benchmark
(overhead.md) and of the ResNet-50 checks (resnet50.md) beside it.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import os
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
import torch
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families

from imgserve import codec
from imgserve.config import COMPILED_BY_DEFAULT
from imgserve.testing import RunningServer, free_port, serve_command
from imgserve.worker.decoding import decode_items, gpu_jpeg_decoder
from loadtests import overhead
from loadtests.lib import gpu_resnet, resnet
from loadtests.lib.closed_loop import run_closed_loop
from loadtests.lib.images import SampleImage, square_jpegs
from loadtests.lib.report import machine
from loadtests.lib.servers import Periodic, running_server

REPO = Path(__file__).resolve().parent.parent
PASS, FAIL, SKIPPED, INFO, ERROR = "pass", "fail", "skipped", "info", "error"
PRECISION_MAX_MEAN_DIFF = 2.0  # mean |fp16/bf16 - fp32| per channel value, on the 0-255 scale
SEED_GOAL = 1.2
SEED_WARMUP_ROUNDS = 5
FLOOD_REQUESTS, FLOOD_USERS, FLOOD_FRACTION = 1000, 200, 0.5
OOM_REQUESTS = 32
SHARED_W = 256 * 2**20  # the weights of loadtests.lib.toy_models:heavy_weights
SHARED_BOUND = SHARED_W / 10
NVML_METRICS = ("imgserve_gpu_utilization_ratio", "imgserve_gpu_memory_used_bytes", "imgserve_gpu_memory_total_bytes")


def overhead_row(target: overhead.Target) -> str:
    what = "p50 vs one image in-process" if target.latency else "vs the 2-thread in-process limit"
    return f"overhead: {target.side}px c={target.users} {what}"


CUDA, NVML, SEED, FP16, BF16 = "CUDA path", "NVML metrics on /metrics", "seed case: 3 parallel vs 1", "fp16", "bf16"
AUTO_WORKERS = "workers_per_device auto"
SHARE, SHARE_RESTART = "shared weights: GPU memory 1 -> 3 workers", "shared weights: after kill -9 of a worker"
SHARE_CONTROL, SHARE_OUTPUTS = "negative control: --no-share-weights", "shared weights: 3 workers' answers"
SHARE_GOAL = "growth <= W/10 beyond the 1 MiB model's growth (the extra CUDA contexts); W = 256 MiB"
RESTART_GOAL = "the new worker starts; GPU memory vs just before the kill grows <= W/10 (a private copy: +W)"
AUTO, FLOOD, OOM = "max_batch_size auto", f"peak GPU memory, {FLOOD_REQUESTS}-request flood", "OOM split-and-retry"
DECODE_SIDES, DECODE_BATCH, DECODE_DEVICE = (224, 512, 1024), 32, "cuda:0"
DEVICE_DECODE = tuple(f"decode on the device vs on the CPU, {side}px" for side in DECODE_SIDES)
RESNET_COMPILED = "ResNet-50 alone: compiled vs eager"
RESNET_HTTP, RESNET_GRPC = "ResNet-50 from JPEGs over HTTP", "ResNet-50 from JPEGs over gRPC"
RESNET_GOAL = f"measured: c={'/'.join(map(str, gpu_resnet.USERS))} vs the model alone, GPU busy (NVML); none failed"
PRECISION_GOAL = f"starts; mean abs diff vs fp32 <= {PRECISION_MAX_MEAN_DIFF:g}/255"
GOALS = {
    CUDA: "/info device is cuda",
    NVML: ", ".join(NVML_METRICS),
    SEED: f"<= {SEED_GOAL}x (on a GPU)",
    FP16: PRECISION_GOAL,
    BF16: PRECISION_GOAL,
    AUTO: "an int in 1..256, measured at warm-up",
    FLOOD: f"growth <= gpu_memory_fraction ({FLOOD_FRACTION}) x free memory at idle; only 200/503/504",
    OOM: f"imgserve_oom_splits_total rises; all {OOM_REQUESTS} parallel requests 200",
    AUTO_WORKERS: "1..4 workers per GPU, from a measured probe batch (/info workers_per_device_why)",
    SHARE: SHARE_GOAL,
    SHARE_RESTART: RESTART_GOAL,
    SHARE_CONTROL: "private copies miss that bound (about 2 W): the check can fail",
    SHARE_OUTPUTS: "as the 1-worker server answers (mean abs diff <= 1/255)",
    **{name: "nvJPEG decodes a batch faster than Pillow on the CPU threads" for name in DEVICE_DECODE},
    RESNET_COMPILED: "compile's default on cuda (config.COMPILED_BY_DEFAULT) is the faster one",
    RESNET_HTTP: RESNET_GOAL,
    RESNET_GRPC: RESNET_GOAL,
    **{overhead_row(t): f"{'<=' if t.latency else '>='} {t.factor}x" for t in overhead.TARGETS},
}


@dataclass(frozen=True)
class Row:
    """One line of the table."""

    check: str
    result: str
    goal: str
    status: str

    @classmethod
    def of(cls, check: str, result: str, ok: bool) -> Row:
        return cls(check, result, GOALS[check], PASS if ok else FAIL)

    @classmethod
    def skipped(cls, check: str, why: str = "no CUDA device") -> Row:
        return cls(check, why, GOALS[check], SKIPPED)


@dataclass
class Context:
    """What every check may use: CUDA or not, where logs go, how long a load cell lasts, the fp32 reference, and
    the reports the checks leave (file name -> markdown)."""

    cuda: bool
    log_dir: Path
    cell_seconds: float
    reference_png: bytes | None = None
    reports: dict[str, str] = field(default_factory=dict)


@contextlib.contextmanager
def imgserve(context: Context, name: str, **settings: str) -> Iterator[RunningServer]:
    """`imgserve serve` on a free loopback port with IMGSERVE_<NAME> settings (gRPC only with a grpc_port); stopped
    (process tree) afterwards."""
    port, grpc_port = free_port(), int(settings.pop("grpc_port", 0))
    env = {f"IMGSERVE_{key.upper()}": value for key, value in settings.items()}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    log = context.log_dir / f"{name}.log"
    with running_server(serve_command(port, grpc_port), port, log, "/health/ready", env) as server:
        yield server


def info(server: RunningServer) -> dict:
    return httpx.get(server.url + "/info", timeout=10).json()


def metric_samples(server: RunningServer) -> dict[str, float]:
    """Every sample on /metrics, summed over labels, by sample name."""
    response = httpx.get(server.url + "/metrics", timeout=10)
    response.raise_for_status()
    sums: dict[str, float] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
    return sums


def predict(
    server: RunningServer, image: SampleImage, fmt: str | None = "png", client: httpx.Client | None = None
) -> bytes:
    """POST one image, asking for a lossless answer (fmt None: the server's default, JPEG), on `client`'s kept-alive
    connection or a new one; raises on anything but 200."""
    response = (client or httpx).post(
        server.url + "/predict",
        params={"format": fmt} if fmt else {},
        files={"file": (image.name, image.data, image.content_type)},
        timeout=60,
    )
    response.raise_for_status()
    return response.content


def mean_abs_diff(a: bytes, b: bytes) -> float:
    """Mean |a - b| of two encoded images' pixels, on the 0-255 scale."""
    pixels = [np.asarray(Image.open(io.BytesIO(data)).convert("RGB"), dtype=np.float32) for data in (a, b)]
    return float(np.abs(pixels[0] - pixels[1]).mean())


def seed_ratio(server: RunningServer, image: SampleImage, rounds: int) -> tuple[float, float]:
    """Median latency (s) of one request alone, and of the slowest of 3 sent together (the seed's complaint), with
    the default answer (a PNG's encoding, 25 ms at 512x512, would time Pillow's zlib). Each of the 3 users keeps its
    connection: a new httpx client loads its CA bundle (~20 ms), which 3 threads pay in turn under the GIL. Warm-up
    rounds let every worker see the size first (its first batch of a new shape loads kernels)."""

    def timed(client: httpx.Client) -> float:
        started = time.perf_counter()
        predict(server, image, fmt=None, client=client)
        return time.perf_counter() - started

    with contextlib.ExitStack() as stack, ThreadPoolExecutor(3) as pool:
        clients = [stack.enter_context(httpx.Client()) for _ in range(3)]
        for _ in range(SEED_WARMUP_ROUNDS):
            list(pool.map(timed, clients))
        alone = statistics.median(timed(clients[0]) for _ in range(rounds))
        together = statistics.median(max(pool.map(timed, clients)) for _ in range(rounds))
    return alone, together


def check_default_server(context: Context) -> list[Row]:
    """CUDA path, NVML metrics and the seed case, on imgserve with its defaults; keeps the fp32 reference answer."""
    rows = [Row.skipped(CUDA), Row.skipped(NVML), Row.skipped(AUTO_WORKERS)]
    image = square_jpegs(512)[0]
    with imgserve(context, "default") as server:
        described = info(server)
        device = described["device"]
        if context.cuda:
            workers, why = described["workers_per_device"], described["workers_per_device_why"]
            context.reference_png = predict(server, image)
            present = [name for name in NVML_METRICS if name in metric_samples(server)]
            found = f"{len(present)} of {len(NVML_METRICS)} present" + (
                "" if present else " (is imgserve[gpu] installed?)"
            )
            rows = [
                Row.of(CUDA, f"/info device {device}", device.startswith("cuda")),
                Row.of(NVML, found, len(present) == len(NVML_METRICS)),
                Row.of(AUTO_WORKERS, f"{workers}: {why}", 1 <= workers <= 4 and "on the GPU" in why),
            ]
        alone, together = seed_ratio(server, image, rounds=10 if context.cuda else 3)
    ratio = together / alone
    seed = Row.of(
        SEED,
        f"{ratio:.2f}x ({1000 * together:.1f} vs {1000 * alone:.1f} ms, 512x512 JPEG, {device})",
        ratio <= SEED_GOAL,
    )
    if not context.cuda:  # a CPU's cost grows with the batch: measured, but the goal is a GPU's
        seed = Row(seed.check, seed.result, seed.goal, INFO)
    return [*rows, seed]


def check_precision(context: Context, precision: str) -> list[Row]:
    """A server in fp16/bf16 answers a real image close to the fp32 server's answer."""
    if context.reference_png is None:
        return [Row.of(precision, "no fp32 reference answer", False)]
    with imgserve(context, precision, precision=precision) as server:
        served = info(server)["precision"]
        diff = mean_abs_diff(predict(server, square_jpegs(512)[0]), context.reference_png)
    ok = served == precision and diff <= PRECISION_MAX_MEAN_DIFF
    return [Row.of(precision, f"/info precision {served}; mean abs diff {diff:.2f}/255", ok)]


class MemoryWatch(Periodic):
    """Samples imgserve_gpu_memory_used_bytes from /metrics in a thread; keeps the peak."""

    def __init__(self, server: RunningServer, interval_s: float = 0.2) -> None:
        self.server, self.peak = server, 0.0
        super().__init__(self._sample, interval_s)

    def _sample(self) -> None:
        with contextlib.suppress(httpx.HTTPError, ValueError):
            used = metric_samples(self.server).get("imgserve_gpu_memory_used_bytes", 0.0)
            self.peak = max(self.peak, used)


def check_auto_batch_and_flood(context: Context) -> list[Row]:
    """max_batch_size auto's choice, then peak GPU memory under a 1000-request flood vs gpu_memory_fraction."""
    settings = {"max_batch_size": "auto", "gpu_memory_fraction": str(FLOOD_FRACTION)}
    with imgserve(context, "auto-batch", **settings) as server:
        described = info(server)
        batch, budget = described["max_batch_size"], described["batch_element_budget"]
        chose = isinstance(batch, int) and 1 <= batch <= 256 and budget > 0
        rows = [Row.of(AUTO, f"batch {batch}, pixel budget {budget} px", chose)]
        idle = metric_samples(server)
        if "imgserve_gpu_memory_used_bytes" not in idle:
            return [*rows, Row.of(FLOOD, "imgserve_gpu_memory_used_bytes is not on /metrics", False)]
        idle_used, total = idle["imgserve_gpu_memory_used_bytes"], idle["imgserve_gpu_memory_total_bytes"]
        with MemoryWatch(server) as watch:
            flood = run_closed_loop(
                server.url + "/predict",
                FLOOD_USERS,
                seconds=300,
                images=square_jpegs(1024),
                decode_answers=False,
                max_requests=FLOOD_REQUESTS,
            )
    allowed = FLOOD_FRACTION * (total - idle_used)
    growth = watch.peak - idle_used
    gib = 2**30
    result = (
        f"peak {watch.peak / gib:.1f} GiB (idle {idle_used / gib:.1f}, +{growth / gib:.1f}, allowed +"
        f"{allowed / gib:.1f}) of {total / gib:.0f}; {len(flood.outcomes)} sent, {len(flood.answered)} answered, "
        f"{flood.shed} shed, {flood.failed} failed"
    )
    ok = growth <= allowed and flood.failed == 0 and len(flood.outcomes) == FLOOD_REQUESTS
    return [*rows, Row.of(FLOOD, result, ok)]


def check_oom_split(context: Context) -> list[Row]:
    """A model that runs out of memory on every batch of 2+: batches are split, every request still answered."""
    weights = context.log_dir / "empty-state.pt"
    torch.save({}, weights)
    settings = {
        "model": str(weights),
        "model_factory": "loadtests.lib.toy_models:batch_hungry",
        "batch_timeout_ms": "50",
    }
    with imgserve(context, "oom", **settings) as server:
        before = metric_samples(server).get("imgserve_oom_splits_total", 0.0)
        result = run_closed_loop(
            server.url + "/predict", OOM_REQUESTS, seconds=120, images=square_jpegs(256), max_requests=OOM_REQUESTS
        )
        splits = metric_samples(server).get("imgserve_oom_splits_total", 0.0) - before
    ok = splits > 0 and len(result.answered) == OOM_REQUESTS
    answered = f"imgserve_oom_splits_total +{splits:.0f}; {len(result.answered)}/{OOM_REQUESTS} answered 200"
    return [Row.of(OOM, answered, ok)]


def gpu_memory_used(server: RunningServer, image: SampleImage) -> float:
    """Device memory in use (NVML, the whole GPU: IPC views are not charged to each process) after a few answers."""
    for _ in range(6):
        predict(server, image)
    time.sleep(1)
    used = metric_samples(server).get("imgserve_gpu_memory_used_bytes")
    if used is None:
        raise RuntimeError("imgserve_gpu_memory_used_bytes is not on /metrics (is imgserve[gpu] installed?)")
    return used


def check_shared_weights(context: Context) -> list[Row]:
    """One copy of the weights per GPU: memory from 1 to 3 workers with a 256 MiB model vs a 1 MiB one, again after
    a worker is killed, with private copies as the negative control; the 3 workers' answers vs 1 worker's."""
    from safetensors.torch import save_file

    from loadtests.lib.toy_models import heavy_weights, light_weights

    files = {}
    for name, build in (("heavy", heavy_weights), ("light", light_weights)):
        files[name] = context.log_dir / f"{name}.safetensors"
        save_file(build().state_dict(), str(files[name]))
    image = square_jpegs(256)[0]
    used: dict[tuple[str, int], float] = {}
    answers: list[bytes] = []
    restarted = 0.0  # GPU memory after a worker's replacement, less just before its kill
    for name, share, factory in (
        ("heavy", "true", "heavy_weights"),
        ("light", "true", "light_weights"),
        ("private", "false", "heavy_weights"),
    ):
        for workers in (1, 3):
            settings = {"model": str(files["light" if name == "light" else "heavy"]), "share_weights": share}
            settings |= {"model_factory": f"loadtests.lib.toy_models:{factory}", "workers_per_device": str(workers)}
            with imgserve(context, f"shared-{name}-{workers}", **settings) as server:
                used[name, workers] = gpu_memory_used(server, image)
                if name == "heavy":
                    with ThreadPoolExecutor(6) as pool:
                        answers += pool.map(lambda _: predict(server, image), range(12 if workers == 3 else 1))
                if name == "heavy" and workers == 3:
                    before_kill = gpu_memory_used(server, image)  # the 12 answers' batches grew the caches
                    before = set(server.worker_pids())
                    os.kill(min(before), signal.SIGKILL)
                    server.replaced_worker(before)
                    restarted = gpu_memory_used(server, image) - before_kill
    contexts = used["light", 3] - used["light", 1]
    extra = {name: used[name, 3] - used[name, 1] - contexts for name in ("heavy", "private")}
    mib = 2**20
    worst = max(mean_abs_diff(answer, answers[0]) for answer in answers[1:])
    return [
        Row.of(
            SHARE,
            f"+{extra['heavy'] / mib:.0f} MiB (2 more CUDA contexts: {contexts / mib:.0f} MiB)",
            extra["heavy"] <= SHARED_BOUND,
        ),
        Row.of(SHARE_RESTART, f"+{restarted / mib:.0f} MiB", restarted <= SHARED_BOUND),
        Row.of(SHARE_CONTROL, f"+{extra['private'] / mib:.0f} MiB", extra["private"] > SHARED_BOUND),
        Row.of(SHARE_OUTPUTS, f"largest mean abs diff {worst:.3f}/255 over {len(answers) - 1} answers", worst <= 1),
    ]


def check_overhead(context: Context) -> list[Row]:
    """The overhead benchmark's targets: every cell on a GPU, only the targets' cells (short) on a CPU."""
    seconds = context.cell_seconds
    plan = (
        overhead.Plan(overhead.Plan.make(quick=True).cells, seconds, seconds / 3, seconds / 3)
        if context.cuda
        else overhead.Plan.targets_only(seconds)
    )
    run = overhead.run_overhead(plan, context.log_dir)
    context.reports["overhead.md"] = overhead.render(run, "python -m loadtests.gpu_check", machine())
    return [Row.of(overhead_row(v.target), v.result(), v.met) for v in run.verdicts()]


def check_device_decode(context: Context) -> list[Row]:
    """The worker's decode of a batch of DECODE_BATCH JPEGs (imgserve.worker.decoding) at 224, 512 and 1024 px: on
    the GPU (torchvision's batched nvJPEG call, the bytes copied in, synchronized) against Pillow on every core of
    this host at once (what the front ends would do), in images/s."""
    batched = gpu_jpeg_decoder()
    if batched is None:
        return [Row.skipped(name, "torchvision's GPU JPEG decoder is not installed") for name in DEVICE_DECODE]
    rows, device = [], torch.device(DECODE_DEVICE)
    for name, side in zip(DEVICE_DECODE, DECODE_SIDES, strict=True):
        uploads = [codec.read_header(image.data, side * side) for image in square_jpegs(side, DECODE_BATCH)]
        on_the_device = functools.partial(decode_items, uploads, device, batched)
        device_rate = _decode_rate(on_the_device, context.cell_seconds / 4, device)
        cores = os.cpu_count() or 1
        with ThreadPoolExecutor(cores) as pool:  # Pillow decodes without the GIL
            on_the_cores = functools.partial(_decode_on, pool, uploads)
            cpu_rate = _decode_rate(on_the_cores, context.cell_seconds / 4, None)
        ratio = device_rate / cpu_rate
        result = f"GPU {device_rate:.0f} images/s, Pillow on {cores} cores {cpu_rate:.0f}/s ({ratio:.2f}x)"
        rows.append(Row.of(name, result, device_rate > cpu_rate))
    return rows


def _decode_on(pool: ThreadPoolExecutor, uploads: list[codec.EncodedImage]) -> list[object]:
    """The uploads decoded by Pillow on the pool's threads, as the front ends decode them."""
    return list(pool.map(lambda upload: codec.open_image(upload.data, upload.width * upload.height).load(), uploads))


def _decode_rate(decode: Callable[[], object], seconds: float, device: torch.device | None) -> float:
    """Images/s of `decode` (one batch of DECODE_BATCH) run over and over for `seconds`, after one warm-up call."""
    decode()
    count, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        decode()
        if device is not None and device.type == "cuda":
            torch.cuda.synchronize(device)
        count += DECODE_BATCH
    return count / (time.perf_counter() - started)


def check_resnet(context: Context) -> list[Row]:
    """The ResNet-50 alone on the GPU, eager against compiled (is compile's default on cuda the faster one?); then
    served as `compile` defaults it, from 500x375 JPEGs over HTTP and gRPC at 1, 64 and 256 users, against the model
    alone, with the GPU's busy share."""
    model = resnet.export(context.log_dir / "resnet50.pt2")
    alone = gpu_resnet.model_alone(model, "cuda", context.cell_seconds, context.log_dir / "alone-cache")
    compiled = COMPILED_BY_DEFAULT["cuda"]
    faster = "compiled" if alone.compiled > alone.eager else "eager"
    result = (
        f"batch {gpu_resnet.ALONE_BATCH}: eager {alone.eager:.0f}/s, compiled {alone.compiled:.0f}/s "
        f"({alone.compiled / alone.eager:.2f}x; compile {alone.compile_s:.0f} s); default: "
        f"{'compiled' if compiled else 'eager'}"
    )
    rows = [Row.of(RESNET_COMPILED, result, (faster == "compiled") == compiled)]
    grpc_port = free_port()
    with imgserve(context, "resnet50", **gpu_resnet.SERVED, model=str(model), grpc_port=str(grpc_port)) as server:
        served = gpu_resnet.serve_cells(server, f"127.0.0.1:{grpc_port}", model.stem, context.cell_seconds)
    context.reports["resnet50.md"] = gpu_resnet.render(alone, compiled, served)
    for name, protocol in ((RESNET_HTTP, "HTTP"), (RESNET_GRPC, "gRPC")):
        text, ok = gpu_resnet.summary(served, protocol, alone.limit(compiled))
        rows.append(Row(name, text, GOALS[name], INFO if ok else FAIL))
    return rows


@dataclass(frozen=True)
class Check:
    """A check, the rows it yields (named up front, so a skipped or failed check still shows them), GPU only?"""

    run: Callable[[Context], list[Row]]
    rows: tuple[str, ...]
    gpu_only: bool


CHECKS = (
    Check(check_default_server, (CUDA, NVML, AUTO_WORKERS, SEED), gpu_only=False),
    Check(lambda context: check_precision(context, FP16), (FP16,), gpu_only=True),
    Check(lambda context: check_precision(context, BF16), (BF16,), gpu_only=True),
    Check(check_auto_batch_and_flood, (AUTO, FLOOD), gpu_only=True),
    Check(check_oom_split, (OOM,), gpu_only=True),
    Check(check_shared_weights, (SHARE, SHARE_RESTART, SHARE_CONTROL, SHARE_OUTPUTS), gpu_only=True),
    Check(check_overhead, tuple(overhead_row(t) for t in overhead.TARGETS), gpu_only=False),
    Check(check_device_decode, DEVICE_DECODE, gpu_only=True),
    Check(check_resnet, (RESNET_COMPILED, RESNET_HTTP, RESNET_GRPC), gpu_only=True),
)


def run_checks(context: Context, after_each: Callable[[list[Row]], None] = lambda rows: None) -> list[Row]:
    """Every check in order; GPU-only ones are skipped without CUDA, and a check that raises becomes an error row.
    `after_each` sees the rows so far after every check (a run cut short by a lease still leaves its table)."""
    rows: list[Row] = []
    for check in CHECKS:
        if check.gpu_only and not context.cuda:
            rows += [Row.skipped(name) for name in check.rows]
            continue
        print(f"gpu_check: {', '.join(check.rows)}...", file=sys.stderr, flush=True)
        try:
            rows += check.run(context)
        except Exception as exc:  # one broken check must not hide the others (its message: the end, which says why)
            message = f"{type(exc).__name__}: {str(exc)[-300:]}".replace("|", "/").replace("\n", " ")
            rows += [Row(name, message, GOALS[name], ERROR) for name in check.rows]
        after_each(rows)
    return rows


def render(rows: list[Row], host: str, elapsed_s: float) -> str:
    """The one table, with the machine and the run's length above it."""
    lines = [
        f"Machine: {host}; {elapsed_s:.0f} s",
        "",
        "| check | result | goal | pass/fail |",
        "|---|---|---|---|",
        *(f"| {row.check} | {row.result} | {row.goal} | {row.status} |" for row in rows),
    ]
    return "\n".join(lines) + "\n"


def exit_status(rows: list[Row]) -> int:
    statuses = {row.status for row in rows}
    return 2 if ERROR in statuses else 1 if FAIL in statuses else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtests.gpu_check", description=__doc__.splitlines()[0])
    parser.add_argument("--cell-seconds", type=float, default=3.0, help="measured seconds per load cell")
    parser.add_argument(
        "--out-dir", type=Path, default=Path("loadtests/results/gpu_check"), help="folder for the markdown tables"
    )
    args = parser.parse_args(argv)
    started = time.monotonic()
    args.out_dir.mkdir(parents=True, exist_ok=True)

    def write(rows: list[Row]) -> str:
        table = render(rows, machine(), time.monotonic() - started)
        for name, report in {"checks.md": table, **context.reports}.items():
            (args.out_dir / name).write_text(report)
        return table

    with tempfile.TemporaryDirectory(prefix="imgserve-gpu-check-") as logs:
        context = Context(torch.cuda.is_available(), Path(logs), args.cell_seconds)
        rows = run_checks(context, write)
    print(write(rows))
    return exit_status(rows)


if __name__ == "__main__":
    sys.exit(main())
