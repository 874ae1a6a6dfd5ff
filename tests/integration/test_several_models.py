"""Several models in one server, as users name them (a model repository, repeated --api, imgserve.serve([...])): each
at its own path and under its own name, one catalog in every process, batches that never mix models, per-model
metrics and /info, and the mistakes (two models on one name or one path) stopped in one line."""

from __future__ import annotations

import functools
import os
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from repositories import write_repository
from serving import SOURCE, SUPPORT, image_bytes, running_server
from user_apis import recorded

from imgserve.testing import free_port
from loadtests.lib.closed_loop import LoadResult, run_closed_loop
from loadtests.lib.images import square_jpegs

PNG = {"Content-Type": "image/png"}
IMAGE = image_bytes(32, 24)


def repository(tmp_path: Path) -> Path:
    """Two built-in models, a user's ImageAPI at its own path and a plain LitAPI at its own."""
    return write_repository(
        tmp_path / "models",
        {
            "denoiser": {"model": "builtin:denoiser"},
            "second": {"model": "builtin:denoiser", "max_batch_size": 2},
            "tagged": {"api": "user_apis:Tagged", "api_path": "/tagged"},
            "pipeline": {"api": "examples.litserve_api:InferencePipeline", "api_path": "/pipeline"},
        },
    )


def test_each_model_answers_at_its_path_and_under_its_name(tmp_path: Path) -> None:
    with running_server(tmp_path, model_repository=repository(tmp_path), grpc_port=free_port()) as server:
        for name in ("denoiser", "second"):
            answer = httpx.post(f"{server.url}/{name}/predict", content=IMAGE, headers=PNG, timeout=30)
            assert (answer.status_code, answer.headers["content-type"]) == (200, "image/jpeg"), answer.text
        tagged = httpx.post(f"{server.url}/tagged?tag=one", content=IMAGE, headers=PNG, timeout=30)
        assert tagged.json()["tag"] == "one"
        assert httpx.post(f"{server.url}/pipeline", json={"input": 4.0}).json() == {"output": 80.0}
        assert httpx.post(f"{server.url}/predict", content=IMAGE, headers=PNG).status_code == 404  # no model there
        client = httpclient.InferenceServerClient(server.address)
        assert {model["name"] for model in client.get_model_repository_index()} == {
            "denoiser",
            "second",
            "tagged",
            "pipeline",
        }
        assert client.get_model_metadata("second")["name"] == "second"
        assert client.get_model_config("second")["max_batch_size"] == 2
        grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
        assert grpc.is_model_ready("tagged") and grpc.get_model_metadata("denoiser").name == "denoiser"
        info = httpx.get(f"{server.url}/info").json()
        described = {model["name"]: model for model in info["models"]}
        assert described["tagged"]["path"] == "/tagged" and described["second"]["max_batch_size"] == 2
        assert {model["state"] for model in info["models"]} == {"READY"}
        assert server.metric("imgserve_requests_total", model="second", code="200") >= 1
        assert server.metric("imgserve_batch_size_count", model="tagged") == 1
        assert server.metric("imgserve_model_info", model="pipeline", source="examples.litserve_api.InferencePipeline")


def test_batches_never_mix_models(tmp_path: Path) -> None:
    """Two models of the same API, each recording the tags of every batch it runs: each batch holds one model's."""
    batches = tmp_path / "batches"
    os.environ["USER_API_BATCHES"] = str(batches)
    models = {
        "left": {"api": "user_apis:Slow", "api_path": "/left", "max_batch_size": 8, "batch_timeout_ms": 200},
        "right": {"api": "user_apis:Slow", "api_path": "/right", "max_batch_size": 8, "batch_timeout_ms": 200},
    }
    sides = ["left", "right"] * 6
    try:
        repository = write_repository(tmp_path / "m", models)
        with running_server(tmp_path, model_repository=repository) as server, httpx.Client(timeout=30) as client:

            def post(i: int) -> int:
                return client.post(f"{server.url}/{sides[i]}?tag={sides[i]}{i}", content=IMAGE, headers=PNG).status_code

            with ThreadPoolExecutor(12) as pool:
                assert set(pool.map(post, range(12))) == {200}
    finally:
        os.environ.pop("USER_API_BATCHES", None)
    made = [line.split() for line in recorded(batches)]
    assert sorted(tag for batch in made for tag in batch) == sorted(f"{side}{i}" for i, side in enumerate(sides))
    assert all(len({tag.rstrip("0123456789") for tag in batch}) == 1 for batch in made), made
    assert max(len(batch) for batch in made) > 1, "nothing was batched"


