"""The Prometheus metrics of the contract: the objects every process writes (prometheus_client multiprocess mode).

`PROMETHEUS_MULTIPROC_DIR` must be set before this module is imported; the `imgserve serve` command does that.
The front ends merge every process's samples on a scrape (`merged`) and add the pod's live gauges
(frontend/telemetry.py).
"""

from __future__ import annotations

import glob
import os
from collections.abc import Iterable
from contextvars import ContextVar

from prometheus_client import Counter, Gauge, Histogram, multiprocess
from prometheus_client.core import Metric

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
MODEL = "model"  # the model a series is of: one of the models loaded, or "" for what is no model's (health, ...)
REQUESTS = Counter(
    "imgserve_requests_total", "HTTP requests answered, by route and status code", ["route", "code", MODEL]
)
REQUEST_DURATION = Histogram(
    "imgserve_request_duration_seconds", "Time from request to answer", ["route", MODEL], buckets=LATENCY_BUCKETS
)
REQUEST_SECONDS = Counter(  # the same times as REQUEST_DURATION, kept apart by status (the statistics extension)
    "imgserve_request_seconds_total",
    "Time spent answering requests, by route and status code",
    ["route", "code", MODEL],
)
QUEUE_WAIT = Histogram(
    "imgserve_queue_wait_seconds",
    "Time from the hand-off to the workers (decoded, queued) to the start of the model batch",
    [MODEL],
    buckets=LATENCY_BUCKETS,
)
BATCH_SIZE = Histogram("imgserve_batch_size", "Images per model batch", [MODEL], buckets=BATCH_BUCKETS)
DECODE_DURATION = Histogram(
    "imgserve_decode_duration_seconds",
    "Time of one item's decode_request (front end)",
    [MODEL],
    buckets=LATENCY_BUCKETS,
)
ENCODE_DURATION = Histogram(
    "imgserve_encode_duration_seconds",
    "Time of one item's encode_response (front end)",
    [MODEL],
    buckets=LATENCY_BUCKETS,
)
INFERENCE_DURATION = Histogram(
    "imgserve_inference_duration_seconds", "Time of one batch on the model", [MODEL], buckets=LATENCY_BUCKETS
)
REJECTED = Counter("imgserve_rejected_total", "Requests shed or timed out instead of computed", ["reason", MODEL])
INFLIGHT = Gauge(
    "imgserve_inflight_requests", "Images in a model batch right now", [MODEL], multiprocess_mode="livesum"
)
OOM_SPLITS = Counter("imgserve_oom_splits_total", "Batches split and retried after running out of memory", [MODEL])
SLOTS_IN_USE = Gauge(
    "imgserve_slots_in_use", "Shared-memory request slots held (answers pending)", multiprocess_mode="livesum"
)
WORKER_RESTARTS = Counter("imgserve_worker_restarts_total", "Inference workers restarted after dying")
FRONT_END_RESTARTS = Counter("imgserve_front_end_restarts_total", "HTTP front ends restarted after dying")
API_KEY_RELOAD_FAILURES = Counter(
    "imgserve_api_key_reload_failures_total", "Changes of the API key file that left no key (the keys in force stay)"
)


def merged(kinds: Iterable[str] = ("*",), directory: str | None = None) -> list[Metric]:
    """Every process's samples of these kinds of metric file (counter, histogram, gauge), merged as prometheus_client
    merges them. An empty file holds no sample yet and is passed over: a process creates its file before it sizes
    it, so a scrape can find it empty, and a process killed in between leaves it so for good, which would fail
    every scrape after (prometheus/client_python#1199)."""
    path = directory or os.environ["PROMETHEUS_MULTIPROC_DIR"]
    files = [file for kind in kinds for file in glob.glob(os.path.join(path, f"{kind}_*.db")) if _has_header(file)]
    return multiprocess.MultiProcessCollector.merge(files)  # type: ignore[no-untyped-call,no-any-return]


def _has_header(file: str) -> bool:
    """Whether a metric file has been sized (a sized file never shrinks; a live gauge's may be removed, which the
    merge allows for)."""
    try:
        return os.path.getsize(file) > 0
    except FileNotFoundError:
        return False


def preregister(models: list[str]) -> None:
    """Create the labelled series at zero so rates exist before the first shed."""
    for reason in REJECT_REASONS:
        for model in ["", *models]:
            REJECTED.labels(reason, model)


def count(label: str, status: int, seconds: float, model: str = "") -> None:
    """One answer on `label` (of `model`): imgserve_requests_total, imgserve_request_duration_seconds and
    imgserve_request_seconds_total."""
    REQUESTS.labels(label, str(status), model).inc()
    REQUEST_DURATION.labels(label, model).observe(seconds)
    REQUEST_SECONDS.labels(label, str(status), model).inc(seconds)


# Whether the request the current task answers has had its deadline counted (None: not kept, count every time).
_DEADLINE_COUNTED: ContextVar[list[bool] | None] = ContextVar("imgserve_deadline_counted", default=None)


def one_deadline_per_request() -> None:
    """From here on, in this task and the tasks it starts, `count_deadline` counts once: a gRPC request ends at its
    deadline by the hand-off's own timer and by gRPC's cancellation alike, often both. Called first in each task that
    answers one request (each gRPC call, each request of a stream), whose context is its own."""
    _DEADLINE_COUNTED.set([])


def count_deadline(model: str) -> None:
    """A request given up at its deadline: imgserve_rejected_total{reason="deadline"}, once per request."""
    counted = _DEADLINE_COUNTED.get()
    if counted is not None:
        if counted:
            return
        counted.append(True)
    REJECTED.labels("deadline", model).inc()
