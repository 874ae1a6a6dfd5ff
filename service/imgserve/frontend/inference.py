"""The one way into the model for every protocol: admit these images, wait for their results.

`/predict`, the Open Inference Protocol's HTTP infer and its gRPC ModelInfer are thin adapters onto `Inference.run`:
a request's N images take N places in the pod's queue, all or none (503 when there is no room), each is decoded
into its own slot and goes to the dynamic batcher on its own, and the request is answered once every image has its
result. Any image that cannot be decoded fails the whole request before anything reaches a worker.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any, TypeVar

import anyio
import numpy as np

from imgserve.config import Settings
from imgserve.errors import ApiError
from imgserve.frontend import codec
from imgserve.frontend.admission import Admission
from imgserve.handoff.dispatch import Dispatcher, Slot
from imgserve.handoff.state import SharedState
from imgserve.models.preprocess import Geometry, Preprocess

INLINE_CODEC_BYTES = 32 * 1024  # images up to this size are decoded (and their answers encoded) on the event loop
Image = bytes | np.ndarray  # encoded bytes (any accepted format), or decoded uint8 HxWx3 RGB pixels
T = TypeVar("T")


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


class Inference:
    """Admission, decoding into slots, hand-off to the workers and the wait for their answers."""

    def __init__(
        self, settings: Settings, state: SharedState, dispatcher: Dispatcher, admission: Admission, codec: CodecThreads
    ) -> None:
        self.settings, self.state, self.dispatcher, self.admission = settings, state, dispatcher, admission
        self.preprocess = Preprocess.from_settings(settings)
        self.codec = codec

    async def _call(self, inline: bool, function: Callable[..., Any], *args: Any) -> Any:
        """`function(*args)` on the event loop when `inline`, else on a codec thread."""
        return function(*args) if inline else await self.codec.run(function, *args)

    async def run(self, images: Sequence[Image], deadline: float, finish: Callable[[Any, Geometry], T]) -> list[T]:
        """Each image's result passed through `finish(result, geometry)` (on the event loop for small images, else
        on a codec thread), in order; an ApiError for the first failure of any of them."""
        if not images:
            raise ApiError(400, "no_images", "the request carries no image")
        refusal = self.admission.refusal()  # draining, or a full queue
        if refusal is not None:
            raise refusal
        self.admission.admit(len(images))
        try:
            async with contextlib.AsyncExitStack() as stack:
                slots = [await stack.enter_async_context(self.dispatcher.slot()) for _ in images]
                inline = [_size(image) <= INLINE_CODEC_BYTES for image in images]
                # Large images decode on the codec threads; every decode ends before a slot is let go.
                geometries = await _all(
                    self._call(small, self._decode_into, image, slot)
                    for small, image, slot in zip(inline, images, slots, strict=True)
                )
                answers = await _all(
                    slot.submit(shape, deadline) for slot, (shape, _) in zip(slots, geometries, strict=True)
                )
                return [
                    await self._call(small, self._finish, finish, slot, answer, geometry)
                    for small, slot, answer, (_, geometry) in zip(inline, slots, answers, geometries, strict=True)
                ]
        finally:
            self.admission.release(len(images))

    def _decode_into(self, image: Image, slot: Slot) -> tuple[tuple[int, ...], Geometry]:
        """Decode, validate and preprocess one image straight into its slot; its shape is all that is queued, and
        its geometry (how the model's input was cut from the upload) stays here for the answer."""
        limit = self.settings.max_image_pixels
        if isinstance(image, np.ndarray):
            pixels, geometry = codec.prepare_pixels(image, limit, self.preprocess)
        else:
            pixels, geometry = codec.decode_image(image, limit, self.preprocess)
        slot.write(pixels)
        return pixels.shape, geometry

    @staticmethod
    def _finish(finish: Callable[[Any, Geometry], T], slot: Slot, answer: Any, geometry: Geometry) -> T:
        """The worker's result, read from the slot when it lies there, through `finish`."""
        return finish(slot.result(answer), geometry)


async def _all(awaitables: Iterable[Awaitable[T]]) -> list[T]:
    """Await them all side by side, each to its end; then raise the first failure, if any."""
    results = await asyncio.gather(*awaitables, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results  # type: ignore[return-value]  # none of them is an exception here


def _size(image: Image) -> int:
    return len(image) if isinstance(image, bytes) else image.nbytes
