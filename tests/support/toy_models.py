"""Small models built by a `--model-factory` in the tests: each exercises one failure or output kind.

The out-of-memory model only SIMULATES a CUDA OOM on the CPU (there is no GPU here) by raising
torch.OutOfMemoryError above a batch size.
"""

from __future__ import annotations

import os
import time

import torch
from torch import nn


class _Toy(nn.Module):
    """Identity on images, with one parameter so it has a state dict to save."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gain


class Slow(_Toy):
    """Sleeps TOY_DELAY_S per batch once its worker is ready: makes queues, deadlines and drains observable. The
    worker's own calls before it is ready (the built-in API's warm-up, then the memory measurement: SET_UP_CALLS) run
    at once, so a delay of seconds does not hold every start back by twice as much."""

    SET_UP_CALLS = 2

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls > self.SET_UP_CALLS:
            time.sleep(float(os.environ.get("TOY_DELAY_S", "0.5")))
        return super().forward(x)


class Picky(_Toy):
    """Raises when any image of the batch is all white, works on the rest."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if bool((x.flatten(1).min(dim=1).values > 0.99).any()):
            raise ValueError("cannot handle a white image")
        return super().forward(x)


class OutOfMemoryAboveTwo(_Toy):
    """SIMULATED out-of-memory: raises torch.OutOfMemoryError for batches of more than two images."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > 2:
            raise torch.OutOfMemoryError("simulated: CUDA out of memory")
        time.sleep(0.05)
        return super().forward(x)


class BrokenWarmup(_Toy):
    """Fails on every call, so the server must refuse to start."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("this model is broken")


class TinyClassifier(nn.Module):
    """Four classes from the mean colour: a non-image output answered as JSON top-k."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(3, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x.mean(dim=(2, 3)))


class TinySegmenter(_Toy):
    """Three classes, each pixel's brightest channel: a class mask (serve with task segment)."""


class TinyDetector(_Toy):
    """Per image: a box over its top-left quarter (class 1, score 0.9) and a faint one (class 2, score 0.1)."""

    def forward(self, x: torch.Tensor) -> list[dict[str, torch.Tensor]]:
        height, width = x.shape[2:]
        boxes = torch.tensor([[0.0, 0.0, width / 2, height / 2], [0.0, 0.0, 1.0, 1.0]]) * self.gain
        found = {"boxes": boxes, "labels": torch.tensor([1, 2]), "scores": torch.tensor([0.9, 0.1])}
        return [found] * x.shape[0]


class Recording(nn.Module):
    """An identity model that keeps a copy of every input it is given (for tests that look at what a model got)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(x.clone())
        return x
