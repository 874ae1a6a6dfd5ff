"""imgserve's guarantees hold for a user's own ImageAPI (tests/support/user_apis.py), with real servers: a flood is
shed with 503 and Retry-After, a deadline passed in the queue is 504 and never reaches `predict`, SIGTERM and Ctrl-C
answer what is in flight and exit 0, a worker killed mid-batch answers its requests and is restarted; the API's
errors are its requests' answers (its status, or a one-line 500 with the traceback logged once) and never the
worker's end; an `--api` that cannot be served is one line and exit 2. (Memory, metrics, the Open Inference
Protocol and shared weights: test_user_api_serving.py.)"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from serving import SOURCE, SUPPORT, Server, image_bytes, running_server, start_server, stop_server, wait_ready
from user_apis import recorded

from imgserve.testing import free_port

PNG = {"Content-Type": "image/png"}
IMAGE = image_bytes(16, 12)


async def post(client: httpx.AsyncClient, server: Server, tag: str, **headers: str) -> httpx.Response:
    """One image to /predict, tagged (user_apis reads the tag from the query)."""
    return await client.post(f"{server.url}/predict", params={"tag": tag}, content=IMAGE, headers={**PNG, **headers})


def post_now(server: Server, tag: str) -> httpx.Response:
    return httpx.post(f"{server.url}/predict", params={"tag": tag}, content=IMAGE, headers=PNG, timeout=30)


@pytest.fixture
def calls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The file the APIs' predict appends the tags it computed to (the servers inherit the variable)."""
    path = tmp_path / "calls"
    monkeypatch.setenv("USER_API_CALLS", str(path))
    return path


def test_a_flood_is_shed_with_503_and_retry_after_and_only_admitted_work_is_computed(
    tmp_path: Path, calls: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """40 requests at once on a queue of 4: most are refused at once with the retry advice, none waits without end,
    and what was refused never reaches the API's predict."""
    monkeypatch.setenv("USER_API_DELAY_S", "0.3")
    settings = {"max_batch_size": 2, "batch_timeout_ms": 0, "workers_per_device": 1, "max_queue_depth": 4}
    with running_server(tmp_path, api="user_apis:Slow", **settings) as server:

        async def flood() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=30) as client:
                return await asyncio.gather(*(post(client, server, f"r{i}") for i in range(40)))

        responses = asyncio.run(flood())
        ok = {r.request.url.params["tag"] for r in responses if r.status_code == 200}
        shed = [r for r in responses if r.status_code == 503]
        assert len(ok) + len(shed) == 40, [r.status_code for r in responses]
        assert 0 < len(ok) < 20, f"{len(ok)} of 40 admitted on a queue of 4"
        assert all(r.json()["error"]["code"] == "queue_full" and r.headers["Retry-After"] == "1" for r in shed)
        assert server.metric("imgserve_rejected_total", reason="queue_full") == len(shed)
        assert set(recorded(calls)) == ok, "a refused request reached predict"
        assert server.metric("imgserve_queue_depth") == 0 and server.slots_freed()


