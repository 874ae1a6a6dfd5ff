"""Answering an HTTP call with what an API's `encode_response` returned: a Starlette Response as it is, `Encoded`
bytes with their media type, bytes as application/octet-stream, and anything else as JSON, with numpy arrays,
numbers and torch tensors as JSON lists and numbers. What is not JSON is a 500 naming what it was."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import torch
from starlette.responses import Response

from imgserve.api import Encoded
from imgserve.errors import ApiError


def http_response(answer: Any) -> Response:
    """The Response for an encode_response answer."""
    if isinstance(answer, Response):
        return answer
    if isinstance(answer, Encoded):
        return Response(answer.data, media_type=answer.media_type)
    if isinstance(answer, bytes | bytearray):
        return Response(bytes(answer), media_type="application/octet-stream")
    return Response(json_bytes(answer), media_type="application/json")


def json_bytes(value: Any) -> bytes:
    """`value` as compact JSON (arrays and tensors as lists); 500 when it is not JSON."""
    try:
        return json.dumps(value, default=_plain, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()
    except (TypeError, ValueError) as exc:
        raise ApiError(500, "api_error", f"encode_response returned what is not JSON: {exc}"[:300]) from None


def _plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().tolist()
    if isinstance(value, np.ndarray | np.generic):
        return value.tolist()
    raise TypeError(f"a {type(value).__name__} is not JSON")
