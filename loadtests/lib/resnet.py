"""The benchmark's real-size model: a ResNet-50 (transformers' `ResNetForImageClassification`, built from its config
with seeded random weights: no download), exported with `torch.export` as a .pt2 that imgserve serves with
`--preprocess imagenet`, and the same program run alone on pre-decoded tensors (`ModelAlone`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch

from imgserve.models.compiled import CompiledModel, freezes
from loadtests.lib.images import SampleImage, synthetic_image

SEED = 0
CLASSES = 1000  # ImageNet's
INPUT = 224  # --preprocess imagenet: resize 256, centre crop 224
MAX_BATCH = 256  # the exported program's largest batch (a GPU's)
PHOTO = (500, 375)  # the upload: a 500x375 JPEG photo


class Logits(torch.nn.Module):
    """transformers' model as imgserve calls a classifier: pixels in, logits out."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.model(pixel_values=pixels).logits


def build() -> torch.nn.Module:
    """The ResNet-50, in eval mode, with the seeded random weights."""
    from transformers import ResNetConfig, ResNetForImageClassification

    torch.manual_seed(SEED)
    return Logits(ResNetForImageClassification(ResNetConfig(num_labels=CLASSES))).eval()


def export(path: Path) -> Path:
    """The ResNet-50 as a torch.export program with a dynamic batch, saved at `path` (kept if it is there)."""
    if not path.exists():
        batch = torch.export.Dim("batch", min=1, max=MAX_BATCH)
        program = torch.export.export(build(), (torch.rand(2, 3, INPUT, INPUT),), dynamic_shapes={"pixels": {0: batch}})
        torch.export.save(program, str(path))
    return path


def photos(count: int = 4) -> tuple[SampleImage, ...]:
    """`count` different 500x375 JPEGs (seeded synthetic photos)."""
    return tuple(synthetic_image(39_000 + seed, *PHOTO, "JPEG") for seed in range(count))


def program(path: Path, device: str = "cpu") -> torch.nn.Module:
    """The exported program at `path` on `device`, its weights channels-last as imgserve lays them out."""
    module = torch.export.load(str(path)).module().to(device)
    module.to(memory_format=torch.channels_last)  # type: ignore[call-overload]  # torch's stubs lack it
    return module


def images_per_s(
    model: Callable[[torch.Tensor], object], pixels: torch.Tensor, seconds: float, wait: Callable[[], None]
) -> float:
    """Images/s of `model` on the batch `pixels`, called over and over for `seconds` (at least once); `wait` for the
    device's queued work before the clock is read."""
    done, started = 0, time.perf_counter()
    while done == 0 or time.perf_counter() - started < seconds:
        model(pixels)
        done += len(pixels)
    wait()
    return done / (time.perf_counter() - started)


class ModelAlone:
    """The exported program alone on pre-decoded channels-last tensors, as imgserve runs it: eager, or compiled the
    way --compile compiles it on the device (models/compiled.py: frozen into a package on a CPU), its code kept in
    `cache`."""

    def __init__(self, path: Path, compiled: bool, cache: Path, device: str = "cpu") -> None:
        self.device = torch.device(device)
        module = program(path, device)
        self.model: Callable[[torch.Tensor], torch.Tensor] = module
        if compiled:
            cache.mkdir(mode=0o700, parents=True, exist_ok=True)
            freeze = freezes(module, self.device.type, True, "fp32")
            self.model = CompiledModel(module, cache, False, "alone", freeze, MAX_BATCH)

    def images_per_s(self, batch: int, seconds: float) -> tuple[float, float]:
        """(images/s over `seconds` of batches of `batch`, seconds the first call took: a compile, if any)."""
        pixels = torch.rand(batch, 3, INPUT, INPUT, device=self.device).contiguous(memory_format=torch.channels_last)
        with torch.inference_mode():
            started = time.perf_counter()
            self.model(pixels)
            self._synchronize()
            first_s = time.perf_counter() - started
            return images_per_s(self.model, pixels, seconds, self._synchronize), first_s

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
