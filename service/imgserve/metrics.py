"""Prometheus metrics of the contract, correct across processes (prometheus_client multiprocess mode).

`PROMETHEUS_MULTIPROC_DIR` must be set before this module is imported; the `imgserve serve` command does that.
Live numbers that belong to the pod rather than a process (queue depth, GPU, model info) are read at scrape time.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, multiprocess
from prometheus_client.core import GaugeMetricFamily, Metric
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from imgserve.handoff.slots import bytes_in_use
from imgserve.handoff.state import SharedState

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
REJECT_REASONS = (
    "queue_full",
    "draining",
    "deadline",
    "worker_lost",
    "too_many_uploads",
    "too_many_connections",
    "header_timeout",
    "headers_too_large",
    "too_many_headers",
    "body_timeout",
    "upload_too_slow",
)
PREDICT_PATHS = ("/predict", "/v1/images:predict")
ROUTES = {*PREDICT_PATHS, "/health", "/health/live", "/health/ready", "/info", "/metrics", "/"}
# The Open Inference Protocol's routes carry the model's name: each protocol is one label for its inferences and
# one for the rest (health, metadata, config), whatever the model and version named in the path.
V2_INFER, V2_OTHER = "/v2/infer", "/v2"
V2_INFER_PATH = re.compile(r"/v2/models/[^/]+(/versions/[^/]+)?/infer")
GRPC_INFER, GRPC_OTHER = "grpc/ModelInfer", "grpc"
INFER_ROUTES = {*PREDICT_PATHS, V2_INFER}


def route(path: str) -> str:
    """The `route` label of an HTTP request path (low cardinality: unknown paths are `other`)."""
    if path in ROUTES:
        return path
    if path == "/v2" or path.startswith("/v2/"):
        return V2_INFER if V2_INFER_PATH.fullmatch(path) else V2_OTHER
    return "other"


REQUESTS = Counter("imgserve_requests_total", "HTTP requests answered, by route and status code", ["route", "code"])
REQUEST_DURATION = Histogram(
    "imgserve_request_duration_seconds", "Time from request to answer", ["route"], buckets=LATENCY_BUCKETS
)
QUEUE_WAIT = Histogram(
    "imgserve_queue_wait_seconds",
    "Time from admission to the start of the model batch",
    buckets=LATENCY_BUCKETS,
)
BATCH_SIZE = Histogram("imgserve_batch_size", "Images per model batch", buckets=BATCH_BUCKETS)
INFERENCE_DURATION = Histogram(
    "imgserve_inference_duration_seconds", "Time of one batch on the model", buckets=LATENCY_BUCKETS
)
REJECTED = Counter("imgserve_rejected_total", "Requests shed or timed out instead of computed", ["reason"])
INFLIGHT = Gauge("imgserve_inflight_requests", "Images in a model batch right now", multiprocess_mode="livesum")
OOM_SPLITS = Counter("imgserve_oom_splits_total", "Batches split and retried after running out of memory")
SLOTS_IN_USE = Gauge(
    "imgserve_slots_in_use", "Shared-memory request slots held (answers pending)", multiprocess_mode="livesum"
)
WORKER_RESTARTS = Counter("imgserve_worker_restarts_total", "Inference workers restarted after dying")
FRONT_END_RESTARTS = Counter("imgserve_front_end_restarts_total", "HTTP front ends restarted after dying")
API_KEY_RELOAD_FAILURES = Counter(
    "imgserve_api_key_reload_failures_total", "Changes of the API key file that left no key (the keys in force stay)"
)


@dataclass(frozen=True)
class ModelFacts:
    """What the pod serves, fixed at start: the model, its precision, its devices, the bytes its weights hold on each
    device (once when the workers share them, once per worker when not) and the imgserve version."""

    model: str
    precision: str
    devices: list[str]
    weight_bytes_per_device: int
    version: str


class PodCollector:
    """Scrape-time gauges: queue depth from shared memory, model/build info and weight memory, GPU utilization and
    memory (NVML)."""

    def __init__(self, state: SharedState, slot_directory: Path, facts: ModelFacts) -> None:
        self.state, self.slot_directory, self.facts = state, slot_directory, facts

    def collect(self) -> Iterator[Metric]:
        facts = self.facts
        depth = GaugeMetricFamily("imgserve_queue_depth", "Requests admitted and not yet answered (this pod)")
        depth.add_metric([], self.state.queue_depth)
        info = GaugeMetricFamily("imgserve_model_info", "The model served", labels=["model", "precision", "device"])
        info.add_metric([facts.model, facts.precision, facts.devices[0]], 1)
        weights = GaugeMetricFamily(
            "imgserve_model_weight_bytes", "Memory the weights hold on each device, all its workers", labels=["device"]
        )
        for device in facts.devices:
            weights.add_metric([device], facts.weight_bytes_per_device)
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
    multiprocess.MultiProcessCollector(registry)
    registry.register(pod)
    return generate_latest(registry)


def preregister() -> None:
    """Create the labelled series at zero so rates exist before the first shed."""
    for reason in REJECT_REASONS:
        REJECTED.labels(reason)


class MetricsMiddleware:
    """Counts every HTTP answer by route and status code and times it."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

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
            count(label, status, time.perf_counter() - started)


def count(label: str, status: int, seconds: float) -> None:
    """One answer on `label`: imgserve_requests_total and imgserve_request_duration_seconds."""
    REQUESTS.labels(label, str(status)).inc()
    REQUEST_DURATION.labels(label).observe(seconds)
