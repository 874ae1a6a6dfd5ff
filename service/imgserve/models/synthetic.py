"""Deterministic synthetic photos (gradients, shapes, texture) and noise, to train and test the denoiser."""

from __future__ import annotations

import numpy as np


def clean_image(rng: np.random.Generator, height: int, width: int) -> np.ndarray:
    """A float32 HxWx3 image in [0, 1]: a colour gradient with random discs, bars and a soft texture."""
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)
    yy, xx = yy / max(height - 1, 1), xx / max(width - 1, 1)
    c0, c1, c2 = rng.uniform(0, 1, (3, 3)).astype(np.float32)
    image = c0 + (c1 - c0) * xx[..., None] + (c2 - c0) * yy[..., None] * 0.5
    for _ in range(rng.integers(2, 7)):
        colour = rng.uniform(0, 1, 3).astype(np.float32)
        cy, cx, r = rng.uniform(0, 1), rng.uniform(0, 1), rng.uniform(0.05, 0.35)
        if rng.random() < 0.5:
            mask = (yy - cy) ** 2 + (xx - cx) ** 2 < r**2
        else:
            mask = (np.abs(yy - cy) < r / 2) & (np.abs(xx - cx) < r)
        image[mask] = colour
    frequency = rng.uniform(4, 20)
    image += 0.05 * np.sin(2 * np.pi * frequency * (xx + yy))[..., None]
    clean: np.ndarray = np.clip(image, 0, 1).astype(np.float32)
    return clean


def add_noise(rng: np.random.Generator, image: np.ndarray, sigma: float) -> np.ndarray:
    """Gaussian noise of standard deviation `sigma` (on the 0..1 scale), clipped back to [0, 1]."""
    noisy: np.ndarray = np.clip(image + rng.normal(0, sigma, image.shape).astype(np.float32), 0, 1)
    return noisy


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    """Peak signal-to-noise ratio in dB of two images in [0, 1]."""
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(1.0 / mse)
