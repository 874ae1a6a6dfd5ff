"""Reproducible training of the built-in denoiser on synthetic images: `imgserve train [--steps N] [--out PATH]`."""

from __future__ import annotations

import argparse

import numpy as np
import torch
from safetensors.torch import save_file

from imgserve.models.denoiser import WEIGHTS, Denoiser
from imgserve.models.synthetic import add_noise, clean_image, psnr


def _batch(rng: np.random.Generator, size: int, patch: int) -> tuple[torch.Tensor, torch.Tensor]:
    clean = np.stack([clean_image(rng, patch, patch) for _ in range(size)])
    noisy = np.stack([add_noise(rng, c, rng.uniform(0.02, 0.15)) for c in clean])
    return _to_tensor(noisy), _to_tensor(clean)


def _to_tensor(images: np.ndarray) -> torch.Tensor:
    """NHWC images as a contiguous NCHW tensor."""
    return torch.from_numpy(images).permute(0, 3, 1, 2).contiguous()


def train(steps: int, seed: int = 0, batch: int = 16, patch: int = 48) -> Denoiser:
    """Train from scratch with Adam on fresh synthetic patches; same seed, same weights."""
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    model = Denoiser()
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-3)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, steps)
    for step in range(steps):
        noisy, clean = _batch(rng, batch, patch)
        loss = torch.nn.functional.mse_loss(model(noisy), clean)
        optimizer.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]  # torch leaves Tensor.backward unannotated
        optimizer.step()
        schedule.step()
        if step % 100 == 0:
            print(f"step {step:5d}  loss {loss.item():.5f}", flush=True)
    return model.eval()


def evaluate(model: Denoiser, sigma: float = 0.1, seed: int = 1234, count: int = 8) -> tuple[float, float]:
    """Mean PSNR (dB) of the noisy input and of the model's output against the clean image."""
    rng = np.random.default_rng(seed)
    before, after = [], []
    for _ in range(count):
        clean = clean_image(rng, 96, 128)
        noisy = add_noise(rng, clean, sigma)
        with torch.inference_mode():
            out = model(torch.from_numpy(noisy).permute(2, 0, 1)[None])[0].permute(1, 2, 0).numpy()
        before.append(psnr(noisy, clean))
        after.append(psnr(out, clean))
    return float(np.mean(before)), float(np.mean(after))


def run(args: argparse.Namespace) -> int:
    """`imgserve train`: train, report PSNR before/after on held-out images, and write safetensors weights (to the
    built-in model's own file unless --out names another)."""
    model = train(args.steps, args.seed)
    noisy_db, denoised_db = evaluate(model)
    print(f"PSNR noisy {noisy_db:.2f} dB -> denoised {denoised_db:.2f} dB")
    out = args.out or str(WEIGHTS)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, out)
    print(f"wrote {out}")
    return 0
