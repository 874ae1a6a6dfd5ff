"""What the front end measures and shows: route labels, the middleware that counts every HTTP answer, and the
/metrics body (every process's samples merged, plus the pod's live gauges read at scrape time: queue depth, model
and build info, weight and slot memory, GPU utilization and memory from NVML)."""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from imgserve.handoff.slots import bytes_in_use
from imgserve.handoff.state import SharedState
from imgserve.metrics import count, merged

DOCS_PATHS = ("/docs", "/openapi.json")
DOCS_ASSETS = "/docs/assets"  # Swagger UI's files: one label for them all
# Each model's own paths (/predict, /<name>/predict, an API's api_path) join these as the front end is built.
ROUTES = {*DOCS_PATHS, "/health", "/health/live", "/health/ready", "/info", "/metrics", "/"}
# The Open Inference Protocol's routes carry the model's name: each protocol is one label for its inferences, one
# for its statistics (guarded with /metrics) and one for the rest (health, metadata, config), whatever the model and
# version named in the path.
V2_INFER, V2_STATS, V2_REPOSITORY, V2_OTHER = "/v2/infer", "/v2/stats", "/v2/repository", "/v2"
V2_INFER_PATH = re.compile(r"/v2/models/[^/]+(/versions/[^/]+)?/infer")
V2_MODEL_PATH = re.compile(r"/v2/models/([^/]+)(/.*)?")
V2_STATS_PATH = re.compile(r"/v2/models(/[^/]+(/versions/[^/]+)?)?/stats")
GRPC_INFER, GRPC_OTHER = "grpc/ModelInfer", "grpc"
INFER_ROUTES = {V2_INFER}


def serve_predictions_at(path: str) -> None:
    """Count `path`, a model's own, as a prediction route: admitted, guarded and labelled as one. Called in the main
    process, before the front ends are forked."""
    ROUTES.add(path)
    INFER_ROUTES.add(path)


def v2_model_name(path: str) -> str | None:
    """The model an Open Inference Protocol path names (/v2/models/{name}/...), if it names one."""
    found = V2_MODEL_PATH.fullmatch(path)
    return None if found is None or found.group(1) == "stats" else found.group(1)


def route(path: str) -> str:
    """The `route` label of an HTTP request path (low cardinality: unknown paths are `other`)."""
    if path in ROUTES:
        return path
    if path.startswith(f"{DOCS_ASSETS}/"):
        return DOCS_ASSETS
    if path == "/v2" or path.startswith("/v2/"):
        if V2_INFER_PATH.fullmatch(path):
            return V2_INFER
        if path.startswith(f"{V2_REPOSITORY}/"):
            return V2_REPOSITORY
        return V2_STATS if V2_STATS_PATH.fullmatch(path) else V2_OTHER
    return "other"


@dataclass(frozen=True)
class ModelFacts:
    """What one model of the pod is, fixed at start: its name, what it serves (its file or API class), its
    precision."""

    name: str
    source: str
    precision: str


@dataclass(frozen=True)
class PodFacts:
    """What the pod serves, fixed at start: its models, its devices and the imgserve version."""

    models: list[ModelFacts]
    devices: list[str]
    version: str


class PodCollector:
    """What a scrape reads: every process's samples, merged, and the gauges read at scrape time (queue depth from
    shared memory, model/build info and weight memory of the models loaded, GPU utilization and memory from NVML)."""

    def __init__(self, state: SharedState, slot_directory: Path, facts: PodFacts) -> None:
        self.state, self.slot_directory, self.facts = state, slot_directory, facts

    def collect(self) -> Iterator[Metric]:
        yield from merged()
        facts, models = self.facts, self.state.models
        depth = GaugeMetricFamily("imgserve_queue_depth", "Requests admitted and not yet answered (this pod)")
        depth.add_metric([], self.state.queue_depth)
        info = GaugeMetricFamily(
            "imgserve_model_info", "A model loaded", labels=["model", "source", "precision", "device"]
        )
        weights = GaugeMetricFamily(
            "imgserve_model_weight_bytes",
            "Memory a model's weights hold on each device, all its workers",
            labels=["device", "model"],
        )
        for index, model in enumerate(facts.models):
            if models.ready(index):
                info.add_metric([model.name, model.source, model.precision, facts.devices[0]], 1)
                for device in facts.devices:
                    weights.add_metric([device, model.name], models.weight_bytes(index))
        build = GaugeMetricFamily("imgserve_build_info", "The imgserve version", labels=["version"])
        build.add_metric([facts.version], 1)
        shm = GaugeMetricFamily("imgserve_shared_memory_bytes", "Memory held by the request slots in /dev/shm")
        shm.add_metric([], bytes_in_use(self.slot_directory))
        yield from (depth, info, weights, build, shm)
        if facts.devices[0].startswith("cuda"):
            yield from _gpu_metrics()


def _gpu_metrics() -> Iterator[Metric]:
    """Per-GPU utilization and memory from NVML; nothing when NVML is not there (never made-up numbers)."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # no NVML library or driver: the metrics are absent
        return
    util = GaugeMetricFamily("imgserve_gpu_utilization_ratio", "GPU busy share (0-1)", labels=["device"])
    used = GaugeMetricFamily("imgserve_gpu_memory_used_bytes", "GPU memory in use", labels=["device"])
    total = GaugeMetricFamily("imgserve_gpu_memory_total_bytes", "GPU memory in all", labels=["device"])
    for index in range(pynvml.nvmlDeviceGetCount()):
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
        label = [f"cuda:{index}"]
        util.add_metric(label, pynvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100.0)
        used.add_metric(label, memory.used)
        total.add_metric(label, memory.total)
    yield from (util, used, total)


def exposition(pod: PodCollector) -> bytes:
    """The /metrics body: every process's samples merged, plus the pod's live gauges."""
    registry = CollectorRegistry()
    registry.register(pod)
    return generate_latest(registry)


class MetricsMiddleware:
    """Counts every HTTP answer by route, status code and model, and times it."""

    def __init__(self, app: ASGIApp, model_of: Callable[[str], str]) -> None:
        self.app, self.model_of = app, model_of

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        label = route(scope["path"])
        started = time.perf_counter()
        status = 500

        async def send_and_record(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_record)
        finally:
            count(label, status, time.perf_counter() - started, self.model_of(scope["path"]))
