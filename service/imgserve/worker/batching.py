"""Memory-bounded batching: the decoded items of a gathered batch (uploads left encoded decoded first, next to the
batch: worker/decoding.py) split into chunks the memory allows, each run through the API's `batch` -> `predict` ->
`unbatch`, split again on out-of-memory, a failing item isolated.

An item's size is the count of the elements of its arrays. The memory a chunk needs is measured once per model, when
the worker sets it up, on the API's example request (bytes per element at the peak, CUDA allocator or peak RSS);
the element budget the main process gives the model from the device's memory (pod.fit_models) then bounds every
chunk. Items go together only when the API's `batch` can take them:
by default items whose arrays share their shapes; with `group_by_shape` False, images (HxWxC arrays) of sizes
close enough that padding wastes at most MAX_PAD_WASTE, and any items otherwise.
"""

from __future__ import annotations

import contextlib
import logging
import resource
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from imgserve import heap
from imgserve.api import ImageAPI
from imgserve.errors import ApiError, fault, from_exception
from imgserve.pod import Measured
from imgserve.worker.decoding import decode_items

log = logging.getLogger(__name__)
MAX_PAD_WASTE = 2.0  # a padded chunk may hold at most twice the real elements
UNBOUNDED = 2**62  # the element budget of an API with nothing measured (its batch size alone bounds it)


@dataclass(frozen=True)
class Shape:
    """What the runner needs to know of a decoded item: what it can be batched with, and its size."""

    signature: tuple[Any, ...]  # the tree's structure with each array's shape and dtype: items that stack share it
    elements: int  # the elements of its arrays
    image: tuple[int, int, int] | None  # (height, width, channels) when the item is one HxWxC array

    @classmethod
    def of(cls, value: Any) -> Shape:
        elements = 0

        def visit(node: Any) -> Any:
            nonlocal elements
            if isinstance(node, np.ndarray | torch.Tensor):
                elements += int(np.prod(node.shape))
                return ("array", tuple(node.shape), str(node.dtype))
            if isinstance(node, dict):
                return ("dict", tuple((key, visit(item)) for key, item in node.items()))
            if isinstance(node, list | tuple):
                return (type(node).__name__, tuple(visit(item) for item in node))
            return ("value", type(node).__name__)

        signature = visit(value)
        image = tuple(value.shape) if isinstance(value, np.ndarray | torch.Tensor) and value.ndim == 3 else None
        return cls(signature, max(elements, 1), image)


def plan_chunks(shapes: Sequence[Shape], budget: int, group_by_shape: bool) -> list[list[int]]:
    """Group item indices into chunks the API's `batch` takes and the budget holds (a lone item always runs)."""
    if group_by_shape:
        groups: dict[tuple[Any, ...], list[int]] = {}
        for index, shape in enumerate(shapes):
            groups.setdefault(shape.signature, []).append(index)
        return [chunk for group in groups.values() for chunk in _within(group, shapes, budget)]
    if all(shape.image is not None for shape in shapes):
        return _padded_images(shapes, budget)
    return _within(list(range(len(shapes))), shapes, budget)


def _within(indices: list[int], shapes: Sequence[Shape], budget: int) -> list[list[int]]:
    """`indices` in order, cut whenever the next one would take a chunk over the budget."""
    chunks: list[list[int]] = []
    total = 0
    for index in indices:
        if chunks and total + shapes[index].elements <= budget:
            chunks[-1].append(index)
            total += shapes[index].elements
        else:
            chunks.append([index])
            total = shapes[index].elements
    return chunks


def _padded_images(shapes: Sequence[Shape], budget: int) -> list[list[int]]:
    """Images by size, each chunk padded to its largest height and width within the budget and MAX_PAD_WASTE."""
    images = [shape.image for shape in shapes]
    order = sorted(range(len(shapes)), key=lambda i: (shapes[i].elements, images[i]))
    chunks: list[list[int]] = []
    current: list[int] = []
    for index in order:
        candidate = [*current, index]
        height = max(images[i][0] for i in candidate)  # type: ignore[index]
        width = max(images[i][1] for i in candidate)  # type: ignore[index]
        padded = len(candidate) * height * width * images[index][2]  # type: ignore[index]
        real = sum(shapes[i].elements for i in candidate)
        if current and (padded > budget or padded > MAX_PAD_WASTE * real):
            chunks.append(current)
            candidate = [index]
        current = candidate
    return [*chunks, current] if current else chunks