def test_a_deadline_passed_in_the_queue_is_504_and_never_reaches_predict(
    tmp_path: Path, calls: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("USER_API_DELAY_S", "1.0")
    settings = {"max_batch_size": 1, "batch_timeout_ms": 0, "workers_per_device": 1}
    with running_server(tmp_path, api="user_apis:Slow", **settings) as server:

        async def scenario() -> tuple[httpx.Response, httpx.Response]:
            async with httpx.AsyncClient(timeout=30) as client:
                first = asyncio.create_task(post(client, server, "first"))
                await asyncio.to_thread(server.wait_until_computing)  # the first is in predict; the next waits
                late = asyncio.create_task(post(client, server, "late", **{"X-Request-Timeout": "0.3"}))
                return await first, await late

        first, late = asyncio.run(scenario())
        assert first.status_code == 200
        assert (late.status_code, late.json()["error"]["code"]) == (504, "deadline")
        time.sleep(1.5)  # the worker is free again and has taken the expired request off the queue
        assert recorded(calls) == ["first"], "the expired request reached predict"
        assert server.metric("imgserve_rejected_total", reason="deadline") == 1
        assert server.slots_freed(), "the given-up request's slot was not freed"


def sigterm(server: Server) -> None:
    """What Kubernetes does: SIGTERM to the main process."""
    server.process.send_signal(signal.SIGTERM)


def ctrl_c(server: Server) -> None:
    """What a terminal's Ctrl-C does: SIGINT to every process of the server's process group."""
    os.killpg(server.process.pid, signal.SIGINT)


@pytest.mark.parametrize("stop", [sigterm, ctrl_c])
def test_a_stop_answers_every_request_in_flight_then_exits_zero(
    tmp_path: Path, calls: Path, monkeypatch: pytest.MonkeyPatch, stop: Callable[[Server], None]
) -> None:
    monkeypatch.setenv("USER_API_DELAY_S", "0.7")
    settings = {"api": "user_apis:Slow", "max_batch_size": 1, "batch_timeout_ms": 0, "drain_timeout_s": 20}
    server = start_server(settings, tmp_path)
    try:
        wait_ready(server)

        async def scenario() -> tuple[list[int], int, int]:
            async with httpx.AsyncClient(timeout=30) as client:
                in_flight = [asyncio.create_task(post(client, server, f"r{i}")) for i in range(4)]
                await asyncio.sleep(0.3)
                stop(server)
                await asyncio.sleep(0.3)
                ready = (await client.get(f"{server.url}/health/ready")).status_code
                refused = (await post(client, server, "after")).status_code
                return [(await task).status_code for task in in_flight], ready, refused

        answered, ready, refused = asyncio.run(scenario())
        assert answered == [200] * 4
        assert (ready, refused) == (503, 503)
        assert server.process.wait(timeout=30) == 0
        assert sorted(recorded(calls)) == ["r0", "r1", "r2", "r3"]
        assert "Traceback" not in server.log()
    finally:
        stop_server(server)


def test_a_worker_killed_mid_batch_answers_its_requests_and_is_restarted(
    tmp_path: Path, calls: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("USER_API_DELAY_S", "3")
    settings = {"max_batch_size": 2, "batch_timeout_ms": 300, "workers_per_device": 1}
    with running_server(tmp_path, api="user_apis:Slow", **settings) as server:
        [worker] = server.worker_pids()

        async def scenario() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=30) as client:
                batch = [asyncio.create_task(post(client, server, tag)) for tag in ("a", "b")]
                await asyncio.sleep(1.0)
                assert sorted(recorded(calls)) == ["a", "b"], "the two requests are not in predict together"
                os.kill(worker, signal.SIGKILL)
                return list(await asyncio.gather(*batch))

        started = time.perf_counter()
        answers = asyncio.run(scenario())
        assert [(r.status_code, r.json()["error"]["code"]) for r in answers] == [(503, "worker_lost")] * 2
        assert time.perf_counter() - started < 3.0, "the clients waited for the dead worker's whole batch"
        assert server.replaced_worker({worker}) != worker
        assert post_now(server, "after").status_code == 200
        assert server.metric("imgserve_worker_restarts_total") == 1
        assert server.slots_freed(), "the dead worker's slots were not freed"


@pytest.fixture(scope="module")
def faulty(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """One worker serving user_apis.Faulty, batching what arrives within 200 ms."""
    settings = {"max_batch_size": 8, "batch_timeout_ms": 200, "workers_per_device": 1}
    with running_server(tmp_path_factory.mktemp("faulty"), api="user_apis:Faulty", **settings) as server:
        yield server


@pytest.fixture(scope="module")
def first_worker(faulty: Server) -> list[int]:
    """The worker Faulty's server started with (taken before the first failure)."""
    return faulty.worker_pids()


def assert_survived(server: Server, worker: list[int]) -> None:
    """The same worker as at start, ready, and answering."""
    assert server.worker_pids() == worker
    assert httpx.get(f"{server.url}/health/ready").status_code == 200
    assert post_now(server, "fine").status_code == 200


@pytest.mark.parametrize(
    ("tag", "status", "error"),
    [
        ("teapot", 418, {"code": "teapot", "message": "this API only brews tea"}),
        ("litserve-http", 403, {"code": "forbidden", "message": "not for this API"}),
        ("starlette-http", 409, {"code": "conflict", "message": "a conflict in the API"}),
    ],
)
def test_an_api_error_or_http_exception_answers_its_status(
    faulty: Server, first_worker: list[int], tag: str, status: int, error: dict
) -> None:
    log_before = faulty.log()
    response = post_now(faulty, tag)
    assert (response.status_code, response.json()) == (status, {"error": error})
    assert faulty.log()[len(log_before) :].count("Traceback") == 0, "the API's answer was logged as a failure"
    assert_survived(faulty, first_worker)


@pytest.mark.parametrize(
    ("tag", "message", "raised"),
    [
        ("decode-error", "decode_request failed: ValueError: cannot read this one", "ValueError: cannot read"),
        (
            "encode-error",
            "encode_response failed: KeyError: 'no such field in the answer'",
            "KeyError: 'no such field in the answer'",
        ),
    ],
)
def test_any_other_exception_in_decode_or_encode_is_a_one_line_500_logged_once(
    faulty: Server, first_worker: list[int], tag: str, message: str, raised: str
) -> None:
    log_before = faulty.log()
    response = post_now(faulty, tag)
    assert (response.status_code, response.json()) == (500, {"error": {"code": "api_error", "message": message}})
    assert "\n" not in response.text
    logged = faulty.log()[len(log_before) :]
    assert logged.count("Traceback") == 1 and logged.count(raised) == 1, logged
    assert_survived(faulty, first_worker)


def test_an_exception_in_predict_fails_only_the_inputs_it_fails_on(faulty: Server, first_worker: list[int]) -> None:
    batches_before = faulty.metric("imgserve_batch_size_count")

    async def scenario() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=30) as client:
            tags = ["predict-error", "a", "b", "predict-error", "c"]
            return await asyncio.gather(*(post(client, faulty, tag) for tag in tags))

    answers = asyncio.run(scenario())
    assert [r.status_code for r in answers] == [500, 200, 200, 500, 200]
    assert [r.json()["tag"] for r in answers if r.status_code == 200] == ["a", "b", "c"]
    message = "predict failed: ValueError: the model cannot compute a predict-error"
    assert all(r.json() == {"error": {"code": "api_error", "message": message}} for r in answers[::3])
    assert faulty.metric("imgserve_batch_size_count") - batches_before < 5, "the requests were not batched together"
    assert_survived(faulty, first_worker)


def test_a_predict_returning_the_wrong_number_of_outputs_is_a_500_with_a_clear_log_line(
    faulty: Server, first_worker: list[int]
) -> None:
    log_before = faulty.log()
    response = post_now(faulty, "short")
    message = "predict returned 0 outputs for a batch of 1: unbatch gives one each"
    assert (response.status_code, response.json()) == (500, {"error": {"code": "api_error", "message": message}})
    lines = faulty.log()[len(log_before) :].splitlines()
    assert [line for line in lines if message in line and "ERROR" in line] and len(lines) == 1, lines
    assert_survived(faulty, first_worker)


def serve_api(api: str) -> subprocess.CompletedProcess:
    """`imgserve serve --api API` as a user runs it, expected to stop before it listens."""
    port = str(free_port())  # a failing setup binds it before the workers start
    command = [sys.executable, "-m", "imgserve", "serve", "--host", "127.0.0.1", "--port", port, "--api", api]
    env = {k: v for k, v in os.environ.items() if not k.startswith("IMGSERVE_") and k != "PROMETHEUS_MULTIPROC_DIR"}
    env["PYTHONPATH"] = os.pathsep.join([str(SOURCE), str(SUPPORT)])
    return subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)


