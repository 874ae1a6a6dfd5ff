"""A bounded closed-loop load generator over the Open Inference Protocol's gRPC service, as closed_loop.py is over
HTTP: N users on one channel, each sending its next image (a BYTES `image` input) as soon as it has the answer;
every request timed, the same LoadResult. A rejection (UNAVAILABLE, DEADLINE_EXCEEDED) counts as 503/504, and the
user waits its retry-after (at most 1 s) as an HTTP user waits Retry-After."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import grpc
from tritonclient.grpc import service_pb2, service_pb2_grpc

from loadtests.lib.closed_loop import LoadResult, Outcome
from loadtests.lib.images import MAX_RETRY_AFTER_S, SampleImage

REJECTED = {grpc.StatusCode.UNAVAILABLE: 503, grpc.StatusCode.DEADLINE_EXCEEDED: 504}


def infer_request(model: str, image: SampleImage) -> service_pb2.ModelInferRequest:
    """One image as ModelInfer's `image` input: BYTES [1, 1], its bytes behind a 4-byte length in raw contents."""
    request = service_pb2.ModelInferRequest(model_name=model)
    request.inputs.add(name="image", datatype="BYTES", shape=[1, 1])
    request.raw_input_contents.append(len(image.data).to_bytes(4, "little") + image.data)
    return request


async def _user(
    index: int,
    stub: service_pb2_grpc.GRPCInferenceServiceStub,
    requests: Sequence[service_pb2.ModelInferRequest],
    stop_at: float,
    timeout_s: float,
    results: list[Outcome],
) -> None:
    sent = 0
    while time.monotonic() < stop_at:
        started = time.monotonic()
        wait_s = 0.0
        try:
            response = await stub.ModelInfer(requests[(index + sent) % len(requests)], timeout=timeout_s)
            status, error = (200, None) if response.outputs else (200, "an answer without outputs")
        except grpc.aio.AioRpcError as exc:
            status = REJECTED.get(exc.code(), 0)
            error = f"{exc.code().name}: {exc.details()}"
            retry_after = dict(exc.trailing_metadata() or ()).get("retry-after", "0")
            wait_s = min(float(retry_after), MAX_RETRY_AFTER_S) if status else 0.0
        results.append(Outcome(started, time.monotonic() - started, status, error))
        sent += 1
        await asyncio.sleep(min(wait_s, max(stop_at - time.monotonic(), 0)))


async def _run(
    address: str, model: str, users: int, seconds: float, warmup_s: float, images: Sequence[SampleImage]
) -> LoadResult:
    timeout_s = 60.0
    requests = [infer_request(model, image) for image in images]
    start = time.monotonic()
    stop_at = start + warmup_s + seconds
    results: list[Outcome] = []
    async with grpc.aio.insecure_channel(address) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        tasks = [asyncio.create_task(_user(i, stub, requests, stop_at, timeout_s, results)) for i in range(users)]
        _, pending = await asyncio.wait(tasks, timeout=warmup_s + seconds + timeout_s + 5)
        for task in pending:
            task.cancel()
    return LoadResult(users, seconds, [o for o in results if start + warmup_s <= o.started < stop_at])


def run_grpc_closed_loop(
    address: str, model: str, users: int, seconds: float, warmup_s: float, images: Sequence[SampleImage]
) -> LoadResult:
    """ModelInfer on `address` (host:port) of `model` from `users` concurrent users for `warmup_s` + `seconds`,
    over `images`; the requests started in the last `seconds`."""
    return asyncio.run(_run(address, model, users, seconds, warmup_s, images))
