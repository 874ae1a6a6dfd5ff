"""An inference worker process: started by the main process from its fork server, it sets up the models loaded at
its start, then takes batches off the request socket and sends each answer to its front end, until the main process
stops it (or dies: the worker dies with it).

While serving, the main process loads and unloads models through the worker's control pipe (`Control`: a msgpack
message per command, never a pickle): a model is set up on a thread of its own beside the other models' batches,
and let go between two batches. Ctrl-C reaches every process of the server; a worker leaves it to the main
process, which drains, then stops the workers. A model that fails to set up at the start is the one-line reason the
server ends with (in the shared state); a batch that fails outside the API's hooks answers each of its requests 500,
and the worker goes on.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import msgpack

from imgserve import heap
from imgserve.config import Logging
from imgserve.errors import ApiError
from imgserve.handoff.answers import AnswerSockets
from imgserve.handoff.model_state import FAILED
from imgserve.handoff.requests import ModelRequests
from imgserve.handoff.state import SharedState
from imgserve.lifetime import die_with_parent
from imgserve.models.loader import ModelLoadError
from imgserve.models.shared import SharedWeights
from imgserve.served import Catalog
from imgserve.worker import tracing
from imgserve.worker.gather import Gatherer
from imgserve.worker.serving import Worker, WorkerPlan

log = logging.getLogger(__name__)
TRIM_AFTER_IDLE_S = 2.0  # a worker idle this long gives the memory of its last batches back


@dataclass(frozen=True)
class WorkerSpec:
    """What every worker process is started with (the catalog's APIs are pickled into the worker, as LitServe
    does): the models to set up at its start, with their shared weights."""

    catalog: Catalog
    plan: WorkerPlan
    state: SharedState
    requests: ModelRequests
    answers: AnswerSockets
    logging: Logging
    parent_pid: int
    weights: dict[int, SharedWeights]


def run(spec: WorkerSpec, index: int, device: str, control: Connection) -> None:
    """The process's whole life: worker `index` on `device`, commanded through `control`."""
    die_with_parent(spec.parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    spec.logging.configure_logging()
    tracing.start()
    if device == "cpu":  # its own memory before any model: what each worker costs beside the models (RAM)
        spec.state.report_overhead(index, heap.anonymous_bytes())
    worker = Worker(spec.catalog, spec.state, spec.plan, index, device)
    try:
        for model, weights in spec.weights.items():
            worker.set_up(model, weights)
    except ModelLoadError as exc:
        log.debug("worker %d failed to set up", index, exc_info=True)
        spec.state.fail_setup(index, str(exc))
        sys.exit(1)
    heap.hold_freed_memory()  # after loading: what a private load freed went back to the system
    spec.state.worker_ready(index)
    log.info(
        "worker ready on %s (%d torch threads, %d while other requests are in flight): %d model(s)",
        device,
        *spec.plan.torch_threads,
        len(worker.runners),
    )
    gatherer = Gatherer(spec.requests, spec.state, index)
    serve(worker, gatherer, spec.answers, Control(worker, control))


def serve(worker: Worker, gatherer: Gatherer, answers: AnswerSockets, control: Control) -> None:
    """Follow the main process's commands, take a batch, answer it, send each answer to its front end; give memory
    back once idle."""
    busy_at: float | None = None
    while True:
        control.follow()
        batch = gatherer.batch(worker.batch_size, worker.batch_timeout_s)
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


class Control:
    """The main process's commands to this worker: {"load": model, "weights": ...} sets a model up on a thread of
    its own; {"unload": model} lets it go. What became of each, the worker says in the shared state."""

    def __init__(self, worker: Worker, pipe: Connection | None) -> None:
        self.worker, self.pipe = worker, pipe

    def follow(self) -> None:
        """Carry out the commands that have come (none waited for)."""
        while self.pipe is not None and self.pipe.poll():
            try:
                command = msgpack.unpackb(self.pipe.recv_bytes(), raw=False)
            except (EOFError, OSError):  # the main process is gone: the worker dies with it (lifetime.py)
                self.pipe = None
                return
            self._carry_out(command)

    def _carry_out(self, command: dict[str, Any]) -> None:
        if "unload" in command:
            self.worker.drop(int(command["unload"]))
        elif "load" in command:
            model, weights = int(command["load"]), SharedWeights.from_message(command["weights"])
            threading.Thread(target=self._load, args=(model, weights), name=f"imgserve-load-{model}").start()

    def _load(self, model: int, weights: SharedWeights) -> None:
        try:
            self.worker.set_up(model, weights)
        except ModelLoadError as exc:
            log.error("%s", exc)
        except Exception:  # a fault of imgserve's own: the model fails to load, the worker serves on
            log.exception("setting up model %d failed", model)
            self.worker.state.models.hold(self.worker.index, model, FAILED)
