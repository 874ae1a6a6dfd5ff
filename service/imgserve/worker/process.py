"""An inference worker process: spawned by the main process, it sets up the API on its device, then takes batches
off the request socket and sends each answer to its front end, until the main process stops it (or dies: the
worker dies with it).

Ctrl-C reaches every process of the server; a worker leaves it to the main process, which drains, then stops the
workers. A setup that fails is the one-line reason the server ends with (in the shared state); a batch that fails
outside the API's hooks answers each of its requests 500, and the worker goes on.
"""

from __future__ import annotations

import logging
import signal
import sys
import time
from dataclasses import dataclass

from imgserve.api import ImageAPI
from imgserve.config import Logging
from imgserve.errors import ApiError
from imgserve.handoff.answers import AnswerSockets
from imgserve.handoff.requests import RequestSocket
from imgserve.handoff.state import SharedState
from imgserve.lifetime import die_with_parent
from imgserve.models.loader import ModelLoadError
from imgserve.worker import tracing
from imgserve.worker.gather import Gatherer
from imgserve.worker.serving import Worker, WorkerPlan

log = logging.getLogger(__name__)
TRIM_AFTER_IDLE_S = 2.0  # a worker idle this long gives the memory of its last batches back


@dataclass(frozen=True)
class WorkerSpec:
    """What every worker process is started with (the API is pickled into the spawned process, as LitServe does);
    `model` is the API's name on the Open Inference Protocol, on the worker's spans."""

    api: ImageAPI
    plan: WorkerPlan
    state: SharedState
    requests: RequestSocket
    answers: AnswerSockets
    logging: Logging
    parent_pid: int
    model: str = ""


def run(spec: WorkerSpec, index: int, device: str) -> None:
    """The process's whole life: worker `index` on `device`."""
    die_with_parent(spec.parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    spec.logging.configure_logging()
    tracing.start(spec.model)
    worker = Worker(spec.api, spec.state, spec.plan, device)
    try:
        worker.setup()
    except ModelLoadError as exc:
        log.debug("worker %d failed to set up", index, exc_info=True)
        spec.state.fail_setup(index, str(exc))
        sys.exit(1)
    spec.state.worker_ready(index)
    serve(worker, Gatherer(spec.requests, spec.state, index), spec.answers, spec.plan.batch_timeout_s)


def serve(worker: Worker, gatherer: Gatherer, answers: AnswerSockets, batch_timeout_s: float) -> None:
    """Take a batch, answer it, send each answer to its front end; give memory back once idle."""
    busy_at: float | None = None
    while True:
        batch = gatherer.batch(worker.max_batch_size, batch_timeout_s)
        if not batch:
            if busy_at is not None and time.monotonic() - busy_at > TRIM_AFTER_IDLE_S:
                worker.release_memory()
                busy_at = None
            continue
        busy_at = time.monotonic()
        try:
            outputs = worker.answer(batch)
        except Exception:
            log.exception("the worker failed on a batch of %d", len(batch))
            outputs = [ApiError(500, "internal_error", "the inference worker failed on this batch")] * len(batch)
            worker.ran = None
        for request, output in zip(batch, outputs, strict=True):
            answers.send(request.front_end, request.uid, output)
        tracing.record(batch, outputs, worker.ran)  # after the answers: no request waits for its spans
