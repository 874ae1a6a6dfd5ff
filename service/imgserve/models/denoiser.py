"""The built-in default model: a small residual convolutional denoiser (DnCNN-style) for RGB images."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

WEIGHTS = Path(__file__).with_suffix(".safetensors")  # shipped beside this module


class Denoiser(nn.Module):
    """Predicts the noise in an image and subtracts it; any input size, input and output in [0, 1]."""

    def __init__(self, channels: int = 24, depth: int = 5) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Conv2d(3, channels, 3, padding=1), nn.ReLU(inplace=True)]
        for _ in range(depth - 2):
            layers += [nn.Conv2d(channels, channels, 3, padding=1), nn.ReLU(inplace=True)]
        layers.append(nn.Conv2d(channels, 3, 3, padding=1))
        self.body = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        noise: torch.Tensor = self.body(x)
        return (x - noise).clamp(0.0, 1.0)


def build_denoiser() -> Denoiser:
    """The built-in model with the weights that ship in the package."""
    from safetensors.torch import load_file

    model = Denoiser()
    model.load_state_dict(load_file(WEIGHTS))
    return model
