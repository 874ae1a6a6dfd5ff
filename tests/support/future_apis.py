"""A plain LitServe API in a module with `from __future__ import annotations`: its hooks' annotations are strings,
which imgserve resolves to register the route with the pydantic class `decode_request` names."""

from __future__ import annotations

import litserve as ls
from pydantic import BaseModel, Field


class Item(BaseModel):
    input: float = Field(ge=-1000)


class FutureAnnotatedLitAPI(ls.LitAPI):
    def decode_request(self, request: Item) -> float:
        return request.input

    def predict(self, x: float) -> float:
        return x * 2

    def encode_response(self, output: float) -> dict[str, float]:
        return {"output": output}