@pytest.mark.parametrize(
    ("api", "message"),
    [
        ("nosuchmodule:X", "cannot import --api nosuchmodule:X: ModuleNotFoundError: No module named 'nosuchmodule'"),
        ("os:path", "--api os:path is a module, not an imgserve.ImageAPI or litserve.LitAPI"),
        (
            "user_apis:NoSuchClass",
            "cannot import --api user_apis:NoSuchClass: AttributeError: module 'user_apis' has no attribute "
            "'NoSuchClass'",
        ),
        (
            "user_apis:FailsToConstruct",
            "--api user_apis:FailsToConstruct: FailsToConstruct() failed: RuntimeError: no configuration found for "
            "this API",
        ),
        ("notcolon", "--api must look like module:Class, got 'notcolon'"),
    ],
)
def test_an_api_that_cannot_be_built_is_one_line_and_exit_2(api: str, message: str) -> None:
    result = serve_api(api)
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and result.stderr.endswith(f"imgserve: {message}\n"), result.stderr


def test_an_api_whose_setup_raises_ends_the_start_with_its_reason_once_and_exit_2() -> None:
    """The workers' failure: its reason is the last line, said once, without a traceback."""
    result = serve_api("user_apis:FailsInSetup")
    reason = "imgserve: the API's setup failed on cpu: RuntimeError: the checkpoint for this API is missing"
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines()[-1].endswith(reason), result.stderr
    output = result.stdout + result.stderr
    assert output.count("the checkpoint for this API is missing") == 1 and "Traceback" not in output, output
