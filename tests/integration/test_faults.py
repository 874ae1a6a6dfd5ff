"""Overload and faults with real processes: flood, deadlines, SIGTERM drain, kill -9 of a worker, bad models, OOM."""

from __future__ import annotations

import asyncio
import io
import os
import signal
import time

import httpx
import pytest
from serving import Server, image_bytes, running_server, start_server, stop_server, wait_ready

from loadtests.lib.closed_loop import run_closed_loop

PNG = {"Content-Type": "image/png"}


def _white_png() -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (12, 10), "white").save(buffer, format="PNG")
    return buffer.getvalue()


WHITE = _white_png()


def test_flood_sheds_with_503_and_answers_everything(tmp_path) -> None:
    """Ten times more users than the queue holds: every request is a 200 or an explicit 503, none hang or error."""
    with running_server(tmp_path, max_batch_size=4, max_queue_depth=8, batch_timeout_ms=5) as server:
        at_capacity = run_closed_loop(f"{server.url}/predict", users=8, seconds=3, warmup_s=1)
        flood = run_closed_loop(f"{server.url}/predict", users=80, seconds=4, warmup_s=1)
        assert flood.failed == 0, flood.errors()
        assert {o.status for o in flood.outcomes} == {200, 503}
        assert len(flood.outcomes) == len(flood.answered) + flood.shed
        assert server.metric("imgserve_rejected_total", reason="queue_full") >= flood.shed
        # The queue bound holds latency: the flood's accepted p90 stays near the p90 at capacity (0.95-1.04x here),
        # where a queue of 1000 reads 8.3x. p90, not p99: one stall of a shared 2-core CI machine moves a p99 (CI
        # read 4x once; here 2.1-2.4x) but not a p90.
        assert flood.latency_ms(0.9) < 4 * at_capacity.latency_ms(0.9)
        assert server.metric("imgserve_queue_depth") == 0


def test_queue_bound_follows_the_batch_size_the_workers_chose(tmp_path) -> None:
    """max_batch_size auto: the workers pick the batch at warm-up, and admission bounds the queue by that batch."""
    with running_server(tmp_path, max_batch_size="auto", max_image_pixels=40_000, workers_per_device=1) as server:
        info = httpx.get(f"{server.url}/info").json()
        assert info["max_batch_size"] > 1
        assert info["max_queue_depth"] == info["max_batch_size"] * info["workers"] * 4
        load = run_closed_loop(f"{server.url}/predict", users=12, seconds=2)
        assert load.failed == 0 and load.shed == 0 and load.answered, load.errors()


def test_deadline_passed_in_queue_is_504_and_never_computed(tmp_path, toy_model) -> None:
    os.environ["TOY_DELAY_S"] = "1.0"
    with running_server(
        tmp_path, max_batch_size=1, batch_timeout_ms=0, workers_per_device=1, **toy_model("Slow")
    ) as server:
        images_before = server.metric("imgserve_batch_size_sum")

        async def scenario() -> tuple[httpx.Response, httpx.Response]:
            async with httpx.AsyncClient(timeout=30) as client:
                first = asyncio.create_task(
                    client.post(f"{server.url}/predict", content=image_bytes(8, 8), headers=PNG)
                )
                await asyncio.to_thread(server.wait_until_computing)  # the first is in predict; the next waits
                late = asyncio.create_task(
                    client.post(
                        f"{server.url}/predict", content=image_bytes(9, 9), headers={**PNG, "X-Request-Timeout": "0.3"}
                    )
                )
                return await first, await late

        first, late = asyncio.run(scenario())
        assert first.status_code == 200
        assert (late.status_code, late.json()["error"]["code"]) == (504, "deadline")
        time.sleep(1.5)  # let the worker reach the expired request
        assert server.metric("imgserve_batch_size_sum") - images_before == 1, "the expired request was computed"
        assert server.metric("imgserve_rejected_total", reason="deadline") >= 1
        assert server.slots_freed(), "the given-up request's slot was not freed when its worker dropped it"


