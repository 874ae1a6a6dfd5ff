"""The ResNet-50 parts of the GPU check (loadtests/gpu_check.py): the model alone on the device, eager against
compiled, and the model served from 500x375 JPEGs over HTTP and gRPC at 1, 64 and 256 users, each cell with the
GPU's busy share (NVML, through imgserve_gpu_utilization_ratio) and against the model alone."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from imgserve.testing import RunningServer
from loadtests.lib import resnet
from loadtests.lib.closed_loop import LoadResult, run_closed_loop
from loadtests.lib.grpc_loop import run_grpc_closed_loop
from loadtests.lib.images import check_scores
from loadtests.lib.servers import Periodic

USERS = (1, 64, 256)
ALONE_BATCH = 64  # a GPU's batch: the served model's max_batch_size too
BUSY_METRIC = "imgserve_gpu_utilization_ratio"
# The served model: the benchmark's ResNet-50 with ImageNet preprocessing, batches of up to ALONE_BATCH, and a queue
# that admits all 256 users (the check measures throughput, not shedding).
SERVED = {"preprocess": "imagenet", "max_batch_size": str(ALONE_BATCH), "max_queue_depth": str(4 * max(USERS))}


@dataclass(frozen=True)
class Alone:
    """The model alone on the device at ALONE_BATCH: images/s eager and compiled, and the compile's seconds."""

    eager: float
    compiled: float
    compile_s: float

    def limit(self, compiled: bool) -> float:
        return self.compiled if compiled else self.eager


def model_alone(model: Path, device: str, seconds: float, cache: Path) -> Alone:
    """The exported program on pre-decoded tensors on `device`, eager then compiled (its code cached in `cache`)."""
    eager, _ = resnet.ModelAlone(model, False, cache, device).images_per_s(ALONE_BATCH, seconds)
    compiled, compile_s = resnet.ModelAlone(model, True, cache, device).images_per_s(ALONE_BATCH, seconds)
    return Alone(eager, compiled, compile_s)


class BusyWatch(Periodic):
    """The mean of the server's imgserve_gpu_utilization_ratio over the block, sampled every half second."""

    def __init__(self, server: RunningServer) -> None:
        self.server, self.samples = server, list[float]()
        super().__init__(self._sample, 0.5)

    def _sample(self) -> None:
        try:
            text = httpx.get(self.server.url + "/metrics", timeout=5).text
        except httpx.HTTPError:
            return
        values = [s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == BUSY_METRIC]
        if values:
            self.samples.append(statistics.mean(values))

    @property
    def busy(self) -> float | None:
        return statistics.mean(self.samples) if self.samples else None


@dataclass
class Served:
    """Each (protocol, users) cell: its load result and the GPU's busy share meanwhile."""

    results: dict[tuple[str, int], LoadResult] = field(default_factory=dict)
    busy: dict[tuple[str, int], float | None] = field(default_factory=dict)


def serve_cells(server: RunningServer, grpc_address: str, model_name: str, seconds: float) -> Served:
    """Every cell on a running server: the photos over HTTP (/predict) and over gRPC (ModelInfer)."""
    photos, served = resnet.photos(), Served()
    for users in USERS:
        for protocol in ("HTTP", "gRPC"):
            with BusyWatch(server) as watch:
                if protocol == "HTTP":
                    result = run_closed_loop(
                        server.url + "/predict", users, seconds, seconds / 2, images=photos, check=check_scores
                    )
                else:
                    result = run_grpc_closed_loop(grpc_address, model_name, users, seconds, seconds / 2, photos)
            served.results[protocol, users], served.busy[protocol, users] = result, watch.busy
    return served


def summary(served: Served, protocol: str, limit: float) -> tuple[str, bool]:
    """One row's result over the users (answers/s, its share of the limit, p50/p99, GPU busy) and whether every
    request was answered or shed (none failed)."""
    parts = []
    for users in USERS:
        result, busy = served.results[protocol, users], served.busy[protocol, users]
        p50, p99 = result.latency_ms(0.5) or 0, result.latency_ms(0.99) or 0
        parts.append(
            f"c={users} {result.rps:.0f}/s ({result.rps / limit:.2f}x) p50 {p50:.0f} p99 {p99:.0f} ms "
            f"GPU {'-' if busy is None else f'{busy:.0%}'}"
        )
    failed = sum(served.results[protocol, users].failed for users in USERS)
    return "; ".join(parts) + f"; {failed} failed", failed == 0


def render(alone: Alone, compiled: bool, served: Served) -> str:
    """The report's tables: the model alone, then each served cell against the limit."""
    limit = alone.limit(compiled)
    lines = [
        f"ResNet-50 alone at batch {ALONE_BATCH}: eager {alone.eager:.0f} images/s, compiled {alone.compiled:.0f} "
        f"(compile {alone.compile_s:.0f} s); served {'compiled' if compiled else 'eager'}, limit {limit:.0f}/s.",
        "",
        "| protocol | users | answers/s | of the limit | p50 ms | p99 ms | GPU busy | shed | failed |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for (protocol, users), result in served.results.items():
        busy = served.busy[protocol, users]
        p50, p99 = result.latency_ms(0.5) or 0, result.latency_ms(0.99) or 0
        lines.append(
            f"| {protocol} | {users} | {result.rps:.1f} | {result.rps / limit:.2f}x | {p50:.1f} | {p99:.1f} "
            f"| {'-' if busy is None else f'{busy:.0%}'} | {result.shed} | {result.failed} |"
        )
    return "\n".join(lines) + "\n"
