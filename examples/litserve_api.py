"""Plain LitServe APIs, written as LitServe's documentation writes them, which imgserve serves unchanged.

    imgserve serve --api examples.litserve_api:InferencePipeline
    curl -H 'Content-Type: application/json' -d '{"input": 4.0}' localhost:8000/predict     # {"output": 80.0}

    imgserve serve --api examples.litserve_api:GrayscaleLitAPI
    curl -F file=@photo.jpg localhost:8000/predict -o gray.png

Both run under LitServe too: `ls.LitServer(InferencePipeline()).run(port=8000)`. Under imgserve every hook runs in the
inference worker, as under LitServe, with imgserve's admission, deadlines, drain and metrics around them.
"""

from __future__ import annotations

import io

import litserve as ls
import numpy as np
import torch
from fastapi import HTTPException
from PIL import Image
from starlette.responses import Response

LUMA = torch.tensor([0.299, 0.587, 0.114])  # ITU-R BT.601 weights of R, G, B


class InferencePipeline(ls.LitAPI):
    """LitServe's first example: a JSON body {"input": x} answered {"output": x**2 + x**3}."""

    def setup(self, device):
        self.model1 = lambda x: x**2
        self.model2 = lambda x: x**3

    def decode_request(self, request):
        return request["input"]

    def predict(self, x):
        return self.model1(x) + self.model2(x)

    def encode_response(self, output):
        return {"output": output}


class GrayscaleLitAPI(ls.LitAPI):
    """A multipart upload (field `file`) answered with the image in grayscale, as PNG."""

    def setup(self, device):
        self.device = device

    def decode_request(self, request):
        data = request["file"].file.read()
        try:
            image = Image.open(io.BytesIO(data)).convert("RGB")
        except Exception:
            raise HTTPException(status_code=400, detail="file is not an image") from None
        return torch.from_numpy(np.asarray(image).copy())

    def predict(self, pixels):
        gray = pixels.to(self.device).float() @ LUMA.to(self.device)
        return gray.round().clamp(0, 255).to(torch.uint8).cpu()

    def encode_response(self, gray):
        buffer = io.BytesIO()
        Image.fromarray(gray.numpy(), mode="L").save(buffer, format="PNG")
        return Response(content=buffer.getvalue(), media_type="image/png")