def test_predict_running_past_the_deadline_does_not_hang_its_client(tmp_path, toy_model) -> None:
    os.environ["TOY_DELAY_S"] = "4"
    with running_server(tmp_path, **toy_model("Slow")) as server:
        started = time.perf_counter()
        response = httpx.post(
            f"{server.url}/predict", content=image_bytes(8, 8), headers={**PNG, "X-Request-Timeout": "1"}, timeout=30
        )
        assert response.status_code == 504
        assert time.perf_counter() - started < 3
        # The worker still has the request: its slot must not be reused before the worker is done with it.
        assert server.metric("imgserve_slots_in_use") == 1
        assert server.slots_freed(timeout=15)


def ctrl_c(server: Server) -> None:
    """What a terminal's Ctrl-C does: SIGINT to every process of the server's process group."""
    os.killpg(server.process.pid, signal.SIGINT)


def sigterm(server: Server) -> None:
    """What Kubernetes (through tini) does: SIGTERM to the main process."""
    server.process.send_signal(signal.SIGTERM)


async def posted(client: httpx.AsyncClient, server: Server, count: int) -> list[asyncio.Task]:
    """`count` predictions posted at once, 0.3 s after they left: in flight on a slow model."""
    in_flight = [
        asyncio.create_task(client.post(f"{server.url}/predict", content=image_bytes(8, 8), headers=PNG))
        for _ in range(count)
    ]
    await asyncio.sleep(0.3)
    return in_flight


@pytest.mark.parametrize("stop", [sigterm, ctrl_c])
def test_a_stop_drains_in_flight_requests_then_exits_zero(tmp_path, toy_model, stop) -> None:
    """SIGTERM and Ctrl-C alike: every in-flight request is answered, new ones are refused, nothing is left behind.
    (Ctrl-C reaches every child too: the workers and front ends leave it to the main process.)"""
    os.environ["TOY_DELAY_S"] = "0.7"
    server = start_server(
        {"max_batch_size": 1, "batch_timeout_ms": 0, "drain_timeout_s": 20, **toy_model("Slow")}, tmp_path
    )
    try:
        wait_ready(server)
        children, slots = server.descendants(), server.slot_directory
        assert children

        async def scenario() -> tuple[list[int], int, int]:
            async with httpx.AsyncClient(timeout=30) as client:
                in_flight = await posted(client, server, 4)
                stop(server)
                await asyncio.sleep(0.3)
                ready = (await client.get(f"{server.url}/health/ready")).status_code
                refused = await client.post(f"{server.url}/predict", content=image_bytes(8, 8), headers=PNG)
                return [(await task).status_code for task in in_flight], ready, refused.status_code

        answered, ready, refused = asyncio.run(scenario())
        assert answered == [200, 200, 200, 200]
        assert (ready, refused) == (503, 503)
        assert server.process.wait(timeout=30) == 0
        time.sleep(0.5)
        orphans = [pid for pid in children if os.path.exists(f"/proc/{pid}") and _state(pid) != "Z"]
        assert orphans == [], f"processes left behind: {orphans}"
        assert "Traceback" not in server.log()
        assert not slots.exists(), "the shared-memory slots outlived the server"
    finally:
        stop_server(server)


def test_a_second_ctrl_c_stops_at_once_and_cuts_off_what_is_in_flight(tmp_path, toy_model) -> None:
    """The drain would take 16 x 0.7 s (one worker, one image at a time); a second Ctrl-C ends the server well before
    that, and every client hears back (an answer, or its connection closed), none is left hanging."""
    os.environ["TOY_DELAY_S"] = "0.7"
    settings = {"max_batch_size": 1, "batch_timeout_ms": 0, "drain_timeout_s": 60, "max_queue_depth": 32}
    server = start_server({**settings, "workers_per_device": 1, **toy_model("Slow")}, tmp_path)
    try:
        wait_ready(server)
        children = server.descendants()

        async def scenario() -> tuple[list[object], float]:
            async with httpx.AsyncClient(timeout=30) as client:
                in_flight = await posted(client, server, 16)
                ctrl_c(server)
                await asyncio.sleep(0.3)
                ctrl_c(server)
                stopped_at = time.monotonic()
                outcomes = await asyncio.gather(*in_flight, return_exceptions=True)
                await asyncio.to_thread(server.process.wait, 30)
                return outcomes, time.monotonic() - stopped_at

        outcomes, took_s = asyncio.run(scenario())
        assert server.process.returncode == 0
        assert took_s < 16 * 0.7 / 2, f"a second Ctrl-C took {took_s:.1f} s"
        cut_off = [o for o in outcomes if not isinstance(o, httpx.Response)]
        assert cut_off and all(isinstance(o, httpx.TransportError) for o in cut_off), outcomes
        assert not any(isinstance(o, httpx.TimeoutException) for o in cut_off)
        answered = [o for o in outcomes if isinstance(o, httpx.Response)]
        assert all(o.status_code == 200 for o in answered), answered
        assert "Traceback" not in server.log() and "stopping now, with" in server.log()
        time.sleep(0.5)
        assert [pid for pid in children if os.path.exists(f"/proc/{pid}") and _state(pid) != "Z"] == []
    finally:
        stop_server(server)


