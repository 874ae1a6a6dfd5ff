"""The one way into the model for every protocol: admit these items, decode them, hand them over, encode the answers.

`/predict`, the Open Inference Protocol's HTTP infer and its gRPC ModelInfer, and a plain LitAPI's route are thin
adapters onto `Inference.run`: a call's N items take N places in the pod's queue, all or none (503 when there is
no room); each is decoded by the API's `decode_request` into its own slot and goes to the dynamic batcher on its
own; each answer is encoded by `encode_response`. Small items are decoded and encoded on the event loop, larger
ones on the front end's codec threads. The call is answered once every item has its answer; an item that fails
fails the whole call, and what it cost stops there: nothing of a call reaches a worker unless all its items
decoded. With tracing on, the call is an `infer` span, and each item's steps are spans under it (frontend/tracing.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any, Generic, TypeVar

import anyio

from imgserve import metrics
from imgserve.errors import ApiError, fault, from_exception
from imgserve.frontend import tracing
from imgserve.frontend.admission import Admission
from imgserve.handoff.dispatch import Dispatcher, Slot
from imgserve.served import ServedModel

log = logging.getLogger(__name__)
INLINE_CODEC_BYTES = 32 * 1024  # items carrying up to this many bytes are decoded and encoded on the event loop
T = TypeVar("T")
Call = TypeVar("Call")  # one item of a call, as the protocol read it
Answer = TypeVar("Answer")  # one item's answer, as encode gives it


class CodecThreads:
    """Where a front end decodes uploads and encodes answers too large for its event loop: `count` threads, first
    come first served. 64 large uploads are decoded a few at a time, so the first of them reach a worker while the
    others wait, rather than all at once and all late, each holding its pixels meanwhile."""

    def __init__(self, count: int) -> None:
        self.count = count
        self._limiter: anyio.CapacityLimiter | None = None  # made in the front end's own event loop

    async def run(self, function: Callable[..., T], *args: Any) -> T:
        if self._limiter is None:
            self._limiter = anyio.CapacityLimiter(self.count)
        return await anyio.to_thread.run_sync(function, *args, limiter=self._limiter)


class Steps(Generic[Call, Answer]):
    """A protocol's way around the hand-off to one model: `decode` one item into what travels to the worker, `encode`
    its answer, and how many bytes an item carries (what decides where they run)."""

    def __init__(
        self,
        model: ServedModel,
        decode: Callable[[Call], Any],
        encode: Callable[[Any, Call], Answer],
        size: Callable[[Call], int],
        names: tuple[str, str] = ("decode_request", "encode_response"),
    ) -> None:
        self.model, self.decode, self.encode, self.size, self.names = model, decode, encode, size, names


class Inference:
    """Admission, decoding into slots, hand-off to the workers, the wait for their answers, and encoding."""

    def __init__(self, dispatcher: Dispatcher, admission: Admission, codec: CodecThreads) -> None:
        self.dispatcher, self.admission, self.codec = dispatcher, admission, codec

    async def run(self, calls: Sequence[Call], deadline: float, steps: Steps[Call, Answer]) -> list[Answer]:
        """Each item's encoded answer, in order; an ApiError for the first failure of any of them."""
        if not calls:
            raise ApiError(400, "no_images", "the request carries no item")
        model = steps.model
        with tracing.step("infer"):
            self.admission.admit(len(calls), model.index)  # or 503: draining, or a full queue; 404 not loaded
            try:
                return await self._run(calls, deadline, steps)
            finally:
                self.admission.release(len(calls), model.index)

    async def _run(self, calls: Sequence[Call], deadline: float, steps: Steps[Call, Answer]) -> list[Answer]:
        async with contextlib.AsyncExitStack() as stack:
            model = steps.model
            slots = [await stack.enter_async_context(self.dispatcher.slot(model.index, model.name)) for _ in calls]
            inline = [steps.size(call) <= INLINE_CODEC_BYTES for call in calls]
            # Large items decode on the codec threads; every decode ends before a slot is let go.
            items = await _all(
                self._call(index, steps.names[0], small, self._decode_into, steps, call, slot)
                for index, (small, call, slot) in enumerate(zip(inline, calls, slots, strict=True))
            )
            pairs = enumerate(zip(slots, items, strict=True))
            answers = await _all(self._handed_off(index, slot, item, deadline) for index, (slot, item) in pairs)
            return [
                await self._call(index, steps.names[1], small, self._encode, steps, call, slot, answer)
                for index, (small, call, slot, answer) in enumerate(zip(inline, calls, slots, answers, strict=True))
            ]

    async def _call(self, index: int, name: str, inline: bool, function: Callable[..., T], *args: Any) -> T:
        """Item `index`'s step `name`: `function(*args)` on the event loop when `inline`, else on a codec thread."""
        with tracing.step(name, item=index):
            return function(*args) if inline else await self.codec.run(function, *args)

    @staticmethod
    async def _handed_off(index: int, slot: Slot, item: Any, deadline: float) -> Any:
        """Item `index` queued for the workers, and its answer; with tracing on, the worker's spans hang under this
        step's."""
        with tracing.step("hand-off", item=index) as span:
            return await slot.submit(item, deadline, tracing.to_worker(span))

    @staticmethod
    def _decode_into(steps: Steps[Call, Any], call: Call, slot: Slot) -> Any:
        """The item decoded, its arrays written into its slot; what remains travels in the message."""
        item = _hook(steps.decode, steps.names[0], metrics.DECODE_DURATION.labels(steps.model.name), call)
        try:
            return slot.place(item)
        except TypeError as exc:
            log.error("%s returned what cannot travel to a worker: %s", steps.names[0], exc)
            raise ApiError(500, "api_error", f"{steps.names[0]} returned what cannot travel: {exc}"[:300]) from None

    @staticmethod
    def _encode(steps: Steps[Call, Answer], call: Call, slot: Slot, answer: Any) -> Answer:
        """The worker's answer, read from the slot where it lies there, encoded."""
        seconds = metrics.ENCODE_DURATION.labels(steps.model.name)
        return _hook(steps.encode, steps.names[1], seconds, slot.result(answer), call)


def _hook(step: Callable[..., T], name: str, seconds: Any, *args: Any) -> T:
    """A hook's answer, timed; its exception as the ApiError it answers with (an unexpected one: 500, with its
    traceback logged once)."""
    started = time.perf_counter()
    try:
        return step(*args)
    except Exception as exc:
        error = from_exception(exc)
        if error is None:
            log.exception("%s failed", name)
            error = fault(exc, name)
        raise error from None
    finally:
        seconds.observe(time.perf_counter() - started)


async def _all(awaitables: Iterable[Awaitable[T]]) -> list[T]:
    """Await them all side by side, each to its end; then raise the first failure, if any. A call of one item too: its
    task's turn through the event loop lets requests that arrived with it be admitted before it is sent, so a worker
    sees them queued and batches them together (it closes a lone request's batch at once, worker/gather.py)."""
    results = await asyncio.gather(*awaitables, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results  # type: ignore[return-value]  # none of them is an exception here
