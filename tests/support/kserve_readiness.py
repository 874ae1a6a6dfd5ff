"""KServe's REST client's readiness calls against a v2 server, run as a child process (kserve and tritonclient.grpc
cannot share one process, see kserve_client.py). Prints a JSON report: each call's result, or the error it raised."""

from __future__ import annotations

import asyncio
import json
import sys

import httpx
from kserve import InferenceRESTClient, RESTConfig


async def report(url: str, model: str) -> dict[str, object]:
    found: dict[str, object] = {}
    async with InferenceRESTClient(RESTConfig(protocol="v2", timeout=30)) as client:
        calls = {
            "live": client.is_server_live(url),
            "ready": client.is_server_ready(url),
            "model_ready": client.is_model_ready(url, model),
        }
        for name, call in calls.items():
            try:
                found[name] = await call
            except httpx.HTTPStatusError as exc:
                found[name] = {"status": exc.response.status_code, "message": str(exc)}
    return found


if __name__ == "__main__":
    print(json.dumps(asyncio.run(report(sys.argv[1], sys.argv[2]))))
