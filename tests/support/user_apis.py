"""Users' own APIs for the tests: each a small `imgserve.ImageAPI` as a user writes one, with the one behaviour a test
of imgserve's guarantees needs. None of them is imgserve's built-in API; each is served by `--api user_apis:<Class>`.

The tests steer them through environment variables, which every process of the server inherits:
- USER_API_DELAY_S: the seconds each `predict` of `Slow` sleeps;
- USER_API_CALLS: a file that each `predict` appends the tags of its batch to, one a line (what reached the model);
- USER_API_BATCHES: a file that each `predict` appends one line to: the tags of its batch (how batches were made);
- USER_API_EXAMPLE_SIDE: the side of `Hungry`'s example image (what the memory budget is measured on);
- USER_API_MODEL: the weights file `Loaded` serves through imgserve's loader.

A request names its tag in the query (`?tag=...`): the marked inputs that `Faulty` fails on, and what the counting
file records.
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np
import torch
from fastapi import HTTPException as LitServeHTTPException  # what LitServe's own examples raise
from starlette.exceptions import HTTPException as StarletteHTTPException
from torch import nn

from imgserve import ApiError, ImageAPI, Request, TensorSpec

HUNGRY_BYTES_PER_ELEMENT = 128  # what Hungry's predict holds at its peak for each element of its input


def _record(tags: list[str]) -> None:
    """Append the batch's tags to USER_API_CALLS, and the batch as one line to USER_API_BATCHES (one write each:
    whole lines, whichever worker writes)."""
    path, batches = os.environ.get("USER_API_CALLS"), os.environ.get("USER_API_BATCHES")
    if path and tags:
        with open(path, "a") as calls:
            calls.write("".join(f"{tag}\n" for tag in tags))
    if batches and tags:
        with open(batches, "a") as made:
            made.write(" ".join(tags) + "\n")


def recorded(path: str | os.PathLike) -> list[str]:
    """The tags that reached `predict`, in order (the test's side of USER_API_CALLS)."""
    try:
        with open(path) as calls:
            return calls.read().splitlines()
    except FileNotFoundError:
        return []


class Tagged(ImageAPI):
    """Near free: the mean of the image's pixels, with the request's `tag` carried through to the answer."""

    def decode_request(self, request: Request) -> dict[str, Any]:
        return {"pixels": request.image(), "tag": request.query.get("tag", "")}

    def predict(self, batch: dict[str, Any]) -> dict[str, Any]:
        _record([tag for tag in batch["tag"] if tag])
        pixels = torch.from_numpy(batch["pixels"]).float()
        return {"mean": pixels.mean(dim=(1, 2, 3)), "tag": batch["tag"]}

    def encode_response(self, output: dict[str, Any]) -> dict[str, Any]:
        return {"mean": float(output["mean"]), "tag": output["tag"]}


class Slow(Tagged):
    """Tagged, with each batch taking USER_API_DELAY_S seconds (default 0.5): queues, deadlines and drains show."""

    share = 1.0  # of USER_API_DELAY_S that each batch takes

    def predict(self, batch: dict[str, Any]) -> dict[str, Any]:
        output = super().predict(batch)  # records first: what reached the model, however long it takes
        time.sleep(self.share * float(os.environ.get("USER_API_DELAY_S", "0.5")))
        return output


class HalfSlow(Slow):
    """Slow, with each batch taking half of USER_API_DELAY_S: a model whose batches are shorter than another's."""

    share = 0.5


class Faulty(Tagged):
    """Tagged, failing on the inputs it is asked to: each tag names a failure of one hook.

    decode_request: `teapot` raises ApiError(418), `litserve-http` LitServe's HTTPException(403), `starlette-http`
    Starlette's HTTPException(409), `decode-error` a ValueError; predict: `predict-error` raises a ValueError for
    the whole batch, `short` returns one output too few; encode_response: `encode-error` raises a KeyError.
    """

    def decode_request(self, request: Request) -> dict[str, Any]:
        tag = request.query.get("tag", "")
        if tag == "teapot":
            raise ApiError(418, "teapot", "this API only brews tea")
        if tag == "litserve-http":
            raise LitServeHTTPException(403, "not for this API")
        if tag == "starlette-http":
            raise StarletteHTTPException(409, "a conflict in the API")
        if tag == "decode-error":
            raise ValueError("cannot read this one")
        return super().decode_request(request)

    def predict(self, batch: dict[str, Any]) -> dict[str, Any]:
        output = super().predict(batch)
        if "predict-error" in batch["tag"]:
            raise ValueError("the model cannot compute a predict-error")
        if "short" in batch["tag"]:
            return {"mean": output["mean"][:-1], "tag": output["tag"][:-1]}
        return output

    def encode_response(self, output: dict[str, Any]) -> dict[str, Any]:
        if output["tag"] == "encode-error":
            raise KeyError("no such field in the answer")
        return super().encode_response(output)


class OutOfMemoryOnBatches(Tagged):
    """SIMULATED CUDA out-of-memory on the CPU: predict raises torch.OutOfMemoryError for any batch of more than one
    item, and computes a batch of one."""

    def predict(self, batch: dict[str, Any]) -> dict[str, Any]:
        if len(batch["tag"]) > 1:
            raise torch.OutOfMemoryError("SIMULATED: CUDA out of memory")
        return super().predict(batch)


class Hungry(ImageAPI):
    """A predict that holds HUNGRY_BYTES_PER_ELEMENT bytes for each element of its input at its peak (touched, so the
    memory is really used), and an example request of USER_API_EXAMPLE_SIDE (default 256) pixels a side."""

    def example_request(self) -> Request:
        side = int(os.environ.get("USER_API_EXAMPLE_SIDE", "256"))
        return Request.for_image(np.full((side, side, 3), 128, dtype=np.uint8))

    def predict(self, batch: np.ndarray) -> np.ndarray:
        scratch = np.ones(batch.size * HUNGRY_BYTES_PER_ELEMENT // 8, dtype=np.float64)
        return batch.reshape(len(batch), -1).mean(axis=1) * scratch[-1]

    def encode_response(self, output: np.ndarray) -> dict[str, float]:
        return {"mean": float(output)}


class AutoHungry(Hungry):
    """Hungry asking for the largest batch its measured memory allows, in its constructor."""

    def __init__(self) -> None:
        super().__init__(max_batch_size="auto")


class Declared(ImageAPI):
    """Declares its Open Inference Protocol tensors: pixels (UINT8 HxWx3) and an optional gain in; each item's mean
    colour times the gain (FP32 [3]) and its height and width (INT32 [2]) out."""

    name = "declared"
    inputs = (TensorSpec("pixels", "UINT8", (-1, -1, 3)), TensorSpec("gain", "FP32", (1,)))
    outputs = (TensorSpec("mean", "FP32", (3,)), TensorSpec("size", "INT32", (2,)))

    def decode_request(self, request: Request) -> dict[str, Any]:
        gain = float(request.inputs["gain"][0]) if "gain" in request.inputs else 1.0
        return {"pixels": request.image(), "gain": gain}

    def predict(self, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        pixels = torch.from_numpy(batch["pixels"]).float()
        gain = torch.tensor(batch["gain"], dtype=torch.float32)[:, None]
        size = torch.tensor([pixels.shape[1:3]] * len(pixels), dtype=torch.int32)
        return {"mean": pixels.mean(dim=(1, 2)) * gain, "size": size}


class TinyNet(nn.Module):
    """The model `Loaded` serves: a 3 -> 8 channel convolution, averaged over the image (8 features)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x).mean(dim=(2, 3))


class Loaded(ImageAPI):
    """Builds its module through imgserve's loader (`load_model`), from the weights file USER_API_MODEL and the
    factory TinyNet, so every worker of the device shares one copy of the weights."""

    model = os.environ.get("USER_API_MODEL")
    model_factory = "user_apis:TinyNet"

    def setup(self, device: str) -> None:
        self.net = self.load_model(device)

    def predict(self, batch: np.ndarray) -> torch.Tensor:
        x = torch.from_numpy(batch).permute(0, 3, 1, 2).float() / 255
        with torch.inference_mode():
            return self.net(x)

    def encode_response(self, output: np.ndarray) -> dict[str, list[float]]:
        return {"features": output.tolist()}


class FailsToConstruct(ImageAPI):
    """Its constructor raises: `--api` cannot build it."""

    def __init__(self) -> None:
        raise RuntimeError("no configuration found for this API")


class FailsInSetup(ImageAPI):
    """Its setup raises in every worker: the server cannot start."""

    def setup(self, device: str) -> None:
        raise RuntimeError("the checkpoint for this API is missing")


class DecodedInWorker(ImageAPI):
    """Leaves each upload encoded (`Request.encoded_image`): its `batch` gets the images decoded in the worker, and
    answers what it was given for each: the type, the shape and the mean of the pixels."""

    def decode_request(self, request: Request) -> Any:
        return request.encoded_image() or request.image()

    def batch(self, inputs: list[Any]) -> list[Any]:
        return inputs

    def predict(self, batch: list[Any]) -> list[dict[str, Any]]:
        return [{"type": type(x).__name__, "shape": list(x.shape), "mean": float(x.float().mean())} for x in batch]

    def unbatch(self, output: list[Any]) -> list[Any]:
        return output
