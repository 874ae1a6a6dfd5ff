"""APIs whose OpenAPI description tests/integration/test_openapi.py reads, each served by `--api openapi_apis:<Class>`:
an ImageAPI that declares the fields it reads beside the image (`request_model`), one whose declaration is no
pydantic model, and a plain LitAPI typed as LitServe's docs type one (its annotations real types, not strings: both
LitServe and imgserve read the types of `decode_request` and `encode_response` from their signatures)."""

from typing import Any

import litserve as ls
import torch
from pydantic import BaseModel, Field, ValidationError

from imgserve import ApiError, ImageAPI, Request


class BrightnessFields(BaseModel):
    threshold: float = Field(0.5, ge=0, le=1, description="How bright a pixel must be to count (0-1)")
    channel: int | None = Field(None, ge=0, le=2, description="Count one channel (0-2) rather than their mean")


class Brightness(ImageAPI):
    """The share of an image's pixels brighter than a threshold."""

    request_model = BrightnessFields

    def decode_request(self, request: Request) -> dict[str, Any]:
        try:
            fields = BrightnessFields.model_validate({**request.query, **request.form})
        except ValidationError as exc:
            raise ApiError(422, "bad_fields", str(exc.errors()[0]["msg"])) from None
        return {"pixels": request.image(), "threshold": fields.threshold, "channel": fields.channel}

    def predict(self, batch: dict[str, Any]) -> list[float]:
        answers = []
        for pixels, threshold, channel in zip(batch["pixels"], batch["threshold"], batch["channel"], strict=True):
            values = torch.from_numpy(pixels).float() / 255
            values = values.mean(dim=-1) if channel is None else values[..., channel]
            answers.append(float((values > threshold).float().mean()))
        return answers

    def encode_response(self, output: float) -> dict[str, float]:
        return {"bright": output}


class NotAModel(Brightness):
    """Declares its fields with a dict, which imgserve cannot describe."""

    request_model = {"threshold": float}  # type: ignore[assignment]


class Question(BaseModel):
    text: str = Field(max_length=1000)


class Answer(BaseModel):
    length: int


class Lengths(ls.LitAPI):
    """Counts a text's characters: a plain LitAPI, its request and answer typed with pydantic models."""

    def setup(self, device: str) -> None:
        self.count = len

    def decode_request(self, request: Question) -> str:
        return request.text

    def predict(self, text: str) -> int:
        return self.count(text)

    def encode_response(self, output: int) -> Answer:
        return Answer(length=output)
