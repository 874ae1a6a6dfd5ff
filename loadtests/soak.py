"""The memory soak: a mixed load held for minutes while the PSS of imgserve's whole process tree is sampled.

`python -m loadtests.soak --minutes 30 [--users 32] [--out loadtests/results/soak.md] [--setting NAME=VALUE ...]`

The mix: `--users` closed-loop clients posting JPEGs from 64x64 to 1024x1024; 10% of the uploads are
corrupt (truncated JPEGs: 400) and 10% of the clients give up 5 ms after sending (the server answers nobody).
Goals: no 5xx fault (a 503 shed or a 504 deadline is the contract's answer to too much load: counted, allowed);
PSS with no upward trend under load (the mean of the last third of the load window within 5% of
the first third's, the first minute excluded as warm-up); PSS back within 15% of its idle value after the load
(waiting up to 60 s); the request slots' /dev/shm memory back to 0. Exit status 0 when every goal is met, else 1.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import httpx

from imgserve.testing import RunningServer, free_port, serve_command
from loadtests.lib.images import SampleImage, synthetic_image
from loadtests.lib.report import machine
from loadtests.lib.servers import Periodic, running_server

SIDES = (64, 128, 256, 512, 768, 1024)
CORRUPT_SHARE, GIVE_UP_SHARE, GIVE_UP_S = 0.1, 0.1, 0.005
TREND_LIMIT, SETTLE_LIMIT, SETTLE_S, WARMUP_S = 0.05, 0.15, 60.0, 60.0
SAMPLE_S = 2.0
MIB = 2**20


def soak_images() -> list[SampleImage]:
    """Two JPEGs per side."""
    return [synthetic_image(7000 + i, side, side, "JPEG") for i, side in enumerate(SIDES * 2)]


def corrupt(image: SampleImage) -> SampleImage:
    """The first third of the upload: a truncated JPEG (400)."""
    return SampleImage(f"corrupt-{image.name}", 0, 0, image.content_type, image.data[: len(image.data) // 3])


@dataclass
class Tally:
    """Answers by status (0: the client gave up or the connection failed)."""

    statuses: collections.Counter = field(default_factory=collections.Counter)
    gave_up: int = 0

    @property
    def faults(self) -> int:
        """5xx answers other than 503 (shed) and 504 (deadline)."""
        return sum(count for status, count in self.statuses.items() if status >= 500 and status not in (503, 504))


async def _client(
    index: int, url: str, stop_at: float, images: list[SampleImage], broken: list[SampleImage], tally: Tally
) -> None:
    rng = random.Random(index)
    quick = aiohttp.ClientTimeout(total=GIVE_UP_S)
    patient = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < stop_at:
            image = rng.choice(broken if rng.random() < CORRUPT_SHARE else images)
            gives_up = rng.random() < GIVE_UP_SHARE
            form = aiohttp.FormData()
            form.add_field("file", image.data, filename=image.name, content_type=image.content_type)
            try:
                async with session.post(url, data=form, timeout=quick if gives_up else patient) as response:
                    await response.read()
                    tally.statuses[response.status] += 1
            except (TimeoutError, aiohttp.ClientError):
                tally.gave_up += gives_up
                tally.statuses[0] += not gives_up


def run_load(url: str, users: int, seconds: float) -> Tally:
    """`users` clients for `seconds`, bounded (every request has a timeout)."""
    images = soak_images()
    broken = [corrupt(image) for image in images]
    tally = Tally()

    async def main() -> None:
        stop_at = time.monotonic() + seconds
        clients = [_client(i, url, stop_at, images, broken, tally) for i in range(users)]
        await asyncio.wait_for(asyncio.gather(*clients), timeout=seconds + 120)

    asyncio.run(main())
    return tally


def slot_bytes(server: RunningServer) -> float:
    """imgserve_shared_memory_bytes: what the request slots hold in /dev/shm."""
    text = httpx.get(server.url + "/metrics", timeout=10).text
    lines = [line for line in text.splitlines() if line.startswith("imgserve_shared_memory_bytes ")]
    return float(lines[0].split()[1])


def settle(server: RunningServer, idle: int) -> tuple[float, int, float]:
    """After the load: seconds until PSS is within SETTLE_LIMIT of `idle` (or SETTLE_S), that PSS, slot bytes."""
    started = time.monotonic()
    while True:
        pss = server.tree_pss()
        waited = time.monotonic() - started
        if pss <= idle * (1 + SETTLE_LIMIT) or waited >= SETTLE_S:
            break
        time.sleep(1)
    with contextlib.suppress(httpx.HTTPError):
        deadline = time.monotonic() + 30
        while slot_bytes(server) and time.monotonic() < deadline:
            time.sleep(1)
    return waited, pss, slot_bytes(server)


def trend(samples: list[tuple[float, int]], start: float, end: float) -> tuple[float, float, float]:
    """Mean PSS of the first and last thirds of [start + warm-up, end], and the relative change."""
    begin = start + min(WARMUP_S, (end - start) / 3)
    third = (end - begin) / 3
    first = [pss for t, pss in samples if begin <= t < begin + third]
    last = [pss for t, pss in samples if end - third <= t <= end]
    a, b = statistics.mean(first), statistics.mean(last)
    return a, b, (b - a) / a


@dataclass(frozen=True)
class SoakResult:
    """PSS idle, under load (samples, first and last third) and after it; the slots' bytes; the answers."""

    idle: int
    loaded: list[int]
    first: float
    last: float
    change: float
    waited: float
    settled: int
    slots: float
    peak_slots: float
    tally: Tally

    def goals(self) -> list[tuple[str, str, bool]]:
        """(goal, result, met) rows."""
        return [
            (
                "no 5xx fault (503/504 load answers counted)",
                f"{self.tally.faults} faults; {self.tally.statuses[503]} shed, {self.tally.statuses[504]} late",
                self.tally.faults == 0,
            ),
            (
                f"no upward PSS trend under load (last third <= first third + {TREND_LIMIT:.0%})",
                f"{self.first / MIB:.0f} -> {self.last / MIB:.0f} MiB ({self.change:+.1%})",
                self.change <= TREND_LIMIT,
            ),
            (
                f"PSS back within {SETTLE_LIMIT:.0%} of idle after the load",
                f"{self.settled / MIB:.0f} MiB vs idle {self.idle / MIB:.0f} MiB after {self.waited:.0f} s",
                self.settled <= self.idle * (1 + SETTLE_LIMIT),
            ),
            ("request slots' /dev/shm back to 0", f"{self.slots:.0f} bytes", self.slots == 0),
        ]