class BatchRunner:
    """Runs the API's `batch` -> `predict` -> `unbatch` over a gathered batch: one output (or ApiError) per decoded
    item, in order."""

    def __init__(self, api: ImageAPI, device: torch.device, on_oom: Callable[[], None] = lambda: None) -> None:
        self.api, self.device, self.on_oom = api, device, on_oom
        self.element_budget = UNBOUNDED  # what one chunk may hold (the main process fits it to the device)
        self.bytes_per_element = 1.0  # measured on the API's example request (`measure`)
        self.last_need_bytes = 0  # what the largest chunk of the last call needed at its peak

    def __call__(self, values: list[Any]) -> list[Any]:
        values, failed = decode_items(values, self.device)
        live = [index for index in range(len(values)) if index not in failed]
        results: list[Any] = [failed.get(index) for index in range(len(values))]
        if not live:
            return results
        shapes = [Shape.of(values[index]) for index in live]
        chunks = plan_chunks(shapes, self.element_budget, self.api.group_by_shape)
        largest = max(sum(shapes[i].elements for i in chunk) for chunk in chunks)
        self.last_need_bytes = int(self.bytes_per_element * largest)
        for chunk in chunks:
            for i, output in zip(chunk, self._run_chunk([values[live[i]] for i in chunk]), strict=True):
                results[live[i]] = output
        return results

    def _run_chunk(self, values: list[Any]) -> list[Any]:
        """One chunk; on out-of-memory split it in halves, on any other error run each item alone, so only the item
        that fails gets its error."""
        try:
            outputs = self.call(values)
        except torch.OutOfMemoryError:
            self._out_of_memory()
            if len(values) == 1:
                return [ApiError(503, "out_of_memory", "the item does not fit in device memory now", 1)]
            half = len(values) // 2
            log.warning("out of memory on a batch of %d: splitting", len(values))
            return self._run_chunk(values[:half]) + self._run_chunk(values[half:])
        except Exception as exc:
            if len(values) > 1:
                return [output for value in values for output in self._run_chunk([value])]
            error = from_exception(exc)
            if error is None:
                log.exception("predict failed on an item")
                error = fault(exc, "predict")
            return [error]
        if len(outputs) != len(values):
            message = f"predict returned {len(outputs)} outputs for a batch of {len(values)}: unbatch gives one each"
            log.error("%s", message)
            return [ApiError(500, "api_error", message)] * len(values)
        return outputs

    def _out_of_memory(self) -> None:
        """Count the split and give the failed batch's cached blocks back before a smaller one is tried."""
        self.on_oom()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def measure(self, value: Any) -> Measured:
        """Run one decoded example item and measure the peak memory per element of its arrays (CUDA allocator, or
        peak RSS on a CPU): what a batch of such items needs, beside the weights already in place. An upload left
        encoded is decoded first, as a batch's are."""
        (value,), failed = decode_items([value], self.device)
        if failed:
            raise failed[0]
        elements = Shape.of(value).elements
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            base = torch.cuda.memory_allocated(self.device)
            self._warm_up(value)
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device) - base
        else:
            base = _restart_peak_rss()
            self._warm_up(value)
            peak = _peak_rss() - base
        floor = 2 * elements * 4  # a batch holds at least its input and output as float32
        self.bytes_per_element = max(peak, floor) / elements
        return Measured(self.bytes_per_element, elements)

    def call(self, values: list[Any]) -> list[Any]:
        """The API's steps on one chunk, as they are: `batch` -> `predict` -> `unbatch`."""
        api = self.api
        return list(api.unbatch(api.predict(api.batch(values))))

    def _warm_up(self, value: Any) -> None:
        outputs = self.call([value])
        if len(outputs) != 1:
            raise ValueError(f"predict returned {len(outputs)} outputs for a batch of 1 (unbatch must give one each)")


def _restart_peak_rss() -> int:
    """Give the heap's free memory back and start this process's peak RSS over from what it holds now (Linux 4.0+:
    /proc/self/clear_refs); returns that. A warm-up's peak is then measured from here, not hidden in freed memory
    the heap would reuse, nor under an earlier, higher peak: imports, a model load, or in a worker its
    parent's, which getrusage's ru_maxrss keeps. Where the peak cannot be restarted it reads less than was used."""
    heap.trim()
    with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")
    return _peak_rss()


def _peak_rss() -> int:
    """This process's peak resident bytes (VmHWM); getrusage's ru_maxrss where /proc is not there."""
    with contextlib.suppress(OSError), open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
