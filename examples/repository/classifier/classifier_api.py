"""The repository's `classifier`: a ResNet built from a `transformers` config, with random weights drawn from a fixed
seed, so it starts without downloading anything and every worker answers the same scores for the same image. Swap in
`ResNetForImageClassification.from_pretrained("microsoft/resnet-50")` (and its labels) for a trained one.

    imgserve serve --model-repository examples/repository
    curl -F file=@photo.jpg 'localhost:8000/classifier/predict?top_k=2'
    # {"top_k": [{"index": 1, "label": "dog", "score": 0.2351}, {"index": 0, "label": "cat", "score": 0.2249}]}

Over the Open Inference Protocol it is the model `classifier`: one encoded image in (BYTES `image`), the FP32 tensor
`scores` [N, 5] out (probabilities), with Triton's classification extension over its labels.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from PIL import Image
from transformers import ResNetConfig, ResNetForImageClassification

from imgserve import ApiError, ImageAPI, Request, TensorSpec

SEED = 0
LABELS = ("cat", "dog", "bird", "car", "tree")
SIZE = 64  # the model's input: SIZE x SIZE
CONFIG = ResNetConfig(
    num_channels=3,
    embedding_size=16,
    hidden_sizes=[16, 32, 64],
    depths=[1, 1, 1],
    layer_type="basic",
    num_labels=len(LABELS),
    id2label=dict(enumerate(LABELS)),
    label2id={label: index for index, label in enumerate(LABELS)},
)
MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32)  # ImageNet's normalization
STD = np.array([0.229, 0.224, 0.225], dtype=np.float32)


class ClassifierAPI(ImageAPI):
    """Class probabilities for each upload: the top k with their labels over HTTP, every score over v2."""

    name = "classifier"
    outputs = (TensorSpec("scores", "FP32", (len(LABELS),)),)
    labels = LABELS

    def setup(self, device: str) -> None:
        """In each worker: the ResNet, its weights drawn from SEED (the same on every worker)."""
        torch.manual_seed(SEED)
        self.model = ResNetForImageClassification(CONFIG).eval().to(device)
        self.device = device

    def decode_request(self, request: Request) -> np.ndarray:
        """In a front end: the image resized to SIZE x SIZE and normalized, float32 3 x H x W; `top_k` checked."""
        top_k = request.query.get("top_k", "3")
        if not top_k.isdigit() or not 1 <= int(top_k) <= len(LABELS):
            raise ApiError(422, "invalid_top_k", f"top_k is a whole number from 1 to {len(LABELS)} (got {top_k!r})")
        request.context["top_k"] = int(top_k)
        image = request.open_image().resize((SIZE, SIZE), Image.Resampling.BILINEAR)
        pixels = np.asarray(image, dtype=np.float32) / 255.0
        return ((pixels - MEAN) / STD).transpose(2, 0, 1)

    @torch.inference_mode()
    def predict(self, batch: np.ndarray) -> np.ndarray:
        """In the worker, on the stacked batch N x 3 x H x W: N x 5 probabilities."""
        logits = self.model(pixel_values=torch.from_numpy(batch).to(self.device)).logits
        return logits.softmax(dim=-1).cpu().numpy()

    def encode_response(self, output: np.ndarray, request: Request) -> dict[str, Any]:
        """In a front end: the best `top_k` (default 3) classes over /classifier/predict, the scores over v2."""
        if request.protocol == "v2":
            return {"scores": output}
        best = np.argsort(-output)[: request.context.get("top_k", 3)]
        return {"top_k": [{"index": int(i), "label": LABELS[i], "score": round(float(output[i]), 4)} for i in best]}
