"""A request given up at its deadline is counted once: over gRPC both the hand-off's own timer (in a task the call
started) and gRPC's cancellation of the call (in the call's task) end it, and each used to count it."""

from __future__ import annotations

import asyncio

from imgserve import metrics


def deadlines(model: str) -> float:
    return metrics.REJECTED.labels("deadline", model)._value.get()


async def one_grpc_call(model: str, hand_off_counts: bool, cancellation_counts: bool) -> None:
    """What a call's task does: keep one count, hand its item off in a task of its own, then learn how it ended."""
    metrics.one_deadline_per_request()

    async def handed_off() -> None:
        if hand_off_counts:
            metrics.count_deadline(model)  # dispatch's timer ran out first

    await asyncio.gather(handed_off())
    if cancellation_counts:
        metrics.count_deadline(model)  # then gRPC cancelled the call at its deadline (grpc_stream.cancelled_status)


def test_a_request_ended_by_both_timers_counts_one_deadline() -> None:
    before = deadlines("both")
    asyncio.run(one_grpc_call("both", hand_off_counts=True, cancellation_counts=True))
    assert deadlines("both") - before == 1


def test_each_request_keeps_its_own_count() -> None:
    """Calls answered side by side on one event loop (gRPC's tasks, a stream's requests) count one each."""

    async def calls() -> None:
        await asyncio.gather(*(asyncio.create_task(one_grpc_call("each", True, True)) for _ in range(3)))
        await one_grpc_call("each", hand_off_counts=False, cancellation_counts=True)

    before = deadlines("each")
    asyncio.run(calls())
    assert deadlines("each") - before == 4


def test_outside_a_kept_count_every_deadline_counts() -> None:
    """HTTP's requests keep no count: nothing there ends a request twice."""
    before = deadlines("http")
    metrics.count_deadline("http")
    metrics.count_deadline("http")
    assert deadlines("http") - before == 2
