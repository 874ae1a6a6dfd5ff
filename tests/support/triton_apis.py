"""User APIs (imgserve.ImageAPI) shaped like the models Triton's example clients call (triton-inference-server/client,
src/python/examples): an image classifier in either layout (image_client.py), the add/sub model `simple`
(simple_*_infer_client.py) and its text twin `simple_string` (simple_*_string_infer_client.py). Served with
`running_server(api="triton_apis:<Class>")`."""

from __future__ import annotations

from typing import Any

import numpy as np

from imgserve import ImageAPI, Request, TensorSpec

SIDE = 224
COLOURS = ("red", "green", "blue")


class NchwClassifier(ImageAPI):
    """The layout of every torchvision model: FP32 [3, 224, 224] in, declared NCHW; each colour's share of the image
    out (FP32 [3]), labelled, so the classification extension names the dominant colour."""

    name = "colours"
    inputs = (TensorSpec("data", "FP32", (3, SIDE, SIDE), format="NCHW"),)
    outputs = (TensorSpec("probabilities", "FP32", (len(COLOURS),)),)
    labels = COLOURS
    channels_axis = 0  # of one item

    def decode_request(self, request: Request) -> np.ndarray:
        pixels = request.inputs["data"].astype(np.float32)
        return pixels.sum(axis=tuple(axis for axis in range(3) if axis != self.channels_axis))

    def predict(self, batch: np.ndarray) -> np.ndarray:
        return batch / np.maximum(batch.sum(axis=1, keepdims=True), 1e-9)

    def example_request(self) -> Request:
        shape = [SIDE, SIDE, SIDE]
        shape[self.channels_axis] = len(COLOURS)
        return Request(protocol="v2", inputs={"data": np.zeros(shape, dtype=np.float32)})


class NhwcClassifier(NchwClassifier):
    """The same classifier on UINT8 [224, 224, 3], saying nothing of its layout (NHWC is guessed from the shape)."""

    inputs = (TensorSpec("data", "UINT8", (SIDE, SIDE, len(COLOURS))),)
    channels_axis = 2


class Simple(ImageAPI):
    """Triton's `simple`: INT32 INPUT0 and INPUT1 [16] in; their sum OUTPUT0 and difference OUTPUT1 out."""

    name = "simple"
    inputs = (TensorSpec("INPUT0", "INT32", (16,)), TensorSpec("INPUT1", "INT32", (16,)))
    outputs = (TensorSpec("OUTPUT0", "INT32", (16,)), TensorSpec("OUTPUT1", "INT32", (16,)))

    def decode_request(self, request: Request) -> np.ndarray:
        return np.stack([self.numbers(request.inputs["INPUT0"]), self.numbers(request.inputs["INPUT1"])])

    def numbers(self, row: np.ndarray) -> np.ndarray:
        return row.astype(np.int32)

    def predict(self, batch: np.ndarray) -> dict[str, np.ndarray]:
        return {"OUTPUT0": batch[:, 0] + batch[:, 1], "OUTPUT1": batch[:, 0] - batch[:, 1]}

    def example_request(self) -> Request:
        row = np.arange(16, dtype=np.int32)
        return Request(protocol="v2", inputs={"INPUT0": row, "INPUT1": row})


class SimpleString(Simple):
    """Triton's `simple_string`: INPUT0 and INPUT1 BYTES [16], each element an integer as text; the sum and the
    difference as text out."""

    name = "simple_string"
    inputs = (TensorSpec("INPUT0", "BYTES", (16,)), TensorSpec("INPUT1", "BYTES", (16,)))
    outputs = (TensorSpec("OUTPUT0", "BYTES", (16,)), TensorSpec("OUTPUT1", "BYTES", (16,)))

    def numbers(self, row: np.ndarray) -> np.ndarray:
        return np.array([int(element) for element in row], dtype=np.int32)

    def encode_response(self, output: dict[str, np.ndarray]) -> dict[str, Any]:
        return {name: [str(number).encode() for number in values] for name, values in output.items()}

    def example_request(self) -> Request:
        row = np.array([str(number).encode() for number in range(16)], dtype=object)
        return Request(protocol="v2", inputs={"INPUT0": row, "INPUT1": row})
