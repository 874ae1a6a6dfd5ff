"""The seed-style baseline: FastAPI, `run_in_threadpool` + a semaphore, one uvicorn worker, no batching.

It is what a typical user writes after the blocked-event-loop version: the model runs in the threadpool,
at most CONCURRENCY images at a time; everyone else waits on the semaphore, in an unbounded queue.
`python -m loadtests.contenders.baseline_fastapi --port 8001`
"""

from __future__ import annotations

import argparse
import asyncio

import uvicorn
from fastapi import FastAPI, File, UploadFile
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import Response

from loadtests.lib import pipeline

CONCURRENCY = 4

app = FastAPI()
model = pipeline.load_denoiser(pipeline.best_device())
gate = asyncio.Semaphore(CONCURRENCY)


def denoise(data: bytes) -> bytes:
    """Decode, run the model on one image, encode: the whole request, in a pool thread."""
    tensor = pipeline.decode(data)
    return pipeline.encode(pipeline.forward(model, tensor[None])[0])


@app.post("/predict")
async def predict(file: UploadFile = File(...)) -> Response:  # noqa: B008 (FastAPI's documented idiom)
    data = await file.read()
    async with gate:
        body = await run_in_threadpool(denoise, data)
    return Response(body, media_type="image/jpeg")


@app.get("/health")
async def health() -> dict[str, str]:
    return {"status": "ok"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8001)
    args = parser.parse_args()
    uvicorn.run(app, host="127.0.0.1", port=args.port, workers=1, log_level="warning")


if __name__ == "__main__":
    main()