def soak(minutes: float, users: int, settings: dict[str, str], log: Path) -> SoakResult:
    """Start imgserve, sample PSS idle, under the load and after it."""
    port = free_port()
    env = {f"IMGSERVE_{key.upper()}": value for key, value in settings.items()}
    with running_server(serve_command(port), port, log, "/health/ready", env) as server:
        url = server.url + "/predict"
        run_load(url, users=2, seconds=5)  # every worker warm, every code path taken once
        time.sleep(10)
        idle = server.tree_pss()
        samples: list[tuple[float, int]] = []
        slots_seen: list[float] = []  # PSS does not see the slots (never mapped): their /dev/shm bytes, separately

        def sample() -> None:
            samples.append((time.monotonic(), server.tree_pss()))
            with contextlib.suppress(httpx.HTTPError):
                slots_seen.append(slot_bytes(server))

        with Periodic(sample, SAMPLE_S):
            start = time.monotonic()
            tally = run_load(url, users, minutes * 60)
            end = time.monotonic()
        waited, settled, slots = settle(server, idle)
    loaded = [pss for t, pss in samples if start <= t <= end]
    first, last, change = trend(samples, start, end)
    return SoakResult(idle, loaded, first, last, change, waited, settled, slots, max(slots_seen, default=0.0), tally)


def render(result: SoakResult, command: str, minutes: float, users: int) -> str:
    loaded = result.loaded
    lines = [
        f"`{command}` — {machine()}; {minutes:g} min, {users} clients",
        "",
        f"PSS of the process tree: idle {result.idle / MIB:.0f} MiB; under load min {min(loaded) / MIB:.0f}, "
        f"mean {statistics.mean(loaded) / MIB:.0f}, max {max(loaded) / MIB:.0f} MiB ({len(loaded)} samples); "
        f"request slots in /dev/shm (not in PSS) at most {result.peak_slots / MIB:.0f} MiB",
        f"Answers: {dict(sorted(result.tally.statuses.items()))}; gave up after {GIVE_UP_S * 1000:.0f} ms: "
        f"{result.tally.gave_up}",
        "",
        "| goal | result | met |",
        "|---|---|---|",
        *(f"| {goal} | {value} | {'yes' if ok else 'NO'} |" for goal, value, ok in result.goals()),
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtests.soak", description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--users", type=int, default=32)
    parser.add_argument("--out", type=Path, default=Path("loadtests/results/soak.md"))
    parser.add_argument("--setting", action="append", default=[], help="NAME=VALUE, passed as IMGSERVE_NAME")
    args = parser.parse_args(argv)
    settings = dict(item.split("=", 1) for item in args.setting)
    with tempfile.TemporaryDirectory(prefix="imgserve-soak-") as logs:
        result = soak(args.minutes, args.users, settings, Path(logs) / "imgserve.log")
    report = render(result, "python -m loadtests.soak " + " ".join(argv or sys.argv[1:]), args.minutes, args.users)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(report)
    print(report)
    return 0 if all(ok for _, _, ok in result.goals()) else 1


if __name__ == "__main__":
    sys.exit(main())
