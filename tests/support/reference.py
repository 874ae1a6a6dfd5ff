"""The work done by hand, as a user's own script would: torchvision's classification preprocessing and the usual
tensor conversions, to check imgserve's answers against."""

from __future__ import annotations

import io

import numpy as np
import torch
from PIL import Image

IMAGENET_MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32)
IMAGENET_STD = np.array([0.229, 0.224, 0.225], dtype=np.float32)


def half_to_even(twice: int) -> int:
    """round(twice / 2) as Python rounds a half: to the even neighbour."""
    whole, half = divmod(twice, 2)
    return whole + (half and whole % 2)


def torchvision_by_hand(
    data: bytes, resize: int, crop: int, resample: Image.Resampling = Image.Resampling.BILINEAR
) -> np.ndarray:
    """Resize(resize) + CenterCrop(crop) + ToTensor + Normalize(ImageNet), as torchvision documents them: 3xHxW."""
    image = Image.open(io.BytesIO(data)).convert("RGB")
    width, height = image.size
    size = (resize, resize * height // width) if width <= height else (resize * width // height, resize)
    if size != image.size:
        image = image.resize(size, resample)
    left, top = half_to_even(size[0] - crop), half_to_even(size[1] - crop)
    image = image.crop((left, top, left + crop, top + crop))
    pixels = np.asarray(image, dtype=np.float32) / 255.0
    return ((pixels - IMAGENET_MEAN) / IMAGENET_STD).transpose(2, 0, 1)


def photo(width: int, height: int) -> bytes:
    """A random-noise RGB PNG (every pixel differs, so an off-by-one crop or resize shows)."""
    rng = np.random.default_rng(width * 7 + height)
    buffer = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buffer, format="PNG")
    return buffer.getvalue()


def to_tensor(pixels: np.ndarray) -> torch.Tensor:
    """uint8 HxWx3 -> float32 3xHxW in [0, 1], as torchvision's ToTensor."""
    return torch.tensor(pixels).permute(2, 0, 1).float().div(255.0)  # a copy: decoded pixels are read-only


def from_tensor(image: torch.Tensor) -> np.ndarray:
    """A CxHxW output in [0, 1] -> uint8 HxWxC."""
    return image.detach().float().clamp(0, 1).mul(255).round().to(torch.uint8).permute(1, 2, 0).numpy()