def _state(pid: int) -> str:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def test_killed_worker_answers_its_requests_and_is_restarted(tmp_path, toy_model) -> None:
    os.environ["TOY_DELAY_S"] = "3"
    with running_server(tmp_path, workers_per_device=1, **toy_model("Slow")) as server:
        [worker] = server.worker_pids()

        async def scenario() -> httpx.Response:
            async with httpx.AsyncClient(timeout=30) as client:
                task = asyncio.create_task(client.post(f"{server.url}/predict", content=image_bytes(8, 8), headers=PNG))
                await asyncio.sleep(1.0)
                os.kill(worker, signal.SIGKILL)
                return await task

        started = time.perf_counter()
        response = asyncio.run(scenario())
        assert (response.status_code, response.json()["error"]["code"]) == (503, "worker_lost")
        assert time.perf_counter() - started < 3.0, "the client waited for the dead worker's whole batch"
        assert httpx.get(f"{server.url}/health/live").status_code == 200
        wait_ready(server, timeout=60)
        assert server.worker_pids() != [worker]
        os.environ["TOY_DELAY_S"] = "3"
        assert (
            httpx.post(f"{server.url}/predict", content=image_bytes(8, 8), headers=PNG, timeout=30).status_code == 200
        )
        assert server.metric("imgserve_worker_restarts_total") == 1
        assert server.slots_freed(), "the dead worker's slot was not freed"


def test_model_error_fails_only_that_request(tmp_path, toy_model) -> None:
    with running_server(
        tmp_path, max_batch_size=8, batch_timeout_ms=200, workers_per_device=1, **toy_model("Picky")
    ) as server:

        async def scenario() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=30) as client:
                bodies = [WHITE, image_bytes(14, 10), image_bytes(20, 10), WHITE, image_bytes(30, 10)]
                return await asyncio.gather(
                    *(client.post(f"{server.url}/predict", content=body, headers=PNG) for body in bodies)
                )

        statuses = [r.status_code for r in asyncio.run(scenario())]
        assert statuses == [500, 200, 200, 500, 200]
        assert server.metric("imgserve_batch_size_count") < 5, "the requests were not batched together"
        assert server.slots_freed(timeout=2)


def test_out_of_memory_splits_the_batch_and_retries(tmp_path, toy_model) -> None:
    """Uses a model that SIMULATES CUDA OOM on the CPU above batch size 2."""
    settings = {"max_batch_size": 8, "batch_timeout_ms": 200, "pad_mixed_sizes": "true"}
    with running_server(tmp_path, **settings, **toy_model("OutOfMemoryAboveTwo")) as server:
        result = run_closed_loop(f"{server.url}/predict", users=8, seconds=2)
        assert result.failed == 0 and result.shed == 0, result.errors()
        assert server.metric("imgserve_oom_splits_total") >= 1
        assert httpx.get(f"{server.url}/health/ready").status_code == 200


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"model": "/nonexistent/model.pt"}, "model file not found"),
        ({"model": __file__}, "unknown model format"),
        ({"model_factory": "toy_models:BrokenWarmup"}, "failed warm-up"),
    ],
)
def test_unloadable_model_exits_with_a_clear_error(tmp_path, toy_model, settings: dict, message: str) -> None:
    if settings.get("model_factory"):
        settings = toy_model("BrokenWarmup")
    server = start_server(settings, tmp_path)
    try:
        assert server.process.wait(timeout=90) == 2
        lines = server.log().strip().splitlines()
        assert message in lines[-1] and sum(message in line for line in lines) == 1, lines
        assert not any("Traceback" in line for line in lines), lines
    finally:
        stop_server(server)
