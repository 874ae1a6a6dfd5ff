"""How cheap a rejection is: 503s per second one front end answers, and its CPU per 503, while the queue is full.

    python -m loadtests.shed_rate --users 64 --seconds 5

Starts imgserve with one worker whose model never finishes (`Stall`) and a queue of one, fills the queue with one
request, then has `users` keep-alive connections post a small PNG as fast as the answers come (a retry storm).
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import psutil
import torch
from PIL import Image
from safetensors.torch import save_file

from imgserve.testing import LOOPBACK, free_port, serve_command
from loadtests.lib.servers import running_server


class Stall(torch.nn.Module):
    """A model whose batch takes a minute: the one admitted request keeps the queue full."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] > 16:  # warm-up batches are larger than the benchmark's image and pass at once
            return x * self.scale
        time.sleep(60)
        return x


def _png() -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(np.zeros((16, 16, 3), np.uint8)).save(buffer, format="PNG")
    return buffer.getvalue()


async def _storm(port: int, users: int, seconds: float) -> dict[str, int]:
    """Each user posts again as soon as its answer is in, on one keep-alive connection (reconnecting if closed)."""
    body = _png()
    request = (
        f"POST /predict HTTP/1.1\r\nHost: {LOOPBACK}\r\nContent-Type: image/png\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    counts: dict[str, int] = {}
    end = time.monotonic() + seconds

    async def user() -> None:
        reader = writer = None
        while time.monotonic() < end:
            if writer is None:
                reader, writer = await asyncio.open_connection(LOOPBACK, port)
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            status = head.split(b" ", 2)[1].decode()
            length = int(head.lower().split(b"content-length: ", 1)[1].split(b"\r\n", 1)[0])
            await reader.readexactly(length)
            counts[status] = counts.get(status, 0) + 1
            if b"connection: close" in head.lower():
                writer.close()
                reader = writer = None
        if writer is not None:
            writer.close()

    await asyncio.gather(*(user() for _ in range(users)))
    return counts


def measure(users: int, seconds: float) -> dict[str, float]:
    port = free_port()
    with tempfile.TemporaryDirectory() as directory:
        weights = Path(directory) / "stall.safetensors"
        save_file(Stall().state_dict(), str(weights))
        env = {
            "IMGSERVE_MODEL": str(weights),
            "IMGSERVE_MODEL_FACTORY": "loadtests.shed_rate:Stall",
            "IMGSERVE_DEVICE": "cpu",
            "IMGSERVE_WORKERS_PER_DEVICE": "1",
            "IMGSERVE_MAX_BATCH_SIZE": "1",
            "IMGSERVE_MAX_QUEUE_DEPTH": "1",
            "IMGSERVE_LOG_LEVEL": "warning",
        }
        command = serve_command(port)
        with running_server(command, port, Path(directory) / "log", "/health/ready", env) as server:
            processes = server.tree()  # the stalled worker and the queue manager idle: the CPU is the front end's
            held = httpx.AsyncClient(timeout=120)
            loop = asyncio.new_event_loop()
            hold = loop.create_task(held.post(f"{server.url}/predict", content=_png(), headers=_PNG))
            loop.run_until_complete(asyncio.sleep(1.0))  # the one request is admitted and stuck in the model
            cpu_before = _cpu_seconds(processes)
            started = time.perf_counter()
            counts = loop.run_until_complete(_storm(port, users, seconds))
            elapsed = time.perf_counter() - started
            cpu = _cpu_seconds(processes) - cpu_before
            hold.cancel()
            loop.run_until_complete(held.aclose())
    shed = counts.get("503", 0)
    return {
        "users": users,
        "seconds": round(elapsed, 2),
        "answers": counts,
        "rejections_per_s": round(shed / elapsed, 1),
        "server_cpu_us_per_rejection": round(cpu / max(shed, 1) * 1e6, 1),
    }


_PNG = {"Content-Type": "image/png"}


def _cpu_seconds(processes: list[psutil.Process]) -> float:
    return sum(sum(p.cpu_times()[:2]) for p in processes if p.is_running())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--users", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=5.0)
    args = parser.parse_args()
    print(json.dumps(measure(args.users, args.seconds)))


if __name__ == "__main__":
    main()
