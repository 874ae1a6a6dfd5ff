"""Toy models the GPU check, the soak and the tests serve through `--model-factory` (importable by the server's
spawned workers)."""

from __future__ import annotations

import torch

OVERCOMMIT = 4  # each image after the first asks for this many times the device's whole memory


class BatchHungry(torch.nn.Module):
    """The input, clamped; its scratch memory grows with the batch beyond what any device has.

    One image needs nothing, so warm-up (one probe image) measures it as cheap; every batch of two or more runs
    out of memory for real, the case that imgserve's split-and-retry exists for.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > 1 and x.device.type == "cuda":
            total = torch.cuda.get_device_properties(x.device).total_memory
            torch.empty((x.shape[0] - 1) * OVERCOMMIT * total, dtype=torch.uint8, device=x.device)
        return x.clamp(0, 1)


def batch_hungry() -> torch.nn.Module:
    """Factory for `--model-factory loadtests.lib.toy_models:batch_hungry` (its state dict is empty)."""
    return BatchHungry()


class WeightReader(torch.nn.Module):
    """`mib` MiB of float32 weights in eight parts, every one of them read by each forward (so every worker touches
    every page): the image is blended with the weights' mean, so an answer shows whether they were intact."""

    def __init__(self, mib: int) -> None:
        super().__init__()
        count = mib * 2**20 // 4 // 8
        self.parts = torch.nn.ParameterList(torch.nn.Parameter(torch.linspace(0, i / 8, count)) for i in range(1, 9))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        level = torch.stack([part.mean() for part in self.parts]).mean()
        return (0.5 * x + level).clamp(0, 1)


def heavy_weights() -> WeightReader:
    """256 MiB of weights: the memory test's W."""
    return WeightReader(256)


def light_weights() -> WeightReader:
    """1 MiB: what extra workers cost apart from the weights."""
    return WeightReader(1)
