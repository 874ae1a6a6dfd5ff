"""Model repositories for the tests, in Triton's layout: one folder per model with its config.yaml (what
imgserve/repository.py reads)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import yaml
from safetensors.torch import save_file
from torch import nn


def write_repository(root: Path, models: dict[str, dict[str, Any]]) -> Path:
    """A repository at `root` with one folder per model, its config.yaml holding the settings given for it."""
    for name, config in models.items():
        folder = root / name
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.yaml").write_text(yaml.safe_dump(config))
    return root


HEAVY_MIB = 64


class Heavy(nn.Module):
    """A model whose weights are HEAVY_MIB MiB (what an unload must give back), and whose answer is the image."""

    def __init__(self) -> None:
        super().__init__()
        self.ballast = nn.Parameter(torch.zeros(HEAVY_MIB << 18))  # float32: 4 bytes each

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 0 * self.ballast.sum()  # reads every weight, as a real model's call does


def heavy_model(folder: Path) -> dict[str, Any]:
    """The config of a built-in model with HEAVY_MIB MiB of weights, its file written into `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    save_file(Heavy().state_dict(), str(folder / "heavy.safetensors"))
    return {"model": "heavy.safetensors", "model_factory": "repositories:Heavy"}
