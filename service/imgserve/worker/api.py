"""The LitAPI that LitServe runs in each inference worker: the served API behind imgserve's deadlines, slots,
memory-bounded batches and metrics.

`setup` loads the API on its device and measures, on the API's example request, the memory a batch needs (which
bounds every chunk and, with max_batch_size auto, the batch size). `predict` gets a gathered batch of request
messages: items past their deadline are answered 504 and never computed; the others are read from their slots,
run (worker/batching.py), and each output is written back into its request's slot, or travels in the answer
when small. Every failure is that item's answer; the worker survives them all.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import litserve as ls
import numpy as np
import torch

from imgserve import heap, metrics
from imgserve.api import ImageAPI
from imgserve.config import Settings
from imgserve.errors import ApiError, fault, from_exception
from imgserve.handoff import items
from imgserve.handoff.slots import SlotFiles
from imgserve.handoff.state import SharedState
from imgserve.models.loader import ModelLoadError, load_model
from imgserve.models.shared import SharedWeights
from imgserve.pod import TorchThreads
from imgserve.worker.batching import BatchRunner, Shape
from imgserve.worker.gather import GatheringLoop
from imgserve.worker.hooks import ImageHooks, LitServeHooks

log = logging.getLogger(__name__)
INLINE_BYTES = 64 * 1024  # outputs up to this size (class scores) travel in the answer message, larger in the slot


@dataclass(frozen=True)
class WorkerPlan:
    """What the composition root decided for every worker: where the slots and the weights are, its batch size
    (1 until auto measures it) and timeout, its torch threads, how many workers share its device and the memory
    kept for slots."""

    slot_directory: Path
    weights: SharedWeights
    batch_size: int
    batch_timeout_s: float
    auto_batch: bool
    torch_threads: TorchThreads
    workers_per_device: int
    reserved_bytes: int


class WorkerAPI(ls.LitAPI):
    """The served API (an ImageAPI, or a plain LitAPI run as LitServe runs it) in an inference worker."""

    def __init__(self, api: ls.LitAPI, settings: Settings, state: SharedState, plan: WorkerPlan) -> None:
        super().__init__(max_batch_size=plan.batch_size, batch_timeout=plan.batch_timeout_s, loop=GatheringLoop(state))
        self.api, self.settings, self.state, self.plan = api, settings, state, plan

    def setup(self, device: str) -> None:
        """Set up the API on `device`, warm it up on its example request, measure its memory and fix the batch
        limits. Ctrl-C reaches every process of the server; a worker leaves it to the main process, which drains,
        then stops the workers."""
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        self.settings.configure_logging()
        plan, api = self.plan, self.api
        self.slots = SlotFiles(plan.slot_directory)
        torch.set_num_threads(plan.torch_threads.alone)  # pod.py decided the counts
        if isinstance(api, ImageAPI):
            api.model_loader = shared_model_loader(api, plan.weights, self.settings)
            self.hooks: ImageHooks | LitServeHooks = ImageHooks(api)
        else:
            self.hooks = LitServeHooks(api)
        with self._reported(f"the API's setup failed on {device}"):
            api.setup(device)
        api.device = device  # as LitServe sets it after setup
        heap.hold_freed_memory()  # after loading: what a private load freed goes back to the system
        self.runner = BatchRunner(self.hooks, torch.device(device), on_oom=metrics.OOM_SPLITS.inc)
        self.heap = heap.BatchHeap(release=api.release_memory if isinstance(api, ImageAPI) else lambda: None)
        if isinstance(api, ImageAPI):
            self._measure(api, device)
        else:
            self.state.set_limits(self.max_batch_size, 0, 0)
        log.info(
            "worker ready on %s (%d torch threads, %d while other requests are in flight): weights %s, max batch %d",
            device,
            *plan.torch_threads,
            "shared" if plan.weights.shared else "private",
            self.max_batch_size,
        )

    def _measure(self, api: ImageAPI, device: str) -> None:
        """The memory a batch needs, from the example request; with max_batch_size auto, the batch size it allows."""
        plan = self.plan
        with self._reported(f"the API failed on its example request on {device}"):
            example = api.decode_request(api.example_request())
            memory = self.runner.measure(
                example, self.settings.gpu_memory_fraction, plan.workers_per_device, plan.reserved_bytes
            )
        if plan.auto_batch:
            self.max_batch_size = memory.batch_size_for(Shape.of(example).elements)
        self.state.set_limits(self.max_batch_size, memory.element_budget, memory.budget_bytes)
        log.info(
            "%s: %.1f bytes per element at the peak, budget %d MiB = %d elements",
            device,
            memory.bytes_per_element,
            memory.budget_bytes >> 20,
            memory.element_budget,
        )

    @contextlib.contextmanager
    def _reported(self, failure: str) -> Iterator[None]:
        """A failure inside the block becomes the one-line reason `imgserve serve` ends with, then re-raises."""
        try:
            yield
        except Exception as exc:
            reason = str(exc) if isinstance(exc, ModelLoadError) else f"{failure}: {type(exc).__name__}: {exc}"
            self.state.fail_setup(" ".join(reason.split()))
            raise

    def release_memory(self) -> None:
        """Idle: the buffers kept for reuse and the heap's free memory go back to the system."""
        self.heap.give_back()

    def predict(self, requests: list[dict[str, Any]]) -> list[Any]:
        """One answer per request message: what is past its deadline is never computed (504); the rest are read
        from their slots, run, and answered with their outputs (or each its own error)."""
        now = time.monotonic()
        answers: list[Any] = [ApiError(504, "deadline", "the deadline passed in the queue")] * len(requests)
        live = [i for i, request in enumerate(requests) if request["deadline"] > now]  # front ends count the rest
        prepared: dict[int, Any] = {}
        for i in live:
            metrics.QUEUE_WAIT.observe(now - requests[i]["admitted"])
            prepared[i], error = self._guarded(self._prepare, requests[i], where="decode_request")
            answers[i] = error
        ready = [i for i in live if answers[i] is None]
        if not ready:
            return answers
        metrics.BATCH_SIZE.observe(len(ready))
        metrics.INFLIGHT.set(len(ready))
        self._set_threads(len(ready))
        started = time.perf_counter()
        try:
            outputs = self.runner([prepared[i] for i in ready])
        finally:
            metrics.INFERENCE_DURATION.observe(time.perf_counter() - started)
            metrics.INFLIGHT.set(0)
        self.heap.after_batch(self.runner.last_need_bytes)
        for i, output in zip(ready, outputs, strict=True):
            answers[i] = output if isinstance(output, ApiError) else self._answer(requests[i], output, prepared[i])
        return answers

    def _prepare(self, request: dict[str, Any]) -> Any:
        """The request's item, read from its slot, as the hooks take it (a plain LitAPI decodes it here)."""
        slot = request["slot"][0]
        item = items.resolve(request["item"], lambda offset, shape, dtype: self.slots.read(slot, shape, dtype, offset))
        if isinstance(self.hooks, LitServeHooks):
            started = time.perf_counter()
            value = self.hooks.prepare(item)
            metrics.DECODE_DURATION.observe(time.perf_counter() - started)
            return value
        return item

    def _answer(self, request: dict[str, Any], output: Any, value: Any) -> Any:
        """The output finished (a plain LitAPI encodes it here) and placed: large arrays and bytes into the request's
        slot, unless its front end gave the slot to another request."""
        finished, error = self._guarded(self.hooks.finish, output, value, where="encode_response")
        if error is not None:
            return error
        slot, ticket = request["slot"]

        def write(array: np.ndarray, offset: int) -> None:
            if not self.state.owns(slot, ticket):
                raise ApiError(504, "deadline", "the request was given up on")
            self.slots.write(slot, array, offset)

        placed, error = self._guarded(items.place, finished, write, INLINE_BYTES, INLINE_BYTES, where="predict")
        return placed if error is None else error

    @staticmethod
    def _guarded(step: Callable[..., Any], *args: Any, where: str) -> tuple[Any, ApiError | None]:
        """(step(*args), None), or (None, the ApiError its exception answers with); an unexpected exception is
        logged with its traceback, once."""
        try:
            return step(*args), None
        except Exception as exc:
            error = from_exception(exc)
            if error is None:
                log.exception("%s failed", where)
                error = fault(exc, where)
            return None, error

    def _set_threads(self, batch_size: int) -> None:
        """All of this worker's torch threads for a batch that is all the pod has admitted, its share of the cores
        otherwise (pod.py's rule); the switch sets OpenMP's count for the next parallel region, well under 1 us."""
        alone = self.state.queue_depth <= batch_size
        torch.set_num_threads(self.plan.torch_threads.alone if alone else self.plan.torch_threads.busy)


def shared_model_loader(api: ImageAPI, weights: SharedWeights, settings: Settings) -> Callable[[str], torch.nn.Module]:
    """What `ImageAPI.load_model` calls in a worker: the API's model file, built around the device's shared weights
    (a private copy when they are not shared), loaded as far as the settings' trust flags allow."""

    def load(device: str) -> torch.nn.Module:
        if api.model is None:
            raise ModelLoadError(f"{type(api).__name__}.load_model() needs the class attribute `model` (a file path)")
        shared = weights.tensors(device) if weights.shared else None
        model = load_model(
            api.model, api.model_factory, settings.trust_pickle, shared, trust_native_code=settings.trust_native_code
        )
        return model.to(device)

    return load
