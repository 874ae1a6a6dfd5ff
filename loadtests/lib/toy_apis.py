"""User APIs for the benchmarks: the near-free model written as a user's own ImageAPI, doing what the built-in API
does around `x.clamp(0, 1)` (decode to uint8, run on the batch, answer JPEG), so serving it costs what serving the
same model as a file does."""

from __future__ import annotations

import numpy as np
import torch

from imgserve import Encoded, ImageAPI, Request, codec

JPEG_QUALITY = 90  # the built-in API's default


class NearFree(ImageAPI):
    """Upload -> uint8 HxWx3 (the default decode) -> float in [0, 1], clamped -> uint8 -> JPEG."""

    def predict(self, batch: np.ndarray) -> np.ndarray:
        values = torch.from_numpy(batch).float().div_(255).clamp_(0, 1)
        return values.mul_(255).round_().to(torch.uint8).numpy()

    def encode_response(self, output: np.ndarray, request: Request) -> Encoded:
        return Encoded(codec.encode_image(output, "jpeg", JPEG_QUALITY), codec.OUTPUT_TYPES["jpeg"])
