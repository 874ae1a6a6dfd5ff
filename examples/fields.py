"""An image plus request fields, validated with a pydantic model: a `threshold` in [0, 1] and an optional crop `box`.

The fields come as multipart form fields beside the `file`, or as query parameters (a form field wins over a query
parameter of the same name). A field that is missing its rule, unknown, or a box outside the image is a 422 with a
JSON error naming it, before the request reaches a worker. The answer is computed in torch: the share of the
(cropped) image brighter than the threshold, and its mean color.

    imgserve serve --api examples.fields:FieldsAPI
    curl -F file=@photo.jpg -F threshold=0.7 -F box=10,20,200,120 localhost:8000/predict
    curl --data-binary @photo.jpg -H 'Content-Type: image/jpeg' 'localhost:8000/predict?threshold=0.7'
    # {"threshold": 0.7, "box": [10, 20, 200, 120], "bright_fraction": 0.31, "mean_rgb": [0.52, 0.47, 0.40]}

It needs nothing beyond imgserve's own dependencies (torch, pydantic), so imgserve's image runs it as it is.
"""

from __future__ import annotations

from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from imgserve import ApiError, ImageAPI, Request

LUMA = (0.299, 0.587, 0.114)  # ITU-R BT.601 weights of R, G, B


class Fields(BaseModel):
    """The request's fields: the brightness threshold and an optional crop box (left, top, right, bottom)."""

    model_config = ConfigDict(extra="forbid")

    threshold: float = Field(0.5, ge=0.0, le=1.0)
    box: tuple[int, int, int, int] | None = None

    @field_validator("box", mode="before")
    @classmethod
    def comma_separated(cls, value: Any) -> Any:
        """A box given as text: "left,top,right,bottom" (or as JSON, "[left, top, right, bottom]")."""
        if isinstance(value, str):
            return value.strip().strip("[]").split(",")
        return value

    @field_validator("box")
    @classmethod
    def not_empty(cls, box: tuple[int, int, int, int] | None) -> tuple[int, int, int, int] | None:
        if box is not None and not (0 <= box[0] < box[2] and 0 <= box[1] < box[3]):
            raise ValueError("a box is left,top,right,bottom with 0 <= left < right and 0 <= top < bottom")
        return box


def read_fields(request: Request) -> Fields:
    """The fields of the query and the form (the form's win), validated; 422 naming each field that is wrong."""
    try:
        return Fields.model_validate({**request.query, **request.form})
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'fields'}: {e['msg']}" for e in exc.errors())
        raise ApiError(422, "invalid_fields", problems) from None


class FieldsAPI(ImageAPI):
    """The bright share and mean color of an image, or of a box of it, above a threshold given with the request."""

    name = "fields"
    request_model = Fields  # its fields show in /docs and /openapi.json

    def decode_request(self, request: Request) -> dict[str, Any]:
        """The crop's pixels (uint8 H x W x 3) and the threshold; the fields are checked first, then the box
        against the image."""
        fields = read_fields(request)
        pixels = request.image()
        height, width = pixels.shape[:2]
        box = fields.box or (0, 0, width, height)
        if box[2] > width or box[3] > height:
            raise ApiError(422, "invalid_fields", f"box: {list(box)} is outside the {width}x{height} image")
        request.context.update(threshold=fields.threshold, box=list(box))
        return {"pixels": pixels[box[1] : box[3], box[0] : box[2]], "threshold": fields.threshold}

    @torch.inference_mode()
    def predict(self, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        """In the worker, on crops of one shape (imgserve groups them so): the stacked pixels N x H x W x 3 and the
        N thresholds -> the bright fraction (N) and the mean color (N x 3), each in [0, 1]."""
        pixels = torch.from_numpy(batch["pixels"]).float() / 255
        threshold = torch.tensor(batch["threshold"], dtype=torch.float32).reshape(-1, 1, 1)
        luma = pixels @ torch.tensor(LUMA)
        return {
            "bright_fraction": (luma > threshold).float().mean(dim=(1, 2)),
            "mean_rgb": pixels.mean(dim=(1, 2)),
        }

    def encode_response(self, output: dict[str, torch.Tensor], request: Request) -> dict[str, Any]:
        """In a front end: the fields it was asked with and what was measured."""
        return {
            "threshold": request.context["threshold"],
            "box": request.context["box"],
            "bright_fraction": round(float(output["bright_fraction"]), 6),
            "mean_rgb": [round(float(value), 6) for value in output["mean_rgb"]],
        }
