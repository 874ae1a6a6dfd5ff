"""ModelStreamInfer, gRPC's bidirectional inference stream: a client sends ModelInferRequests on one call and gets
each one's answer on it as soon as it is ready, in any order, with the request's id (Triton's stream, as
tritonclient.grpc's `start_stream`/`async_stream_infer` and perf_analyzer's `--streaming` use it).

Each request goes the way a ModelInfer call goes (`infer`: the model check, a deadline from the call's deadline or
request_timeout_s, admission, the batcher) and counts as one under route grpc/ModelInfer; the stream's API key was
checked before its first message was read (grpc_gate.py). A request that is refused or fails is answered on the
stream with `error_message` and its id, and the stream goes on. At most `window` requests of a stream are in
progress: past it the next message is not read, so HTTP/2's flow control holds the client back, not the server's
memory. When the client closes its side, the requests in progress are answered, then the call ends; when the call
is cancelled (the client left, or the call's deadline passed), they are cancelled with it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from tritonclient.grpc import service_pb2

from imgserve import metrics
from imgserve.errors import ApiError
from imgserve.frontend import telemetry

log = logging.getLogger(__name__)
# A client's own timer ends its call at the deadline, which reaches the server as a cancellation a transit time before
# the server's copy of that deadline: a call cancelled this close to its deadline is counted as having run out of time.
DEADLINE_SLACK_S = 0.05

Infer = Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]


def cancelled_status(context: grpc.aio.ServicerContext, model: str = "") -> int:
    """How a call (or a stream's request) that gRPC cancelled is counted: 504, and a deadline rejection, when the
    call's deadline ran out; else 499 (the client left)."""
    remaining = context.time_remaining()
    if remaining is not None and remaining <= DEADLINE_SLACK_S:
        metrics.count_deadline(model)  # not again if the hand-off's timer counted it first
        return 504
    return 499


class Stream:
    """One ModelStreamInfer call: its requests in progress, and the one writer of its answers."""

    def __init__(
        self, infer: Infer, context: grpc.aio.ServicerContext, window: int, label: Callable[[str], str]
    ) -> None:
        self.infer, self.context, self.label = infer, context, label
        self.window = asyncio.Semaphore(window)
        self.writing = asyncio.Lock()  # one message at a time on the call
        self.running: set[asyncio.Task[None]] = set()

    async def serve(self, requests: AsyncIterator[Any]) -> None:
        """Answer every request (a ModelInferRequest, or the ApiError that says why a message is none) until the
        client closes its side and the last answer is written."""
        try:
            async for request in requests:
                await self.window.acquire()
                task = asyncio.create_task(self._answer(request))
                self.running.add(task)
                task.add_done_callback(self.running.discard)
            await asyncio.gather(*self.running)
        finally:
            for task in self.running:
                task.cancel()

    async def _answer(self, request: Any) -> None:
        """One request answered on the stream; its place in the window is free once its answer is written."""
        try:
            answer = await self._answered(request)
            async with self.writing:
                await self.context.write(answer)
        finally:
            self.window.release()

    async def _answered(self, request: Any) -> Any:
        """One request's answer, or its error, counted."""
        metrics.one_deadline_per_request()  # this task answers this request alone
        started, status = time.perf_counter(), 200
        model = "" if isinstance(request, ApiError) else self.label(request.model_name)
        try:
            if isinstance(request, ApiError):
                raise request
            return service_pb2.ModelStreamInferResponse(infer_response=await self.infer(request, self.context))
        except asyncio.CancelledError:
            status = cancelled_status(self.context, model)
            raise
        except ApiError as error:
            status = error.status
            return _error(request, error.message, error.retry_after)
        except Exception:
            status = 500
            log.exception("a request of a gRPC stream failed")
            return _error(request, "the server failed on this request")
        finally:
            metrics.count(telemetry.GRPC_INFER, status, time.perf_counter() - started, model)


def _error(request: Any, message: str, retry_after: int | None = None) -> Any:
    """A request's error on the stream: the message (with when to retry, for a 503), and the request's id so the
    client knows which request failed (as Triton answers)."""
    if retry_after is not None:
        message = f"{message} (retry after {retry_after} s)"
    found = "" if isinstance(request, ApiError) else request.id
    return service_pb2.ModelStreamInferResponse(
        error_message=message, infer_response=service_pb2.ModelInferResponse(id=found)
    )
