"""KServe's own clients (REST, and gRPC when a port is given) against a v2 server, run as a child process: kserve
registers the same protobuf symbols (`inference.*`) as tritonclient.grpc, so the two cannot be imported into one
process. Prints a JSON report."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import sys

import httpx
import numpy as np
from kserve import InferenceGRPCClient, InferenceRESTClient, InferInput, InferRequest, RESTConfig
from PIL import Image


async def report(url: str, model: str, image: bytes) -> dict:
    """What the client saw: health, one binary and one JSON inference, and an error's message."""
    async with InferenceRESTClient(RESTConfig(protocol="v2", timeout=60)) as client:
        found = {
            "live": await client.is_server_live(url),
            "ready": await client.is_server_ready(url),
            "model_ready": await client.is_model_ready(url, model),
        }
        tensor = InferInput("image", [1, 1], "BYTES")
        tensor.set_data_from_numpy(np.array([[image]], dtype=object), binary_data=True)
        request = InferRequest(model, [tensor], request_id="k1", parameters={"format": "png"})
        answer = await client.infer(url, request, model_name=model)
        (data,) = answer.outputs[0].as_numpy().reshape(-1)  # a JSON output: base64 (KServe reads binary BYTES as text)
        found["binary"] = {"id": answer.id, "size": Image.open(io.BytesIO(base64.b64decode(data))).size}
        body = {
            "inputs": [{"name": "image", "shape": [1], "datatype": "BYTES", "data": [base64.b64encode(image).decode()]}]
        }
        answer = await client.infer(url, body, model_name=model)
        (data,) = answer.outputs[0].as_numpy().reshape(-1)
        found["json"] = {"size": Image.open(io.BytesIO(base64.b64decode(data))).size}
        try:
            await client.infer(url, body, model_name="no-such-model")
        except httpx.HTTPStatusError as exc:
            found["error"] = str(exc)
        return found


async def grpc_report(address: str, model: str, image: bytes) -> dict:
    """What KServe's gRPC client saw (its own generated stubs against the server's Triton ones): readiness and one
    inference of raw JPEG bytes."""
    async with InferenceGRPCClient(address, timeout=60) as client:
        found = {"ready": await client.is_server_ready(), "model_ready": await client.is_model_ready(model)}
        tensor = InferInput("image", [1, 1], "BYTES")
        tensor.set_data_from_numpy(np.array([[image]], dtype=object))
        answer = await client.infer(InferRequest(model, [tensor], request_id="g1"))
        (data,) = answer.outputs[0].as_numpy().reshape(-1)
        found["infer"] = {"id": answer.id, "size": Image.open(io.BytesIO(data)).size}
        return found


if __name__ == "__main__":
    url, model, path, *grpc_address = sys.argv[1:5]
    with open(path, "rb") as file:
        image = file.read()
    found = asyncio.run(report(url, model, image))
    if grpc_address:
        found["grpc"] = asyncio.run(grpc_report(grpc_address[0], model, image))
    print(json.dumps(found))
