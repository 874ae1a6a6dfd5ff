"""A bounded closed-loop load generator: N concurrent users, each posting the next image as soon as it has an answer.

The benchmark and the capacity command use this instead of Locust. They run 20+ short cells (capacity steps
of ~2 s), and a Locust process per cell costs seconds to start and ramps users up over time, which blurs short
windows. Here all N users start at once, every request is timestamped, and each cell is bounded by time.
The Locust locustfile (shapes, HTML report) is for longer, shaped runs.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import aiohttp
from urllib3 import encode_multipart_formdata

from loadtests.lib.images import MAX_RETRY_AFTER_S, REJECT_STATUSES, SampleImage, check_answer, sample_images

# A check of one answer: (image sent, status, content type, body, decode its pixels?) -> what is wrong, or None.
Check = Callable[[SampleImage, int, str, bytes, bool], str | None]


@dataclass(frozen=True)
class Outcome:
    """One request: when it started (monotonic), how long it took, its status (0: no answer) and what was wrong."""

    started: float
    latency_s: float
    status: int
    error: str | None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def rejected(self) -> bool:
        return self.status in REJECT_STATUSES


@dataclass(frozen=True)
class LoadResult:
    """The requests started in the measurement window of one closed-loop run."""

    users: int
    window_s: float
    outcomes: list[Outcome]

    @property
    def answered(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.ok]

    @property
    def rps(self) -> float:
        """Successful answers per second."""
        return len(self.answered) / self.window_s

    def latency_ms(self, quantile: float) -> float | None:
        """Latency quantile of the successful answers (nearest rank), in ms."""
        latencies = sorted(o.latency_s for o in self.answered)
        if not latencies:
            return None
        return 1000 * latencies[min(int(quantile * len(latencies)), len(latencies) - 1)]

    @property
    def shed(self) -> int:
        """Explicit rejections: 503 and 504."""
        return sum(o.rejected for o in self.outcomes)

    @property
    def failed(self) -> int:
        """Everything else that was not a correct answer: wrong status or image, transport errors, timeouts."""
        return sum(not o.ok and not o.rejected for o in self.outcomes)

    @property
    def shed_rate(self) -> float:
        return self.shed / len(self.outcomes) if self.outcomes else 0.0

    def errors(self, limit: int = 3) -> list[str]:
        """A few distinct failure messages, for the report."""
        return sorted({o.error for o in self.outcomes if o.error and not o.rejected})[:limit]


@functools.cache
def _form(image: SampleImage) -> tuple[bytes, dict[str, str]]:
    """The image as a multipart/form-data body and its header, encoded once: every user sends the same bytes, and
    the co-located client spends less of the server's cores (0.11-0.13 ms less CPU per request than aiohttp's
    FormData per request, 128x128, 64 users)."""
    body, content_type = encode_multipart_formdata({"file": (image.name, image.data, image.content_type)})
    return body, {"Content-Type": content_type}


async def _post(session: aiohttp.ClientSession, url: str, image: SampleImage) -> tuple[int, str, bytes, float]:
    body, headers = _form(image)
    async with session.post(url, data=body, headers=headers) as response:
        body = await response.read()
        retry_after = float(response.headers.get("Retry-After", 0) or 0)
        return response.status, response.headers.get("Content-Type", ""), body, retry_after


@dataclass(frozen=True)
class Behaviour:
    """What every user sends and how it treats a rejection."""

    images: Sequence[SampleImage]
    retry_at_once: bool  # resend the same image on 503/504 at once (a retry storm) instead of waiting Retry-After
    decode_answers: bool  # decode every answer's pixels (else check its header: format and size)
    max_requests: int | None  # stop once this many requests were sent by all users together
    check: Check | None  # None: check_answer (an image of the input's size)


async def _user(
    index: int,
    session: aiohttp.ClientSession,
    url: str,
    stop_at: float,
    how: Behaviour,
    tickets: itertools.count,
    results: list[Outcome],
) -> None:
    images = how.images
    sent = 0
    while time.monotonic() < stop_at and (how.max_requests is None or next(tickets) < how.max_requests):
        image = images[(index + sent) % len(images)]
        started = time.monotonic()
        retry_after = 0.0
        try:
            status, content_type, body, retry_after = await _post(session, url, image)
            latency = time.monotonic() - started  # the whole answer is in; checking it is the client's own time
            error = (how.check or check_answer)(image, status, content_type, body, how.decode_answers)
        except (aiohttp.ClientError, TimeoutError) as exc:
            latency = time.monotonic() - started
            status, error = 0, f"{type(exc).__name__}: {exc}"
        results.append(Outcome(started, latency, status, error))
        if status not in REJECT_STATUSES:
            sent += 1
        elif not how.retry_at_once:  # a polite client backs off as told (bounded)
            await asyncio.sleep(min(retry_after, MAX_RETRY_AFTER_S, max(stop_at - time.monotonic(), 0)))


async def _run(url: str, users: int, seconds: float, warmup_s: float, timeout_s: float, how: Behaviour) -> LoadResult:
    start = time.monotonic()
    stop_at = start + warmup_s + seconds
    results: list[Outcome] = []
    tickets = itertools.count()
    connector = aiohttp.TCPConnector(limit=users, force_close=False)
    client_timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=client_timeout) as session:
        tasks = [asyncio.create_task(_user(i, session, url, stop_at, how, tickets, results)) for i in range(users)]
        # Requests still running at the end are awaited (up to the client timeout), so slow answers count.
        done, pending = await asyncio.wait(tasks, timeout=seconds + warmup_s + timeout_s + 5)
        for task in pending:
            task.cancel()
    # A user that died (a check that raised, a bug of the load's own) fails the run rather than read as 0/s.
    died = [error for error in (task.exception() for task in done) if error is not None]
    if died:
        raise died[0]
    measured = [o for o in results if start + warmup_s <= o.started < stop_at]
    return LoadResult(users, seconds, measured)


def run_closed_loop(
    url: str,
    users: int,
    seconds: float,
    warmup_s: float = 0.0,
    timeout_s: float = 60.0,
    *,
    images: Sequence[SampleImage] | None = None,
    retry_at_once: bool = False,
    decode_answers: bool = True,
    max_requests: int | None = None,
    check: Check | None = None,
) -> LoadResult:
    """Post test images to `url` from `users` concurrent users for `warmup_s` + `seconds`; measure the last `seconds`.

    `images` default to the eight sample images. With `retry_at_once` a rejected user resends the same image
    immediately (a retry storm), else it waits Retry-After. decode_answers=False checks each answer's header only.
    `max_requests` ends the run early once that many requests were sent (a flood of a fixed size). `check` judges
    each answer (default `check_answer`: an image of the input's size; `check_scores` for a classifier).
    Requests are timed out after `timeout_s`. The result holds the requests started in the measured window; a user
    that dies of an exception (not a failed answer: one of the load generator's own) raises it here.
    """
    how = Behaviour(images or sample_images(), retry_at_once, decode_answers, max_requests, check)
    return asyncio.run(_run(url, users, seconds, warmup_s, timeout_s, how))
