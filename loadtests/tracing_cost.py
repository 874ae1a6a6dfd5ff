"""What a request pays on the front end's path for tracing and its id when tracing is off, timed in this process.

`python -m loadtests.tracing_cost [--requests 100000]`

The side-by-side run (`python -m loadtests.sidebyside --before DIR --tracing`) is the measurement that counts. On a
shared machine, though, its rounds spread by more than the 2% it looks for. This times the two things the change
adds to every HTTP request with nothing set. The first is the outermost middleware, which reads, makes up and
echoes X-Request-ID, timed around a bare ASGI app. The second is the six steps' spans (`admission`, `read`, `infer`,
`decode_request`, `hand-off`, `encode_response`), which are do-nothing context managers with tracing off. Each is
the median of 5 runs of `--requests` calls.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from imgserve.frontend import tracing

STEPS = ("admission", "read", "infer", "decode_request", "hand-off", "encode_response")
SCOPE = {
    "type": "http",
    "path": "/predict",
    "method": "POST",
    "headers": [(b"host", b"imgserve"), (b"content-type", b"image/jpeg"), (b"content-length", b"48213")],
    "http_version": "1.1",
    "query_string": b"",
}


async def bare(scope: Any, receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"image/jpeg")]})
    await send({"type": "http.response.body", "body": b"answer"})


async def ignore(message: Any) -> None:
    pass


async def nothing() -> dict[str, Any]:
    return {"type": "http.request", "body": b"", "more_body": False}


async def steps(scope: Any, receive: Any, send: Any) -> None:
    for name in STEPS:
        with tracing.step(name, item=0) as span:
            tracing.to_worker(span)


async def per_call_us(call: Callable[..., Awaitable[None]], requests: int) -> float:
    started = time.perf_counter()
    for _ in range(requests):
        await call(SCOPE, nothing, ignore)
    return (time.perf_counter() - started) / requests * 1e6


async def measure(requests: int) -> dict[str, float]:
    """Microseconds per request: the bare app, the app behind the request-id middleware, the six steps."""
    wrapped = tracing.RequestMiddleware(bare, "denoiser")
    runs: dict[str, list[float]] = {"bare": [], "middleware": [], "steps": []}
    for _ in range(5):
        runs["bare"].append(await per_call_us(bare, requests))
        runs["middleware"].append(await per_call_us(wrapped, requests))
        runs["steps"].append(await per_call_us(steps, requests))
    return {name: statistics.median(values) for name, values in runs.items()}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=100_000)
    args = parser.parse_args(argv)
    if tracing.TRACER is not None:  # nothing in this process starts tracing; this times the path without it
        raise RuntimeError("tracing is on in this process")
    found = asyncio.run(measure(args.requests))
    added = found["middleware"] - found["bare"]
    print(f"request id middleware: +{added:.2f} us per request ({found['bare']:.2f} us bare app)")
    print(f"six steps, tracing off: {found['steps']:.2f} us per request")
    print(f"together: {added + found['steps']:.2f} us per request")
    return 0


if __name__ == "__main__":
    sys.exit(main())
