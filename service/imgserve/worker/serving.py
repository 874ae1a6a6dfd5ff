"""The served models in an inference worker: each set up and measured when it is loaded, then each gathered batch of
request messages (all of one model) answered.

`set_up` loads a model's API (a fresh copy of the catalog's) on the worker's device and measures, on the API's example
request, the memory a batch needs per element; the main process fits every model into the device's memory from what the
workers measured and gives each its batch limits (pod.fit_models). `answer` takes a batch of one model's request
messages: items past their deadline are answered 504 and never computed; the others are read from their slots (views, no
copy), run (worker/batching.py), and each output is written back into its request's slot, or travels in the answer when
small. Every failure is that item's answer; the worker survives them all. A model is set up beside the batches of the
others (on a thread of its own); only its measurement holds the batches back, for one example batch.
"""

from __future__ import annotations

import copy
import gc
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from imgserve import heap, metrics
from imgserve.api import ImageAPI
from imgserve.errors import ApiError, fault, from_exception
from imgserve.handoff import items
from imgserve.handoff.model_state import FAILED, HELD, NOT_HELD
from imgserve.handoff.slots import SlotFiles
from imgserve.handoff.state import SharedState
from imgserve.handoff.wire import RequestMessage
from imgserve.models.loader import ModelLoadError, load_model
from imgserve.models.shared import SharedWeights
from imgserve.pod import Measured, TorchThreads
from imgserve.served import Catalog
from imgserve.worker.batching import UNBOUNDED, BatchRunner
from imgserve.worker.tracing import Ran

log = logging.getLogger(__name__)
INLINE_BYTES = 64 * 1024  # outputs up to this size (class scores) travel in the answer message, larger in the slot


@dataclass(frozen=True)
class WorkerPlan:
    """What the composition root decided for every worker: where the slots are, its torch threads, and whether
    model files may run code (a pickle, an AOTInductor package's native code)."""

    slot_directory: Path
    torch_threads: TorchThreads
    trust_pickle: bool
    trust_native_code: bool


