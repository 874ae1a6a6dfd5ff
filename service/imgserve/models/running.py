"""Running an image model lean: a chunk's uint8 HxWx3 images read once into one uint8 NxHxWx3 buffer (pinned on
CUDA, so it crosses to the device at a quarter of float32's bytes), converted on the device into float NCHW over
NHWC memory (channels_last, a free view), normalized there, and the model called under inference mode (autocast
for fp16/bf16), eagerly or compiled (models/compiled.py). The buffers are reused from batch to batch: on a CPU a
fresh 100 MB tensor costs more in page faults than the work done in it.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal

import numpy as np
import torch

from imgserve.config import BuiltinModel
from imgserve.models import compiled, preprocess
from imgserve.models.native import NativeModule

log = logging.getLogger(__name__)
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
ONE_THREAD_ELEMENTS = 1 << 20  # a CPU batch under this many input values is converted on one thread


class ModelRunner:
    """One model on one device: `pixel_batch` fills the reused input buffer, `forward` runs the model on it."""

    def __init__(
        self,
        model: torch.nn.Module,
        device: torch.device,
        *,
        precision: str = "fp32",
        channels_last: bool = False,
        mean: tuple[float, ...] | None = None,
        std: tuple[float, ...] | None = None,
    ) -> None:
        self.model, self.device, self.precision = model, device, precision
        self.mean, self.std = mean, std
        self._buffers: dict[str, torch.Tensor] = {}
        self._use_layout(channels_last)
        self.call: Callable[[torch.Tensor], Any] = model  # or the model compiled (`compile`)
        self.compile_required = False

    @classmethod
    def for_settings(
        cls,
        model: torch.nn.Module,
        device: torch.device,
        settings: BuiltinModel,
        max_batch_size: int | Literal["auto"] = "auto",
        threads: Sequence[int] = (),
    ) -> ModelRunner:
        """The runner the built-in API uses for `settings` on `device` (an AOTInductor package takes NCHW), compiled
        for batches up to `max_batch_size` on the worker's thread counts, `threads`, where compiled."""
        runner = cls(
            model,
            device,
            precision=settings.precision,
            channels_last=settings.channels_last and not isinstance(model, NativeModule),
            mean=settings.mean,
            std=settings.std,
        )
        fixed_size = settings.input_size is not None
        if compiled.wanted(settings.compile, device.type, model, fixed_size):
            cache = compiled.cache_directory(settings.compile_cache_dir)
            key = compiled.warm_key(settings, max_batch_size, device)
            freeze = compiled.freezes(model, device.type, fixed_size, settings.precision)
            largest = None if max_batch_size == "auto" else max_batch_size
            runner.call = compiled.CompiledModel(model, cache, not fixed_size, key, freeze, largest, threads)
            runner.compile_required = bool(settings.compile)
        return runner

    def _use_layout(self, channels_last: bool) -> None:
        """NHWC (channels_last) or NCHW memory for the model's weights and every batch."""
        self.channels_last = channels_last
        layout = torch.channels_last if channels_last else torch.contiguous_format
        self.model.to(memory_format=layout)  # type: ignore[call-overload]  # torch's stubs lack it

    def pixel_batch(self, images: Sequence[np.ndarray | torch.Tensor]) -> torch.Tensor:
        """The images as one uint8 NxHxWx3 buffer of their largest height and width; smaller images are padded by
        repeating their edge pixels. On the host, or on the device where the first image lies there already (decoded
        in the worker)."""
        height = max(image.shape[0] for image in images)
        width = max(image.shape[1] for image in images)
        on_device = isinstance(images[0], torch.Tensor) and images[0].device.type != "cpu"
        where = self.device if on_device else torch.device("cpu")
        batch = self._buffer(f"pixels-{where.type}", (len(images), height, width, 3), torch.uint8, where)
        tensors = any(isinstance(image, torch.Tensor) for image in images)
        rows = batch if tensors else batch.numpy()
        for row, image in zip(rows, images, strict=True):
            if tensors and isinstance(image, np.ndarray):
                image = torch.tensor(image, device=where)  # v2 `pixels`, decoded before the worker
            h, w = image.shape[:2]
            row[:h, :w] = image
            if (h, w) != (height, width):
                row[h:, :w] = image[-1:]
                row[:, w:] = row[:, w - 1 : w]
        return batch

    def forward(self, batch: torch.Tensor) -> Any:
        """One model call on a uint8 NxHxWx3 host batch; the output stays where the model left it."""
        autocast = (
            torch.autocast(self.device.type, dtype=DTYPES[self.precision])
            if self.precision in DTYPES
            else contextlib.nullcontext()
        )
        with torch.inference_mode():
            with self.conversion_threads(batch):
                staged = batch.to(self.device, non_blocking=True)
                # uint8 -> float in [0, 1], into NHWC memory that the model sees as NCHW (channels_last).
                inputs = self._buffer("input", tuple(staged.shape), torch.float32, self.device)
                inputs = inputs.copy_(staged).div_(255).permute(0, 3, 1, 2)
                preprocess.normalize_(inputs, self.mean, self.std)
                if not self.channels_last:
                    inputs = inputs.contiguous()
            with autocast:
                return self.call(inputs)

    def warm_up(self, probe: torch.Tensor, sizes: list[int], threads: list[int]) -> Any:
        """The first call, on a uint8 1xHxWx3 `probe` (`first_forward`); a compiled model is then warmed up on
        batches of `sizes` of it on each count of `threads` (`CompiledModel.warm_up`), so that no request waits for a
        compile. Where the model was compiled only by default, a compile that fails (a host without a C++
        compiler, a model torch cannot trace) leaves it eager, with a warning. Returns the first call's output."""
        if not isinstance(self.call, compiled.CompiledModel):
            return self.first_forward(probe)
        started, layout, own_threads = time.perf_counter(), self.channels_last, torch.get_num_threads()
        try:
            with self.call.compiling():
                output = self.first_forward(probe)
                self.call.warm_up(lambda size: self.forward(probe.expand(size, -1, -1, -1)), sizes, threads)
        except Exception as exc:
            if self.compile_required:
                raise
            log.warning("torch.compile failed (%s): running the model eagerly", compiled.one_line(exc))
            self.call = self.model
            self._use_layout(layout)
            return self.first_forward(probe)
        finally:
            torch.set_num_threads(own_threads)
        log.info(
            "model compiled for batches of 1 to %d on %s threads in %.1f s: %s",
            max(sizes),
            " and ".join(map(str, threads)),
            time.perf_counter() - started,
            self.call.describe(),
        )
        return output

    def first_forward(self, batch: torch.Tensor) -> Any:
        """The warm-up call; a model that refuses channels_last input (e.g. it .view()s it) falls back to NCHW."""
        if not self.channels_last:
            return self.forward(batch)
        try:
            return self.forward(batch)
        except Exception as exc:
            self._use_layout(False)
            output = self.forward(batch)  # a model that fails in NCHW too raises here, with its own error
            log.warning("the model fails on channels_last input (%s): running it in NCHW", exc)
            return output

    @contextlib.contextmanager
    def conversion_threads(self, batch: torch.Tensor) -> Iterator[None]:
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
        """A tensor reused from batch to batch; on CUDA the host side is pinned, so it crosses to the device by DMA."""
        numel = int(np.prod(shape))
        flat = self._buffers.get(name)
        if flat is None or flat.numel() < numel:
            pinned = device.type == "cpu" and self.device.type == "cuda"
            flat = self._buffers[name] = torch.empty(numel, dtype=dtype, device=device, pin_memory=pinned)
        return flat[:numel].view(shape)

    def release(self) -> None:
        """Drop the reused buffers (when idle: the next batch allocates them again)."""
        self._buffers.clear()
