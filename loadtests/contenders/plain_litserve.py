"""A minimal plain LitServe API with batching, written the way the LitServe docs show, for the same model and codec.

LitServe's default `batch` is `torch.stack`, which fails the whole batch (500s) on images of different sizes.
A docs-level user keeps the batch a list and runs the model once per image in `predict`; that is what this
does, so LitServe's batching here only amortizes the queue round trip, not the model call. Decoding runs in
`decode_request` and encoding in `encode_response`, in the inference worker, as in the docs.
`python -m loadtests.contenders.plain_litserve --port 8002`
"""

from __future__ import annotations

import argparse

import litserve as ls
import torch
from fastapi import Response

from loadtests.lib import pipeline

MAX_BATCH_SIZE = pipeline.DEFAULTS.max_batch_size
BATCH_TIMEOUT_S = pipeline.DEFAULTS.batch_timeout_ms / 1000


class DenoiseAPI(ls.LitAPI):
    """Multipart `file` in, JPEG out; up to MAX_BATCH_SIZE requests per predict call."""

    def setup(self, device: str) -> None:
        self.model = pipeline.load_denoiser(device)

    def decode_request(self, request) -> torch.Tensor:  # noqa: ANN001 (LitServe reads an unannotated body as a form)
        return pipeline.decode(request["file"].file.read())

    def batch(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        return inputs

    def predict(self, images: list[torch.Tensor]) -> list[torch.Tensor]:
        return [pipeline.forward(self.model, image[None])[0] for image in images]

    def unbatch(self, outputs: list[torch.Tensor]) -> list[torch.Tensor]:
        return outputs

    def encode_response(self, output: torch.Tensor) -> Response:
        return Response(content=pipeline.encode(output), media_type="image/jpeg")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8002)
    args = parser.parse_args()
    api = DenoiseAPI(max_batch_size=MAX_BATCH_SIZE, batch_timeout=BATCH_TIMEOUT_S)
    server = ls.LitServer(api, accelerator=pipeline.best_device(), workers_per_device=1, timeout=30)
    server.run(host="127.0.0.1", port=args.port, generate_client_file=False, log_level="warning")


if __name__ == "__main__":
    main()
