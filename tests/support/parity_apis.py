"""Plain LitServe APIs that the parity test serves with LitServe and with imgserve side by side (each is importable
by both servers as `parity_apis:<name>`). The module has no `from __future__ import annotations`: both servers read
the class that `decode_request` annotates its request with, as LitServe's users write it."""

import litserve as ls
import numpy as np
from fastapi import HTTPException
from litserve.test_examples.simple_example import SimpleBatchedAPI, SimpleLitAPI
from pydantic import BaseModel, Field


class Item(BaseModel):
    """The body ValidatedLitAPI's decode_request is annotated with: FastAPI validates it (422 when it is not)."""

    input: float = Field(ge=-1000)


class ValidatedLitAPI(ls.LitAPI):
    """A pydantic-typed request, and an HTTPException raised in decode_request (input > 100) and in predict
    (negative input)."""

    def decode_request(self, request: Item) -> float:
        if request.input > 100:
            raise HTTPException(status_code=413, detail="input is over 100")
        return request.input

    def predict(self, x: float) -> float:
        if x < 0:
            raise HTTPException(status_code=400, detail="input must not be negative")
        return x * 2

    def encode_response(self, output: float) -> dict:
        return {"output": output}


class Empty(BaseModel):
    """A body with no fields."""


class DeviceLitAPI(ls.LitAPI):
    """Answers the device LitServe gives the API (`self.device`, set once setup has run)."""

    def decode_request(self, request: Empty):
        return request

    def predict(self, x):
        return {"device": str(self.device)}

    def encode_response(self, output):
        return output


batched = SimpleBatchedAPI(max_batch_size=4, batch_timeout=0.05)


class StackedEmbedding(ls.LitAPI):
    """An embedding whose `batch` stacks the inputs and whose `predict` takes only the stacked batch (a 2-d array):
    served with max_batch_size > 1 it must be called as LitServe calls it, batch -> predict -> unbatch."""

    def setup(self, device):
        self.weights = np.arange(1.0, 5.0)

    def decode_request(self, request):
        return np.asarray(request["input"], dtype=float)

    def batch(self, inputs):
        return np.stack(inputs)

    def predict(self, x):
        if x.ndim != 2:
            raise ValueError(f"predict takes the stacked batch, got an array of {x.ndim} dimension(s)")
        return x @ self.weights

    def unbatch(self, output):
        return list(output)

    def encode_response(self, output):
        return {"embedding": float(output)}


batched_embedding = StackedEmbedding(max_batch_size=4, batch_timeout=0.01)


# Two LitAPIs of one server, each at its own path (LitServer([squares, doubles]), LitServe's several APIs).
squares = SimpleLitAPI(api_path="/squares")
doubles = ValidatedLitAPI(api_path="/doubles")
