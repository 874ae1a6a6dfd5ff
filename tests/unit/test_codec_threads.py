"""A front end's codec threads (frontend/inference.py): large uploads are decoded a few at a time, first come first
served, so that the first of 64 reach a worker early instead of all of them late."""

from __future__ import annotations

import asyncio
import threading
import time

from imgserve.frontend.inference import CodecThreads


def test_codec_work_runs_at_most_count_at_a_time_in_the_order_it_came() -> None:
    running, most, started = 0, 0, []
    lock = threading.Lock()

    def decode(index: int) -> int:
        nonlocal running, most
        with lock:
            running += 1
            most = max(most, running)
            started.append(index)
        time.sleep(0.05)
        with lock:
            running -= 1
        return index * 10

    async def main() -> list[int]:
        codec = CodecThreads(2)
        tasks = []
        for index in range(8):
            tasks.append(asyncio.ensure_future(codec.run(decode, index)))
            await asyncio.sleep(0)  # queued in this order
        return await asyncio.gather(*tasks)

    assert asyncio.run(main()) == [index * 10 for index in range(8)]
    assert most == 2
    # First come, first served: two let in together may start in either order, never later than that.
    assert all(abs(position - index) < 2 for position, index in enumerate(started)), started
