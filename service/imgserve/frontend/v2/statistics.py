"""Triton's statistics extension: per model, counts and cumulative nanoseconds of what imgserve already measures.

Nothing is counted twice: the figures are read, when asked, from the Prometheus samples every process writes
(prometheus_client's multiprocess files, merged as /metrics merges them), so they agree with /metrics and cover
every front end and worker, dead or alive. A model's samples are those with its `model` label, or with none (one
model per server). Where imgserve measures differently from Triton, the figure says what imgserve measured:

- success / fail: the model's inference calls (any protocol, the routes of telemetry.INFER_ROUTES and gRPC ModelInfer)
  answered 200 / otherwise, and the time to answer them (imgserve_requests_total, imgserve_request_seconds_total);
- queue: each image's wait from admission to the start of its model batch (imgserve_queue_wait_seconds);
- compute input / infer / output: `decode_request`, the model's batches, `encode_response` (imgserve_decode_,
  imgserve_inference_, imgserve_encode_duration_seconds). Triton counts the three together, once per inference, and
  perf_analyzer refuses counts that differ: each has the count of images the model ran (imgserve_batch_size_sum).
  A batch's time is counted once, so under batching "compute infer" is the model's time per image;
- inference_count, execution_count: the images the model ran and its batches (imgserve_batch_size).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from imgserve import metrics
from imgserve.frontend import telemetry

STAGES = ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output", "cache_hit", "cache_miss")
NS = 1e9
Labels = Mapping[str, str]


class Samples:
    """The merged counter and histogram samples of every process, by sample name."""

    def __init__(self, directory: str | None = None) -> None:
        self.found: dict[str, list[tuple[Labels, float]]] = {}
        for metric in metrics.merged(("counter", "histogram"), directory):
            for sample in metric.samples:
                self.found.setdefault(sample.name, []).append((sample.labels, sample.value))

    def total(self, name: str, model: str, where: Callable[[Labels], bool] = lambda labels: True) -> float:
        """The sum of the samples called `name` of `model` whose labels pass `where`."""
        return sum(
            value for labels, value in self.found.get(name, ()) if labels.get("model", model) == model and where(labels)
        )


def model_statistics(model: str, version: str, samples: Samples) -> dict[str, Any]:
    """One model's entry of the extension's `model_stats`, in its JSON form (integers, nanoseconds)."""
    routes = inference_routes()

    def answered(ok: bool) -> Callable[[Labels], bool]:
        return lambda labels: labels.get("route") in routes and (labels.get("code") == "200") == ok

    def stage(count: float, seconds: float) -> dict[str, int]:
        return {"count": round(count), "ns": round(seconds * NS)}

    images = samples.total("imgserve_batch_size_sum", model)
    measured = {
        outcome: stage(
            samples.total("imgserve_requests_total", model, answered(ok)),
            samples.total("imgserve_request_seconds_total", model, answered(ok)),
        )
        for outcome, ok in (("success", True), ("fail", False))
    }
    measured["queue"] = stage(
        samples.total("imgserve_queue_wait_seconds_count", model),
        samples.total("imgserve_queue_wait_seconds_sum", model),
    )
    for name, histogram in (("input", "decode"), ("infer", "inference"), ("output", "encode")):
        measured[f"compute_{name}"] = stage(images, samples.total(f"imgserve_{histogram}_duration_seconds_sum", model))
    return {
        "name": model,
        "version": version,
        "last_inference": 0,  # not measured
        "inference_count": round(images),
        "execution_count": round(samples.total("imgserve_batch_size_count", model)),
        "inference_stats": {name: measured.get(name, stage(0, 0)) for name in STAGES},
        "batch_stats": [],  # imgserve_batch_size's buckets do not keep each size apart
    }


def inference_routes() -> set[str]:
    """The `route` labels of inference calls: every protocol's (a plain LitAPI's route included)."""
    return {*telemetry.INFER_ROUTES, telemetry.GRPC_INFER}
