"""The per-image work every contender does, from the same code: imgserve's codec and the built-in model.

The in-process limit runs the built-in API's own hooks in this process (`built_in`: decode with its preprocessing,
batch, predict, encode), and the FastAPI baseline and the plain LitServe API decode and encode through the same
codec and call the same model, so the benchmark compares serving designs, not codecs or models.
"""

from __future__ import annotations

import numpy as np
import torch

from imgserve import codec
from imgserve.api import Request
from imgserve.config import BUILTIN_MODEL, Settings
from imgserve.models.builtin import LocalKinds, ModelAPI
from imgserve.models.loader import load_model
from imgserve.testing import InProcess

DEFAULTS = Settings()


def best_device() -> str:
    """cuda when torch sees a GPU, else cpu (what imgserve's device=auto picks)."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def load_denoiser(device: str) -> torch.nn.Module:
    """The built-in denoiser, in eval mode on `device`."""
    return load_model(BUILTIN_MODEL).to(device).eval()


def decode(data: bytes) -> torch.Tensor:
    """Upload bytes -> 3xHxW float tensor in [0, 1] (the usual hand-written endpoint), with imgserve's decoder."""
    pixels = codec.decode_image(data, DEFAULTS.max_image_pixels)
    return torch.from_numpy(pixels.copy()).permute(2, 0, 1).float().div_(255.0)


def forward(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """One model call on a NxCxHxW batch under inference mode; the result comes back on the CPU."""
    with torch.inference_mode():
        return model(batch.to(next(model.parameters()).device)).cpu()


def encode(output: torch.Tensor | np.ndarray) -> bytes:
    """JPEG bytes at imgserve's default quality from a 3xHxW float output in [0, 1] or imgserve's HxWx3 uint8."""
    if isinstance(output, torch.Tensor):
        output = output.clamp(0, 1).mul(255).round().to(torch.uint8).permute(1, 2, 0).numpy()
    return codec.encode_image(output, "jpeg", DEFAULTS.jpeg_quality)


def built_in(device: str, channels_last: bool) -> InProcess:
    """imgserve's built-in API with its default settings for `device` and the given memory layout, set up here."""
    settings = DEFAULTS.model_copy(update={"channels_last": channels_last})
    api = ModelAPI(settings, LocalKinds(), pad=device == "cuda")
    model = load_denoiser(device)
    api.model_loader = lambda _: model
    return InProcess(api, device).setup()


def upload(data: bytes) -> Request:
    """An upload as /predict reads it: the raw JPEG body."""
    return Request(body=data, content_type="image/jpeg", max_image_pixels=DEFAULTS.max_image_pixels)
