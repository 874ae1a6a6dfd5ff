"""The LitAPI that runs in each inference worker: load + warm up, then slots -> batch -> model -> slots.

Requests arrive as a few small fields (slot, shape, deadline); the pixels are read from the request's shared-memory
slot straight into the batch, and an image result is written back into the same slot.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import litserve as ls
import numpy as np
import torch

from imgserve import heap, metrics
from imgserve.config import Settings
from imgserve.errors import ApiError
from imgserve.handoff.slots import InSlot, SlotFiles
from imgserve.handoff.state import SharedState
from imgserve.models import outputs
from imgserve.models.loader import ModelLoadError, load_model
from imgserve.models.shared import SharedWeights
from imgserve.pod import TorchThreads
from imgserve.worker.batching import BatchRunner, Result
from imgserve.worker.gather import GatheringLoop

log = logging.getLogger(__name__)
INLINE_BYTES = 64 * 1024  # results up to this size (class scores) travel in the answer message, larger in the slot


class SlotPixels:
    """A request's input image as it lies in its slot (the `Pixels` that BatchRunner reads)."""

    def __init__(self, slots: SlotFiles, request: dict[str, Any]) -> None:
        self.slots, self.slot, self.shape = slots, request["slot"][0], tuple(request["shape"])

    def read_into(self, out: np.ndarray) -> None:
        self.slots.read_into(self.slot, out)


@dataclass(frozen=True)
class WorkerPlan:
    """What the composition root decided for every worker: where the slots and the weights are, its batch size
    (1 until auto measures it), its torch threads, how many workers share its device and the memory kept for slots."""

    slot_directory: Path
    weights: SharedWeights
    batch_size: int
    torch_threads: TorchThreads
    workers_per_device: int
    reserved_bytes: int
    pad_mixed_sizes: bool = False


class ImageAPI(ls.LitAPI):
    """Images in (already decoded and validated by the HTTP front end), one result or ApiError per image out."""

    def __init__(self, settings: Settings, state: SharedState, plan: WorkerPlan) -> None:
        super().__init__(
            max_batch_size=plan.batch_size, batch_timeout=settings.batch_timeout_ms / 1000, loop=GatheringLoop(state)
        )
        self.settings, self.state, self.plan = settings, state, plan

    def setup(self, device: str) -> None:
        """Load the model on `device`, warm it up, measure its memory and fix the batch limits. Ctrl-C reaches every
        process of the server; a worker leaves it to the main process, which drains, then stops the workers."""
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        settings = self.settings
        settings.configure_logging()
        plan = self.plan
        self.slots = SlotFiles(plan.slot_directory)
        torch_device = torch.device(device)
        torch.set_num_threads(plan.torch_threads.alone)  # pod.py decided the counts
        with self._reported("cannot load the model"):
            shared = plan.weights.tensors(device) if plan.weights.shared else None
            model = load_model(settings.model, settings.model_factory, settings.trust_pickle, shared)
            model = model.to(torch_device)  # in place already when shared; the loader set eval mode
        heap.hold_freed_memory()  # after loading: what a private load freed goes back to the system
        self.runner = BatchRunner.for_settings(
            model, torch_device, settings, plan.pad_mixed_sizes, on_oom=metrics.OOM_SPLITS.inc
        )
        with self._reported(
            f"the model failed warm-up on {device} with a {self.runner.probe_side}x{self.runner.probe_side} image"
        ):
            memory = self.runner.measure(settings.gpu_memory_fraction, plan.workers_per_device, plan.reserved_bytes)
            # The output kind, decided from the warm-up output; the labels must name every class.
            self.runner.kind = outputs.decide(self.runner.warmup_output, settings.task)
            classes = outputs.class_count(self.runner.kind, self.runner.warmup_output)
            outputs.check_labels(outputs.read_labels(settings.labels), classes, settings.labels)
        self.runner.warmup_output = None
        self.heap = heap.BatchHeap(release=self.runner.release)
        self.state.set_task(self.runner.kind)
        if settings.max_batch_size == "auto":
            self.max_batch_size = memory.batch_size_at(settings.max_image_pixels)
        self.state.set_limits(self.max_batch_size, memory.pixel_budget, memory.budget_bytes)
        log.info(
            "worker ready on %s (%d torch threads, %d while other requests are in flight): weights %s, "
            "%.0f bytes/pixel, budget %d MiB = %d pixels, max batch %d",
            device,
            *plan.torch_threads,
            "shared" if plan.weights.shared else "private",
            memory.bytes_per_pixel,
            memory.budget_bytes >> 20,
            memory.pixel_budget,
            self.max_batch_size,
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
        """Idle: the batch buffers kept for reuse and the heap's free memory go back to the system."""
        self.heap.give_back()

    def predict(self, items: list[dict[str, Any]]) -> list[Result | InSlot]:
        """Drop what is past its deadline (never computed), run the rest, one answer per item: an InSlot, class
        scores or an ApiError, sent as they are to the front end (the loop in gather.py calls nothing else)."""
        now = time.monotonic()
        live = [i for i, item in enumerate(items) if item["deadline"] > now]
        results: list[Result | InSlot] = [ApiError(504, "deadline", "the deadline passed in the queue")] * len(items)
        metrics.REJECTED.labels("deadline").inc(len(items) - len(live))
        if not live:
            return results
        for i in live:
            metrics.QUEUE_WAIT.observe(now - items[i]["admitted"])
        metrics.BATCH_SIZE.observe(len(live))
        metrics.INFLIGHT.set(len(live))
        self._set_threads(len(live))
        started = time.perf_counter()
        try:
            answers = self.runner([SlotPixels(self.slots, items[i]) for i in live])
        finally:
            metrics.INFERENCE_DURATION.observe(time.perf_counter() - started)
            metrics.INFLIGHT.set(0)
        self.heap.after_batch(self.runner.last_need_bytes)
        for i, output in zip(live, answers, strict=True):
            results[i] = self._place(items[i], output)
        return results

    def _set_threads(self, batch_size: int) -> None:
        """All of this worker's torch threads for a batch that is all the pod has admitted, its share of the cores
        otherwise (pod.py's rule); the switch sets OpenMP's count for the next parallel region, well under 1 us."""
        alone = self.state.queue_depth <= batch_size
        torch.set_num_threads(self.plan.torch_threads.alone if alone else self.plan.torch_threads.busy)

    def _place(self, request: dict[str, Any], output: Result) -> Result | InSlot:
        """A large result goes into the request's slot (unless its front end gave the slot to another request)."""
        if not isinstance(output, np.ndarray) or output.nbytes <= INLINE_BYTES:
            return output
        slot, ticket = request["slot"]
        if not self.state.owns(slot, ticket):
            return ApiError(504, "deadline", "the request was given up on")
        try:
            self.slots.write(slot, output)
        except ApiError as error:
            return error
        return InSlot(output.shape, output.dtype.str)
