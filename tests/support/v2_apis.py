"""Small user APIs (imgserve.ImageAPI) that declare their own Open Inference Protocol tensors, for the v2 tests:
served with `running_server(tmp_path, api="v2_apis:<Class>")`."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from imgserve import ImageAPI, Request, TensorSpec


class MeanColour(ImageAPI):
    """An encoded image in; its mean colour (FP32 [3], 0-1) and its size (INT32 [2], height and width) out."""

    name = "mean_colour"
    inputs = (TensorSpec("image", "BYTES", (1,)),)
    outputs = (TensorSpec("mean", "FP32", (3,)), TensorSpec("size", "INT32", (2,)))

    def decode_request(self, request: Request) -> np.ndarray:
        return request.image()

    def predict(self, batch: np.ndarray) -> dict[str, np.ndarray]:
        means = batch.reshape(len(batch), -1, 3).mean(axis=1, dtype=np.float64) / 255
        sizes = np.array([batch.shape[1:3]] * len(batch), dtype=np.int32)
        return {"mean": means.astype(np.float32), "size": sizes}

    def encode_response(self, output: dict[str, np.ndarray]) -> dict[str, Any]:
        return output


class SlowMeanColour(MeanColour):
    """MeanColour whose batches take V2_PREDICT_DELAY_S each, and whose setup takes as many seconds as the file
    V2_SETUP_DELAY_FILE says once it exists (a worker started after the test wrote it loads that long): loading and
    draining last long enough to be seen."""

    def setup(self, device: str) -> None:
        delay = Path(os.environ.get("V2_SETUP_DELAY_FILE", "/nonexistent"))
        if delay.is_file():
            time.sleep(float(delay.read_text()))

    def predict(self, batch: np.ndarray) -> dict[str, np.ndarray]:
        time.sleep(float(os.environ.get("V2_PREDICT_DELAY_S", "0")))
        return super().predict(batch)
