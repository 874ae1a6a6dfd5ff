"""Preprocessing as torchvision's weight transforms do it: Resize(N) + CenterCrop(S) on the PIL image (front end),
then Normalize(mean, std) on the float batch (worker); and the geometry to map the model's answer back."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
from PIL import Image

from imgserve import codec
from imgserve.config import BuiltinModel


class Geometry(NamedTuple):
    """Where the model's input came from: original size -> resized size -> crop box (all width, height order)."""

    original: tuple[int, int]
    resized: tuple[int, int]
    crop: tuple[int, int, int, int]  # left, top, width, height, in the resized image

    def to_original(self, x: float, y: float) -> tuple[float, float]:
        """A point of the model's input -> the same point in the original image's pixel coordinates."""
        left, top, _, _ = self.crop
        return (x + left) * self.original[0] / self.resized[0], (y + top) * self.original[1] / self.resized[1]


class Prepared(NamedTuple):
    """The model's input pixels (uint8 HxWx3) and how they were cut from the upload."""

    pixels: np.ndarray
    geometry: Geometry


@dataclass(frozen=True)
class Preprocess:
    """The PIL part: resize the shorter side to `resize_size`, then centre-crop `input_size` (or squash to it)."""

    resize_size: int | None = None
    input_size: int | None = None
    interpolation: str = "bilinear"

    @classmethod
    def from_settings(cls, settings: BuiltinModel) -> Preprocess:
        return cls(settings.resize_size, settings.input_size, settings.interpolation)

    @property
    def least_side(self) -> int | None:
        """How small the decoded image's sides may be for this resize (None: it is not resized): what
        `codec.open_image` may decode a JPEG down to."""
        return self.resize_size or self.input_size

    def __call__(self, image: Image.Image) -> Prepared:
        """The model's input from the decoded upload (which may have been decoded at a reduced scale: the geometry
        is the upload's own)."""
        geometry = self.geometry(*codec.full_size(image))
        if geometry.resized != image.size:
            image = image.resize(geometry.resized, codec.FILTERS[self.interpolation])
        if geometry.crop[2:] != geometry.resized:
            left, top, width, height = geometry.crop
            image = image.crop((left, top, left + width, top + height))
        # Read-only, over one copy of the pixels (np.array would make a second): they are only written to a slot.
        return Prepared(np.asarray(image), geometry)

    def geometry(self, width: int, height: int) -> Geometry:
        """How an upload of this size is cut: what the PIL part does to it, decided from its size alone (so that
        the worker can do it to an upload the front end left encoded)."""
        resized = self.resized_size(width, height)
        return Geometry((width, height), resized, self.crop_box(*resized))

    def resized_size(self, width: int, height: int) -> tuple[int, int]:
        """torchvision Resize(N): the shorter side becomes N, the longer N * long / short truncated to an int."""
        if self.resize_size is None:
            return (self.input_size, self.input_size) if self.input_size else (width, height)
        short, long = min(width, height), max(width, height)
        scaled_long = int(self.resize_size * long / short)
        return (self.resize_size, scaled_long) if width <= height else (scaled_long, self.resize_size)

    def crop_box(self, width: int, height: int) -> tuple[int, int, int, int]:
        """torchvision CenterCrop(S): offsets round((side - S) / 2), Python's round (half to even)."""
        if self.input_size is None or self.resize_size is None:
            return 0, 0, width, height
        size = self.input_size
        return int(round((width - size) / 2.0)), int(round((height - size) / 2.0)), size, size


def normalize_(batch: torch.Tensor, mean: tuple[float, ...] | None, std: tuple[float, ...] | None) -> None:
    """Normalize(mean, std), in place, on a float N x 3 x H x W batch in [0, 1]; unchanged when neither is set."""
    if mean is not None:
        batch.sub_(torch.tensor(mean, dtype=batch.dtype, device=batch.device).view(1, -1, 1, 1))
    if std is not None:
        batch.div_(torch.tensor(std, dtype=batch.dtype, device=batch.device).view(1, -1, 1, 1))
