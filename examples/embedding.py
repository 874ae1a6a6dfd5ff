"""An image encoder that answers embeddings: a vision transformer, its image preprocessing and its answer.

The model is a real `transformers` architecture (ViT) built from a config, with random weights drawn from a fixed
seed, so it starts without downloading anything and answers the same vector for the same image on every worker.
Swap in `ViTModel.from_pretrained(...)`, `CLIPVisionModel` or `Dinov2Model` for a trained encoder.

    imgserve serve --api examples.embedding:EmbeddingAPI
    curl -F file=@photo.jpg localhost:8000/predict          # {"embedding": [0.01, -0.12, ...]}

Over the Open Inference Protocol it is the model `embedding`: one encoded image in (BYTES `image`), one FP32
tensor `embedding` [N, 64] out.
"""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image
from transformers import ViTConfig, ViTModel

from imgserve import ImageAPI, Request, TensorSpec

SEED = 0
CONFIG = ViTConfig(
    image_size=64,
    patch_size=16,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=128,
)
MEAN = np.array([0.5, 0.5, 0.5], dtype=np.float32)  # ViT's normalization
STD = np.array([0.5, 0.5, 0.5], dtype=np.float32)


class EmbeddingAPI(ImageAPI):
    """One L2-normalized vector per image: the ViT's [CLS] token."""

    name = "embedding"
    outputs = (TensorSpec("embedding", "FP32", (CONFIG.hidden_size,)),)

    def setup(self, device: str) -> None:
        """In each worker: the encoder, its weights drawn from SEED (the same on every worker)."""
        torch.manual_seed(SEED)
        self.model = ViTModel(CONFIG, add_pooling_layer=False).eval().to(device)
        self.device = device

    def decode_request(self, request: Request) -> np.ndarray:
        """In a front end: the image resized to the model's input and normalized, float32 3 x H x W."""
        size = CONFIG.image_size
        image = request.open_image().resize((size, size), Image.Resampling.BILINEAR)
        pixels = np.asarray(image, dtype=np.float32) / 255.0
        return ((pixels - MEAN) / STD).transpose(2, 0, 1)

    @torch.inference_mode()
    def predict(self, batch: np.ndarray) -> np.ndarray:
        """In the worker, on the stacked batch N x 3 x H x W: N x D embeddings."""
        pixels = torch.from_numpy(batch).to(self.device)
        cls_token = self.model(pixel_values=pixels).last_hidden_state[:, 0]
        return torch.nn.functional.normalize(cls_token, dim=-1).cpu().numpy()

    def encode_response(self, output: np.ndarray) -> dict[str, np.ndarray]:
        """In a front end: {"embedding": [...]} over /predict (arrays become JSON lists), the declared output's
        value over v2."""
        return {"embedding": output}