class Worker:
    """One inference worker's models on its device, and how it answers a batch."""

    def __init__(self, catalog: Catalog, state: SharedState, plan: WorkerPlan, index: int, device: str) -> None:
        self.catalog, self.state, self.plan, self.index, self.device = catalog, state, plan, index, device
        self.runners: dict[int, BatchRunner] = {}  # the models set up here, by index
        self.slots = SlotFiles(plan.slot_directory)
        self.batches = threading.Lock()  # one batch at a time: a model's measurement holds the others back
        self.ran: Ran | None = None  # what the last batch's answer noted, for its spans (worker/tracing.py)
        torch.set_num_threads(plan.torch_threads.alone)  # pod.py decided the counts
        self.heap = heap.BatchHeap(release=self._release_apis)

    # Models in and out.
    def set_up(self, model: int, weights: SharedWeights) -> None:
        """Set up model `model` on this worker's device around its shared `weights`, warm it up and measure it; then
        say it is held. A failure is the model's ModelLoadError (also said in the shared state)."""
        served, device = self.catalog[model], self.device
        api = copy.copy(served.api)  # set up fresh at each load; let go with its runner when unloaded
        try:
            api.model_loader = shared_model_loader(api, weights, self.plan.trust_pickle, self.plan.trust_native_code)
            _reported(f"the API's setup failed on {device}", api.setup, device)
            api.device = device  # as LitServe sets it after setup
            runner = BatchRunner(api, torch.device(device), on_oom=metrics.OOM_SPLITS.labels(served.name).inc)
            with self.batches:
                measured = _reported("the API failed on its example request", _measure, runner)
        except ModelLoadError as exc:
            reason = f"model {served.name}: {exc}" if len(self.catalog) > 1 else str(exc)  # which, among several
            reason = " ".join(reason.split())  # one line, whatever the exception's message held
            self.state.models.note_failure(model, reason)
            self.state.models.hold(self.index, model, FAILED)
            raise ModelLoadError(reason) from exc
        if measured is not None:
            self.state.models.measure(model, measured)
        self.runners[model] = runner
        self.state.models.hold(self.index, model, HELD)
        route = "shared" if weights.shared else "private"
        log.info("%s set up on %s (weights %s): %s", served.name, device, route, _described(measured))

    def drop(self, model: int) -> None:
        """Let model `model` go: its API and buffers, and the memory they held."""
        with self.batches:
            runner = self.runners.pop(model, None)
        if runner is not None:
            runner.api.release_memory()
            del runner
            gc.collect()  # the model's module and tensors, whatever cycles hold them
            heap.trim()
            if self.device.startswith("cuda"):
                torch.cuda.empty_cache()
        self.state.models.hold(self.index, model, NOT_HELD)

    def _release_apis(self) -> None:
        for runner in list(self.runners.values()):
            runner.api.release_memory()

    def release_memory(self) -> None:
        """Idle: the buffers kept for reuse and the heap's free memory go back to the system."""
        self.heap.give_back()

    def batch_size(self, model: int) -> int:
        """The most requests of `model` one batch takes: what the main process gave it, else its own batch size."""
        limits = self.state.models.limits(model)
        if limits is not None:
            return limits.batch_size
        configured = self.catalog[model].batching.max_batch_size
        return configured if isinstance(configured, int) else 1

    def batch_timeout_s(self, model: int) -> float:
        """How long a batch of `model` may wait to fill, from its oldest request's hand-off."""
        return self.catalog[model].batching.batch_timeout_ms / 1000

    # Batches.
    def answer(self, requests: list[RequestMessage]) -> list[Any]:
        """One answer per request message (all of one model): what is past its deadline is never computed (504); the
        rest are read from their slots, run, and answered with their outputs (or each its own error)."""
        self.ran, now, model = None, time.monotonic(), requests[0].model
        runner, name = self.runners.get(model), self.catalog[model].name
        if runner is None:  # unloaded since it was admitted
            error = ApiError(503, "model_unavailable", f"model {name!r} is not loaded", 1)
            return [error] * len(requests)
        answers: list[Any] = [ApiError(504, "deadline", "the deadline passed in the queue")] * len(requests)
        live = [i for i, request in enumerate(requests) if request.deadline > now]  # front ends count the rest
        values: dict[int, Any] = {}
        for i in live:
            metrics.QUEUE_WAIT.labels(name).observe(now - requests[i].queued)
            values[i], answers[i] = _guarded(self._read, requests[i], where="reading the request")
        ready = [i for i in live if answers[i] is None]
        self.ran = Ran(name, now, ready, now, now)
        if ready:
            started = time.monotonic()
            outputs = self._run(runner, model, [values[i] for i in ready])
            self.ran = Ran(name, now, ready, started, time.monotonic())
            for i, output in zip(ready, outputs, strict=True):
                placed = output if isinstance(output, ApiError) else self._placed(requests[i], output, values[i])
                answers[i] = placed
        return answers

    def _run(self, runner: BatchRunner, model: int, values: list[Any]) -> list[Any]:
        """One batch through the runner, within the element budget the main process gave the model."""
        name, limits = self.catalog[model].name, self.state.models.limits(model)
        runner.element_budget = limits.element_budget if limits and limits.element_budget else UNBOUNDED
        metrics.BATCH_SIZE.labels(name).observe(len(values))
        metrics.INFLIGHT.labels(name).set(len(values))
        self._set_threads(len(values))
        started = time.monotonic()
        try:
            with self.batches:
                outputs = runner(values)
        finally:
            metrics.INFERENCE_DURATION.labels(name).observe(time.monotonic() - started)
            metrics.INFLIGHT.labels(name).set(0)
        self.heap.after_batch(runner.last_need_bytes)
        return outputs

    def _read(self, request: RequestMessage) -> Any:
        """The request's item, its arrays and large bytes as they lie in its slot."""
        return items.resolve(
            request.item, lambda offset, shape, dtype: self.slots.view(request.slot, shape, dtype, offset)
        )

    def _placed(self, request: RequestMessage, output: Any, value: Any) -> Any:
        """The output placed: large arrays and bytes into the request's slot (after copying any that still lie in
        the slot, where they would be overwritten), unless its front end gave the slot to another request."""

        def write(array: np.ndarray, offset: int) -> None:
            if not self.state.owns(request.slot, request.ticket):
                raise ApiError(504, "deadline", "the request was given up on")
            self.slots.write(request.slot, array, offset)

        own = items.detached(output, items.arrays_of(value))
        placed, error = _guarded(items.place, own, write, INLINE_BYTES, INLINE_BYTES, where="predict")
        return placed if error is None else error

    def _set_threads(self, batch_size: int) -> None:
        """All of this worker's torch threads for a batch that is all the pod has admitted, its share of the cores
        otherwise (pod.py's rule); the switch sets OpenMP's count for the next parallel region, well under 1 us."""
        alone = self.state.queue_depth <= batch_size
        torch.set_num_threads(self.plan.torch_threads.alone if alone else self.plan.torch_threads.busy)


def _measure(runner: BatchRunner) -> Measured | None:
    """The model's memory per element on its example request; None when it has no example request to measure."""
    request = runner.api.example_request()
    return None if request is None else runner.measure(runner.api.decode_request(request))


def _described(measured: Measured | None) -> str:
    if measured is None:
        return "no example request: its batches are bounded by their size alone"
    return f"{measured.bytes_per_element:.1f} bytes per element at the peak, {measured.example_elements} per item"


def _guarded(step: Callable[..., Any], *args: Any, where: str) -> tuple[Any, ApiError | None]:
    """(step(*args), None), or (None, the ApiError its exception answers with); an unexpected exception is logged
    with its traceback, once."""
    try:
        return step(*args), None
    except Exception as exc:
        error = from_exception(exc)
        if error is None:
            log.exception("%s failed", where)
            error = fault(exc, where)
        return None, error


def _reported(failure: str, step: Callable[..., Any], *args: Any) -> Any:
    """step(*args); its failure raised as the ModelLoadError whose one line `imgserve serve` ends with."""
    try:
        return step(*args)
    except ModelLoadError:
        raise
    except Exception as exc:
        raise ModelLoadError(" ".join(f"{failure}: {type(exc).__name__}: {exc}".split())) from exc


def shared_model_loader(
    api: ImageAPI, weights: SharedWeights, trust_pickle: bool, trust_native_code: bool
) -> Callable[[str], torch.nn.Module]:
    """What `ImageAPI.load_model` calls in a worker: the API's model file, built around the device's shared weights
    (a private copy when they are not shared), loaded as far as the trust flags allow."""

    def load(device: str) -> torch.nn.Module:
        if api.model is None:
            raise ModelLoadError(f"{type(api).__name__}.load_model() needs the class attribute `model` (a file path)")
        shared = weights.tensors(device) if weights.shared else None
        model = load_model(api.model, api.model_factory, trust_pickle, shared, trust_native_code=trust_native_code)
        return model.to(device)

    return load
