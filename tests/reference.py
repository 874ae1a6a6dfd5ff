"""torchvision's classification preprocessing written out by hand, to check imgserve's against it."""

from __future__ import annotations

import io

import numpy as np
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
