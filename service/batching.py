"""Memory-bounded batching: mixed image sizes padded into pixel-budgeted chunks, split again on out-of-memory."""

from __future__ import annotations

import contextlib
import logging
import resource
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from service import preprocess, tasks
from service.config import Settings
from service.errors import ApiError

log = logging.getLogger(__name__)

PROBE_SIDE = 256  # the warm-up image's side when the model has no fixed --input-size
AUTO_BATCH_CAP = 256
MAX_PAD_WASTE = 2.0  # a padded chunk may hold at most twice the real pixels
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass
class MemoryPlan:
    """How much a batch may hold: measured bytes per input pixel and the resulting pixel budget."""

    bytes_per_pixel: float
    budget_bytes: int

    @property
    def pixel_budget(self) -> int:
        return max(int(self.budget_bytes / self.bytes_per_pixel), 1)

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


class BatchRunner:
    """Runs a model over a list of 3xHxW tensors of any sizes; returns one output (or ApiError) per input.

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
        self.warmup_output = None  # the model's answer to the probe: tasks.decide reads the output kind from it
        self.max_waste = MAX_PAD_WASTE if pad else 1.0
        self.memory = MemoryPlan(bytes_per_pixel=1.0, budget_bytes=2**62)
        self._use_layout(channels_last)

    @classmethod
    def for_settings(
        cls, model: Callable, device: torch.device, settings: Settings, on_oom: Callable[[], None] = lambda: None
    ) -> BatchRunner:
        """The runner the server uses for `settings` on `device`."""
        return cls(
            model,
            device,
            precision=settings.precision,
            pad=settings.pads_on(device.type),
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
            self.model.to(memory_format=torch.channels_last if channels_last else torch.contiguous_format)

    def __call__(self, images: list[torch.Tensor]) -> list[torch.Tensor | ApiError]:
        results: list[torch.Tensor | ApiError] = [ApiError(500, "no_output", "no output")] * len(images)
        sizes = [tuple(image.shape[-2:]) for image in images]
        for chunk in plan_chunks(sizes, self.memory.pixel_budget, self.max_waste):
            for index, output in zip(chunk, self._run_chunk([images[i] for i in chunk]), strict=True):
                results[index] = output
        return results

    def _run_chunk(self, images: list[torch.Tensor]) -> list[torch.Tensor | ApiError]:
        """Pad to a common size and run; on OOM split in halves, on an error isolate the failing image."""
        try:
            return self._forward_padded(images)
        except torch.OutOfMemoryError:
            self.on_oom()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
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

    def _forward_padded(self, images: list[torch.Tensor]) -> list[torch.Tensor]:
        height = max(image.shape[-2] for image in images)
        width = max(image.shape[-1] for image in images)
        batch = torch.stack(
            [F.pad(im[None], (0, width - im.shape[-1], 0, height - im.shape[-2]), mode="replicate")[0] for im in images]
        )
        output = self.forward(batch)
        return tasks.split(output, [tuple(im.shape[-2:]) for im in images], (height, width))  # issue 15: any kind

    def forward(self, batch: torch.Tensor) -> Any:
        """One model call under inference mode, with autocast for fp16/bf16; the output is on the CPU."""
        autocast = (
            torch.autocast(self.device.type, dtype=DTYPES[self.precision])
            if self.precision in DTYPES
            else contextlib.nullcontext()
        )
        batch = preprocess.normalize(batch.to(self.device, non_blocking=True), self.mean, self.std)  # issue 15
        if self.channels_last:
            batch = batch.contiguous(memory_format=torch.channels_last)
        with torch.inference_mode(), autocast:
            output = self.model(batch)
        return tasks.to_cpu(output)  # issue 15: tensors, dicts ({"out"}) and lists of dicts (detections)

    def measure(self, memory_fraction: float) -> MemoryPlan:
        """Warm up on a probe image and measure peak memory per pixel (CUDA allocator, or peak RSS on CPU)."""
        probe = torch.rand(1, 3, self.probe_side, self.probe_side)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            base = torch.cuda.memory_allocated(self.device)
            self.warmup_output = self._first_forward(probe)
            peak = torch.cuda.max_memory_allocated(self.device) - base
            free, _ = torch.cuda.mem_get_info(self.device)
        else:
            base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
            self.warmup_output = self._first_forward(probe)
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
            free = _available_ram()
        # Activations cannot be smaller than the input and output themselves.
        floor = 2 * probe.numel() * probe.element_size()
        self.memory = MemoryPlan(max(peak, floor) / self.probe_side**2, int(memory_fraction * free))
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


def _available_ram() -> int:
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("MemAvailable missing from /proc/meminfo")
