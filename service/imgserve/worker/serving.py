"""The served API in an inference worker: its setup and the memory a batch needs, then each gathered batch of request
messages answered.

`setup` loads the API on its device and measures, on the API's example request, the memory a batch needs (which
bounds every chunk and, with max_batch_size auto, the batch size). `answer` takes a batch of request messages: items
past their deadline are answered 504 and never computed; the others are read from their slots (views, no copy), run
(worker/batching.py), and each output is written back into its request's slot, or travels in the answer when small.
Every failure is that item's answer; the worker survives them all.
"""

from __future__ import annotations

import logging
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
from imgserve.handoff.slots import SlotFiles
from imgserve.handoff.state import SharedState
from imgserve.handoff.wire import RequestMessage
from imgserve.models.loader import ModelLoadError, load_model
from imgserve.models.shared import SharedWeights
from imgserve.pod import TorchThreads
from imgserve.worker.batching import BatchRunner, Shape
from imgserve.worker.tracing import Ran

log = logging.getLogger(__name__)
INLINE_BYTES = 64 * 1024  # outputs up to this size (class scores) travel in the answer message, larger in the slot


@dataclass(frozen=True)
class WorkerPlan:
    """What the composition root decided for every worker: where the slots and the weights are, its batch size
    (1 until auto measures it) and timeout, its torch threads, how many workers share its device, the memory kept
    for slots, the share of the device's free memory the batches may use, and whether model files may run code."""

    slot_directory: Path
    weights: SharedWeights
    batch_size: int
    batch_timeout_s: float
    auto_batch: bool
    torch_threads: TorchThreads
    workers_per_device: int
    reserved_bytes: int
    memory_fraction: float
    trust_pickle: bool


class Worker:
    """One inference worker's API on its device, and how it answers a batch."""

    def __init__(self, api: ImageAPI, state: SharedState, plan: WorkerPlan, device: str) -> None:
        self.api, self.state, self.plan, self.device = api, state, plan, device
        self.max_batch_size = plan.batch_size
        self.slots = SlotFiles(plan.slot_directory)
        self.ran: Ran | None = None  # what the last batch's answer noted, for its spans (worker/tracing.py)

    def setup(self) -> None:
        """Set up the API on its device, warm it up on its example request, measure its memory and fix the batch
        limits; a failure raises with the one-line reason `imgserve serve` ends with."""
        plan, api, device = self.plan, self.api, self.device
        torch.set_num_threads(plan.torch_threads.alone)  # pod.py decided the counts
        api.model_loader = shared_model_loader(api, plan.weights, plan.trust_pickle)
        _reported(f"the API's setup failed on {device}", api.setup, device)
        api.device = device  # as LitServe sets it after setup
        heap.hold_freed_memory()  # after loading: what a private load freed goes back to the system
        self.runner = BatchRunner(api, torch.device(device), on_oom=metrics.OOM_SPLITS.inc)
        self.heap = heap.BatchHeap(release=api.release_memory)
        example = _reported(f"the API failed on its example request on {device}", self._measure)
        log.info(
            "worker ready on %s (%d torch threads, %d while other requests are in flight): weights %s, max batch %d%s",
            device,
            *plan.torch_threads,
            "shared" if plan.weights.shared else "private",
            self.max_batch_size,
            "" if example else " (no example request: batch memory not measured)",
        )

    def _measure(self) -> bool:
        """The memory a batch needs, from the example request; with max_batch_size auto, the batch size it allows.
        False when the API has no example request to measure (its batches are bounded by their size alone)."""
        plan, request = self.plan, self.api.example_request()
        if request is None:
            self.state.set_limits(self.max_batch_size, 0, 0)
            return False
        example = self.api.decode_request(request)
        memory = self.runner.measure(example, plan.memory_fraction, plan.workers_per_device, plan.reserved_bytes)
        if plan.auto_batch:
            self.max_batch_size = memory.batch_size_for(Shape.of(example).elements)
        self.state.set_limits(self.max_batch_size, memory.element_budget, memory.budget_bytes)
        log.info(
            "%s: %.1f bytes per element at the peak, budget %d MiB = %d elements",
            self.device,
            memory.bytes_per_element,
            memory.budget_bytes >> 20,
            memory.element_budget,
        )
        return True

    def release_memory(self) -> None:
        """Idle: the buffers kept for reuse and the heap's free memory go back to the system."""
        self.heap.give_back()

    def answer(self, requests: list[RequestMessage]) -> list[Any]:
        """One answer per request message: what is past its deadline is never computed (504); the rest are read
        from their slots, run, and answered with their outputs (or each its own error)."""
        self.ran, now = None, time.monotonic()
        answers: list[Any] = [ApiError(504, "deadline", "the deadline passed in the queue")] * len(requests)
        live = [i for i, request in enumerate(requests) if request.deadline > now]  # front ends count the rest
        values: dict[int, Any] = {}
        for i in live:
            metrics.QUEUE_WAIT.observe(now - requests[i].queued)
            values[i], answers[i] = _guarded(self._read, requests[i], where="reading the request")
        ready = [i for i in live if answers[i] is None]
        self.ran = Ran(now, ready, now, now)
        if not ready:
            return answers
        metrics.BATCH_SIZE.observe(len(ready))
        metrics.INFLIGHT.set(len(ready))
        self._set_threads(len(ready))
        started = time.monotonic()
        try:
            outputs = self.runner([values[i] for i in ready])
        finally:
            ended = time.monotonic()
            metrics.INFERENCE_DURATION.observe(ended - started)
            metrics.INFLIGHT.set(0)
        self.ran = Ran(now, ready, started, ended)
        self.heap.after_batch(self.runner.last_need_bytes)
        for i, output in zip(ready, outputs, strict=True):
            answers[i] = output if isinstance(output, ApiError) else self._placed(requests[i], output, values[i])
        return answers

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


def shared_model_loader(api: ImageAPI, weights: SharedWeights, trust_pickle: bool) -> Callable[[str], torch.nn.Module]:
    """What `ImageAPI.load_model` calls in a worker: the API's model file, built around the device's shared weights
    (a private copy when they are not shared)."""

    def load(device: str) -> torch.nn.Module:
        if api.model is None:
            raise ModelLoadError(f"{type(api).__name__}.load_model() needs the class attribute `model` (a file path)")
        shared = weights.tensors(device) if weights.shared else None
        return load_model(api.model, api.model_factory, trust_pickle, shared).to(device)

    return load
