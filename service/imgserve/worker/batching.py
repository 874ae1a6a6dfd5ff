"""Memory-bounded batching: mixed image sizes padded into pixel-budgeted chunks, split again on out-of-memory.

The data path is lean: a chunk's uint8 HxWx3 images are read once into one uint8 NxHxWx3 buffer (pinned on CUDA,
so it crosses to the device at 1/4 of float32's bytes), converted on the device into float NCHW over NHWC memory
(channels_last, a free view), and an image result is quantised back to uint8 NHWC on the device before it leaves.
"""

from __future__ import annotations

import contextlib
import logging
import resource
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from imgserve.config import Settings
from imgserve.errors import ApiError
from imgserve.models import outputs, preprocess
from imgserve.pod import AUTO_BATCH_CAP, available_ram

log = logging.getLogger(__name__)

PROBE_SIDE = 256  # the warm-up image's side when the model has no fixed --input-size
MAX_PAD_WASTE = 2.0  # a padded chunk may hold at most twice the real pixels
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
ONE_THREAD_ELEMENTS = 1 << 20  # a CPU batch under this many input values is converted on one thread


@dataclass
class MemoryPlan:
    """How much a batch may hold: measured bytes per input pixel and the resulting pixel budget."""

    bytes_per_pixel: float
    budget_bytes: int

    @property
    def pixel_budget(self) -> int:
        return max(int(self.budget_bytes / self.bytes_per_pixel), 1)

    def need_bytes(self, sizes: list[tuple[int, int]]) -> int:
        """What one chunk of images of these sizes needs at its peak (padded to the largest)."""
        return int(self.bytes_per_pixel * len(sizes) * max(h for h, _ in sizes) * max(w for _, w in sizes))

    def batch_size_at(self, pixels: int) -> int:
        """The largest batch of `pixels`-sized images that fits the budget (at least 1)."""
        return min(max(self.pixel_budget // pixels, 1), AUTO_BATCH_CAP)


def plan_chunks(sizes: list[tuple[int, int]], pixel_budget: int, max_waste: float) -> list[list[int]]:
    """Group item indices so each padded chunk (n x max h x max w) stays in budget and padded/real <= max_waste.

    max_waste 1.0 means no padding at all: only images of the same size share a chunk.
    """
    order = sorted(range(len(sizes)), key=lambda i: (sizes[i][0] * sizes[i][1], sizes[i]))
    chunks: list[list[int]] = []
    current: list[int] = []
    for index in order:
        candidate = current + [index]
        height = max(sizes[i][0] for i in candidate)
        width = max(sizes[i][1] for i in candidate)
        padded = len(candidate) * height * width
        real = sum(sizes[i][0] * sizes[i][1] for i in candidate)
        if current and (padded > pixel_budget or padded > max_waste * real):
            chunks.append(current)
            candidate = [index]
        current = candidate
    if current:
        chunks.append(current)
    return chunks


class Pixels(Protocol):
    """An input image: its uint8 HxWx3 shape, and a way to copy its pixels into a contiguous array of that shape."""

    shape: tuple[int, ...]

    def read_into(self, out: np.ndarray) -> None: ...


def _size(image: Pixels) -> tuple[int, int]:
    """An image's height and width."""
    return image.shape[0], image.shape[1]


class InMemory:
    """Pixels already in this process (an HxWx3 uint8 array): the in-process and test callers' input."""

    def __init__(self, array: np.ndarray) -> None:
        self.array, self.shape = array, array.shape

    def read_into(self, out: np.ndarray) -> None:
        out[...] = self.array


Result = np.ndarray | dict | ApiError  # pixels, a mask or scores; detections; or why there is none


class BatchRunner:
    """Runs a model over images of any sizes; one result per image (see models/outputs.py) or an ApiError.

    mean/std normalize each batch on the device; probe_side is the warm-up image's size (the model's input size).
    """

    def __init__(
        self,
        model: Callable,
        device: torch.device,
        *,
        precision: str = "fp32",
        pad: bool = False,
        channels_last: bool = False,
        mean: tuple[float, ...] | None = None,
        std: tuple[float, ...] | None = None,
        probe_side: int = PROBE_SIDE,
        on_oom: Callable[[], None] = lambda: None,
    ) -> None:
        self.model, self.device, self.precision, self.on_oom = model, device, precision, on_oom
        self.mean, self.std, self.probe_side = mean, std, probe_side
        self.warmup_output = None  # the model's answer to the probe: outputs.decide reads the output kind from it
        self.kind: str | None = None  # what the output is (outputs.decide); unset, each batch's output says
        self.max_waste = MAX_PAD_WASTE if pad else 1.0
        self.memory = MemoryPlan(bytes_per_pixel=1.0, budget_bytes=2**62)
        self._buffers: dict[str, torch.Tensor] = {}  # the input buffers, reused from batch to batch
        self.last_need_bytes = 0  # what the largest chunk of the last call needed at its peak
        self._use_layout(channels_last)

    @classmethod
    def for_settings(
        cls,
        model: Callable,
        device: torch.device,
        settings: Settings,
        pad: bool,
        on_oom: Callable[[], None] = lambda: None,
    ) -> BatchRunner:
        """The runner the server uses for `settings` on `device`, padding mixed sizes into one batch or not."""
        return cls(
            model,
            device,
            precision=settings.precision,
            pad=pad,
            channels_last=settings.channels_last,
            mean=settings.mean,
            std=settings.std,
            probe_side=settings.input_size or PROBE_SIDE,
            on_oom=on_oom,
        )

    def _use_layout(self, channels_last: bool) -> None:
        """NHWC (channels_last) or NCHW memory for the model's weights and every batch."""
        self.channels_last = channels_last
        if isinstance(self.model, torch.nn.Module):
            layout = torch.channels_last if channels_last else torch.contiguous_format
            self.model.to(memory_format=layout)  # type: ignore[call-overload]  # torch's stubs lack it

    def __call__(self, images: Sequence[Pixels]) -> list[Result]:
        results: list[Result] = [ApiError(500, "no_output", "no output")] * len(images)
        sizes = [_size(image) for image in images]
        chunks = plan_chunks(sizes, self.memory.pixel_budget, self.max_waste)
        self.last_need_bytes = max(self.memory.need_bytes([sizes[i] for i in chunk]) for chunk in chunks)
        for chunk in chunks:
            for index, output in zip(chunk, self._run_chunk([images[i] for i in chunk]), strict=True):
                results[index] = output
        return results

    def _run_chunk(self, images: Sequence[Pixels]) -> list[Result]:
        """Run one chunk; on OOM split it in halves, on an error isolate the failing image."""
        try:
            return self._run_padded(images)
        except torch.OutOfMemoryError:
            self._out_of_memory()
            if len(images) == 1:
                return [ApiError(503, "out_of_memory", "the image does not fit in device memory now", 1)]
            half = len(images) // 2
            log.warning("out of memory on a batch of %d: splitting", len(images))
            return self._run_chunk(images[:half]) + self._run_chunk(images[half:])
        except ApiError as error:
            return [error] * len(images)
        except Exception as exc:  # a model that raises on one input must not fail its neighbours
            if len(images) > 1:
                return [out for image in images for out in self._run_chunk([image])]
            log.exception("the model raised on an input")
            return [ApiError(500, "model_error", f"the model failed on this image: {type(exc).__name__}: {exc}")]

    def _out_of_memory(self) -> None:
        """Count the split and give the failed batch's cached blocks back before a smaller one is tried."""
        self.on_oom()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _run_padded(self, images: Sequence[Pixels]) -> list[Result]:
        height = max(image.shape[0] for image in images)
        width = max(image.shape[1] for image in images)
        batch = self._host_batch(images, height, width)
        output = self.forward(batch)
        kind = self.kind or outputs.decide(output, "auto")
        with self._conversion_threads(batch):
            return outputs.per_image(kind, output, [_size(image) for image in images], (height, width))

    @contextlib.contextmanager
    def _conversion_threads(self, batch: torch.Tensor) -> Iterator[None]:
        """The uint8 <-> float passes of a batch under ONE_THREAD_ELEMENTS values on a CPU run on one thread, the
        model on all of its own: waking a passively waiting OpenMP thread costs more than it saves on so little work
        (measured in docs/architecture.md, "How the model runs")."""
        threads = torch.get_num_threads()
        if self.device.type != "cpu" or threads == 1 or batch.numel() >= ONE_THREAD_ELEMENTS:
            yield
            return
        torch.set_num_threads(1)  # it only sets OpenMP's count for the next parallel region
        try:
            yield
        finally:
            torch.set_num_threads(threads)

    def _buffer(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A tensor reused from batch to batch: on a CPU, a fresh 100 MB tensor costs more in page faults than the
        work done in it; on CUDA the host side is pinned, so it crosses to the device by DMA."""
        numel = int(np.prod(shape))
        flat = self._buffers.get(name)
        if flat is None or flat.numel() < numel:
            pinned = device.type == "cpu" and self.device.type == "cuda"
            flat = self._buffers[name] = torch.empty(numel, dtype=dtype, device=device, pin_memory=pinned)
        return flat[:numel].view(shape)

    def release(self) -> None:
        """Drop the reused batch buffers (when idle: the next batch allocates them again)."""
        self._buffers.clear()

    def _host_batch(self, images: Sequence[Pixels], height: int, width: int) -> torch.Tensor:
        """The chunk as one uint8 NxHxWx3 buffer; smaller images are padded by repeating their edge pixels."""
        batch = self._buffer("host", (len(images), height, width, 3), torch.uint8, torch.device("cpu"))
        rows = batch.numpy()
        for row, image in zip(rows, images, strict=True):
            h, w = image.shape[:2]
            if (h, w) == (height, width):
                image.read_into(row)
                continue
            own = np.empty((h, w, 3), dtype=np.uint8)
            image.read_into(own)
            row[:h, :w] = own
            row[h:, :w] = own[-1:]
            row[:, w:] = row[:, w - 1 : w]
        return batch

    def forward(self, batch: torch.Tensor) -> Any:
        """One model call on a uint8 NxHxWx3 host batch, under inference mode (and autocast for fp16/bf16); the
        output stays where the model left it (outputs.per_image brings back only what is answered)."""
        autocast = (
            torch.autocast(self.device.type, dtype=DTYPES[self.precision])
            if self.precision in DTYPES
            else contextlib.nullcontext()
        )
        with torch.inference_mode():
            with self._conversion_threads(batch):
                staged = batch.to(self.device, non_blocking=True)
                # uint8 -> float in [0, 1], into NHWC memory that the model sees as NCHW (channels_last).
                inputs = self._buffer("input", staged.shape, torch.float32, self.device)
                inputs = inputs.copy_(staged).div_(255).permute(0, 3, 1, 2)
                preprocess.normalize_(inputs, self.mean, self.std)
                if not self.channels_last:
                    inputs = inputs.contiguous()
            with autocast:
                return self.model(inputs)

    def split_seconds(self, images: Sequence[Pixels]) -> tuple[int, float, float]:
        """Seconds one batch of `images` (of one size) spends in this process's own work (filling the batch, taking
        the results apart) and in the model call on the device (with the host-to-device copy), after a warm-up.
        A batch the device has no memory for is halved until one model call fits; its size comes first."""
        while True:
            try:
                self.forward(self._host_batch(images, *images[0].shape[:2]))
                self._synchronize()
                break
            except torch.OutOfMemoryError:
                if len(images) == 1:
                    raise
                self._out_of_memory()
                images = images[: len(images) // 2]
        self(images)
        started = time.perf_counter()
        self(images)
        self._synchronize()
        total = time.perf_counter() - started
        batch = self._host_batch(images, *images[0].shape[:2])
        self._synchronize()
        started = time.perf_counter()
        self.forward(batch)
        self._synchronize()
        device = time.perf_counter() - started
        return len(images), max(total - device, 0.0), device

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def measure(self, memory_fraction: float, sharers: int = 1, reserved_bytes: int = 0) -> MemoryPlan:
        """Warm up on a probe image and measure peak memory per pixel (CUDA allocator, or peak RSS on CPU).

        The device's batch memory, `memory_fraction` of what is free now less `reserved_bytes` (kept for the request
        slots), is shared by its `sharers` workers; the weights, held once and already in place, are not in it.
        """
        probe = torch.randint(0, 256, (1, self.probe_side, self.probe_side, 3), dtype=torch.uint8)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            base = torch.cuda.memory_allocated(self.device)
            self.warmup_output = self._first_forward(probe)
            torch.cuda.synchronize(self.device)  # the probe's copy from the reused pinned buffer is done
            peak = torch.cuda.max_memory_allocated(self.device) - base
            free, _ = torch.cuda.mem_get_info(self.device)
        else:
            base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
            self.warmup_output = self._first_forward(probe)
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
            free = available_ram()
        # Activations cannot be smaller than the input and output themselves.
        floor = 2 * probe.numel() * 4  # as float32
        usable = int(memory_fraction * free)
        budget = (usable - min(reserved_bytes, usable // 2)) // sharers  # the slots get at most half
        self.memory = MemoryPlan(max(peak, floor) / self.probe_side**2, budget)
        return self.memory

    def _first_forward(self, probe: torch.Tensor) -> Any:
        """The warm-up call; a model that refuses channels_last input (e.g. it .view()s it) falls back to NCHW."""
        if not self.channels_last:
            return self.forward(probe)
        try:
            return self.forward(probe)
        except Exception as exc:
            self._use_layout(False)
            output = self.forward(probe)  # a model that fails in NCHW too raises here, with its own error
            log.warning("the model fails on channels_last input (%s): running it in NCHW", exc)
            return output
