"""Toy models the GPU check serves through `--model-factory` (importable by the server's spawned workers)."""

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
    """Factory for `--model-factory loadtests.toy_models:batch_hungry` (its state dict is empty)."""
    return BatchHungry()
