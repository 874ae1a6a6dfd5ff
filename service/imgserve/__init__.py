"""imgserve: serve PyTorch image models over HTTP and the Open Inference Protocol, with dynamic batching bounded by
measured memory, load shedding, deadlines and a clean drain; your own API is a LitServe API class.

Your own Python around your own model is an `ImageAPI` (docs/custom-api.md); `serve(MyAPI())` runs it as
`imgserve serve --api module:MyAPI` does. The public names are imported on first use, so that importing one of the
package's modules does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from imgserve.version import __version__

if TYPE_CHECKING:
    from imgserve.api import Encoded, ImageAPI, Request, TensorSpec, UploadedFile
    from imgserve.cli import serve
    from imgserve.errors import ApiError

_PUBLIC = {
    "ApiError": "imgserve.errors",
    "Encoded": "imgserve.api",
    "ImageAPI": "imgserve.api",
    "Request": "imgserve.api",
    "TensorSpec": "imgserve.api",
    "UploadedFile": "imgserve.api",
    "serve": "imgserve.cli",
}
__all__ = ["ApiError", "Encoded", "ImageAPI", "Request", "TensorSpec", "UploadedFile", "__version__", "serve"]


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'imgserve' has no attribute {name!r}")