def test_a_flood_of_one_model_delays_the_others_requests_by_one_of_its_batches_at_most(tmp_path: Path) -> None:
    """A retry storm on one model (64 users resending at once, far past its own queue bound: 503s for it, and its
    queue never empty) takes the workers in turns with the other model's requests, which wait one of its batches at
    most, not behind its whole queue: each of the other's requests, its own batches twice as long as the flooded
    model's, is answered within twice its quiet median. The flood's images share one size, so each of its batches is
    one `predict` (a batch of mixed sizes runs one per size, and the other model then waits all of them)."""
    os.environ["USER_API_DELAY_S"] = "0.2"  # long beside the machine's own CPU work for a request
    batching = {"max_batch_size": 4, "batch_timeout_ms": 5}
    models = {
        "flooded": {"api": "user_apis:HalfSlow", "api_path": "/flooded", **batching},
        "quiet": {"api": "user_apis:Slow", "api_path": "/quiet", **batching},
    }
    try:
        repository = write_repository(tmp_path / "m", models)
        with running_server(tmp_path, model_repository=repository) as server, httpx.Client(timeout=30) as client:

            def latencies_s(count: int = 10) -> list[float]:
                times = []
                for _ in range(count):
                    started = time.monotonic()
                    assert client.post(f"{server.url}/quiet", content=IMAGE, headers=PNG).status_code == 200
                    times.append(time.monotonic() - started)
                return times

            alone = statistics.median(latencies_s())
            flood: list[LoadResult] = []
            storm = functools.partial(run_closed_loop, images=square_jpegs(64), retry_at_once=True)
            flooding = threading.Thread(target=lambda: flood.append(storm(f"{server.url}/flooded", 64, seconds=8)))
            flooding.start()
            time.sleep(1.5)
            crowded = latencies_s()
            flooding.join(timeout=60)
            assert server.metric("imgserve_rejected_total", reason="queue_full", model="quiet") == 0
        print(
            f"the quiet model's latency: median {1000 * alone:.0f} ms alone, at most {1000 * max(crowded):.0f} ms "
            "beside the flood"
        )
        assert max(crowded) <= 2 * alone, (alone, crowded)
        codes = {outcome.status for outcome in flood[0].outcomes}
        assert 503 in codes and codes <= {200, 503}, "the flooded model was not shed by its own queue bound"
    finally:
        os.environ.pop("USER_API_DELAY_S", None)


def test_eight_small_models_cost_little_more_memory_than_one(tmp_path: Path) -> None:
    """Several models share a server's processes (on a GPU, its CUDA context): eight near-free models, each warm,
    cost the summed PSS of one plus little, not eight servers' (loadtests/models_memory.py measures the table)."""

    def settled_pss(count: int) -> int:
        models = {f"m{index}": {"api": "user_apis:Tagged", "api_path": f"/m{index}"} for index in range(count)}
        repository = write_repository(tmp_path / f"r{count}", models)
        with running_server(tmp_path, model_repository=repository, workers_per_device=1, api_servers=1) as server:
            for index in range(2 * count):
                assert httpx.post(f"{server.url}/m{index % count}", content=IMAGE, headers=PNG).status_code == 200
            time.sleep(1)
            return server.tree_pss()

    one, eight = settled_pss(1), settled_pss(8)
    print(f"summed PSS: {one >> 20} MiB with one model, {eight >> 20} MiB with eight")
    assert eight < 1.25 * one, (one, eight)


def failed_start(*flags: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "imgserve", "serve", "--host", "127.0.0.1", "--port", str(free_port()), *flags]
    env = {key: value for key, value in os.environ.items() if not key.startswith("IMGSERVE_")}
    env["PYTHONPATH"] = os.pathsep.join([str(SUPPORT), str(SOURCE)])
    return subprocess.run([*command, "--grpc-port", "0"], capture_output=True, text=True, timeout=120, env=env)


def test_two_models_on_one_name_or_one_path_stop_the_start_in_one_line(tmp_path: Path) -> None:
    same_name = failed_start("--api", "user_apis:Tagged", "--api", "user_apis:Slow", "--model-name", "x")
    assert same_name.returncode == 2 and "--model-name names the one model" in same_name.stderr.strip().splitlines()[-1]
    twice = failed_start("--api", "user_apis:Tagged", "--api", "user_apis:Tagged")
    assert twice.returncode == 2 and twice.stderr.strip().splitlines()[-1].endswith(
        "imgserve: two models are named 'Tagged': each model's name must be its own"
    )
    one_path = failed_start("--api", "user_apis:Tagged", "--api", "user_apis:Slow")
    assert one_path.returncode == 2 and one_path.stderr.strip().splitlines()[-1].endswith(
        "imgserve: models Tagged, Slow are all at /predict: give each its own api_path"
    )
    assert "Traceback" not in twice.stderr + one_path.stderr


def test_load_model_without_explicit_control_is_refused(tmp_path: Path) -> None:
    """--load-model applies to explicit control only: without it every model is loaded, so naming some is a mistake."""
    repository = write_repository(tmp_path / "models", {"tagged": {"api": "user_apis:Tagged"}})
    refused = failed_start("--model-repository", str(repository), "--load-model", "tagged")
    expected = "imgserve: --load-model names the models to load at start with --model-control explicit"
    assert refused.returncode == 2 and refused.stderr.strip().splitlines()[-1].endswith(expected), refused.stderr


def test_imgserve_serve_takes_a_list_of_apis_as_litserve_does(tmp_path: Path) -> None:
    """`imgserve.serve([A(), B()])`: each API at its own api_path."""
    port = free_port()
    script = (
        "import imgserve, user_apis; "
        "imgserve.serve([user_apis.Tagged(api_path='/a'), user_apis.Slow(api_path='/b')], host='127.0.0.1', "
        f"port={port}, grpc_port=0, api_servers=1, workers_per_device=1)"
    )
    env = {key: value for key, value in os.environ.items() if not key.startswith(("IMGSERVE_", "PROMETHEUS"))}
    env["PYTHONPATH"] = os.pathsep.join([str(SUPPORT), str(SOURCE)])
    env["USER_API_DELAY_S"] = "0"
    from imgserve.testing import start, stop, wait_ready

    server = start([sys.executable, "-c", script], port, tmp_path / "serve.log", env)
    try:
        wait_ready(server, 120)
        assert httpx.post(f"{server.url}/a?tag=x", content=IMAGE, headers=PNG).json()["tag"] == "x"
        assert httpx.post(f"{server.url}/b?tag=y", content=IMAGE, headers=PNG).json()["tag"] == "y"
        names = {model["name"] for model in httpx.get(f"{server.url}/info").json()["models"]}
        assert names == {"Tagged", "Slow"}
    finally:
        stop(server)
