"""Loading and unloading models while serving (--model-control explicit), through the Open Inference Protocol's
repository extension as Triton's users call it (tritonclient over HTTP and gRPC): the other models keep answering,
an unload gives its weights' memory back, a load that cannot be done answers with its reason, and one device's memory
bounds the models loaded together."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from repositories import HEAVY_MIB, heavy_model, write_repository
from serving import SOURCE, SUPPORT, image_bytes, running_server, wait_until
from tritonclient.utils import InferenceServerException

from imgserve.testing import free_port

PNG = {"Content-Type": "image/png"}
IMAGE = image_bytes(32, 24)


def models(tmp_path: Path) -> Path:
    """A near-free model that keeps answering, a heavy one to load and unload, one whose setup fails."""
    root = tmp_path / "models"
    return write_repository(
        root,
        {
            "tagged": {"api": "user_apis:Tagged", "api_path": "/tagged"},
            "heavy": heavy_model(root / "heavy"),
            "broken": {"api": "user_apis:FailsInSetup", "api_path": "/broken"},
        },
    )


def states(client: httpclient.InferenceServerClient) -> dict[str, str]:
    return {model["name"]: model["state"] for model in client.get_model_repository_index()}


def test_load_and_unload_over_http_and_grpc_while_the_others_serve(tmp_path: Path) -> None:
    settings = {"model_repository": models(tmp_path), "model_control": "explicit", "load_model": "tagged"}
    with running_server(tmp_path, grpc_port=free_port(), workers_per_device=1, **settings) as server:
        http = httpclient.InferenceServerClient(server.address)
        grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
        assert states(http) == {"tagged": "READY", "heavy": "UNAVAILABLE", "broken": "UNAVAILABLE"}
        answers: list[tuple[int, float]] = []
        done = threading.Event()

        def keep_asking() -> None:
            with httpx.Client(timeout=30) as client:
                while not done.is_set():
                    started = time.monotonic()
                    status = client.post(f"{server.url}/tagged", content=IMAGE, headers=PNG).status_code
                    answers.append((status, time.monotonic() - started))

        asking = threading.Thread(target=keep_asking)
        asking.start()
        try:
            before = server.tree_pss()
            http.load_model("heavy")
            assert states(http)["heavy"] == "READY" and http.is_model_ready("heavy")
            assert httpx.post(f"{server.url}/heavy/predict", content=IMAGE, headers=PNG).status_code == 200
            loaded = server.tree_pss()
            grpc.unload_model("heavy")
            assert grpc.get_model_repository_index(as_json=True)["models"][1]["state"] == "UNAVAILABLE"
            assert httpx.post(f"{server.url}/heavy/predict", content=IMAGE, headers=PNG).status_code == 404
            unloaded = server.tree_pss()
            grpc.load_model("heavy")
            assert grpc.is_model_ready("heavy")
        finally:
            done.set()
            asking.join(timeout=30)
        print(f"PSS MiB: {before >> 20} before, {loaded >> 20} loaded, {unloaded >> 20} unloaded")
        assert loaded - unloaded > 0.6 * (HEAVY_MIB << 20), "the unload did not give the weights' memory back"
        assert answers and {status for status, _ in answers} == {200}, "the other model was disturbed"
        assert max(seconds for _, seconds in answers) < 5.0, "the other model paused"


def test_a_load_that_fails_answers_with_its_reason_and_the_others_serve(tmp_path: Path) -> None:
    settings = {"model_repository": models(tmp_path), "model_control": "explicit", "load_model": "tagged"}
    with running_server(tmp_path, grpc_port=free_port(), **settings) as server:
        http = httpclient.InferenceServerClient(server.address)
        with pytest.raises(InferenceServerException, match="the checkpoint for this API is missing"):
            http.load_model("broken")
        index = {model["name"]: model for model in http.get_model_repository_index()}
        assert index["broken"]["state"] == "UNAVAILABLE" and "checkpoint" in index["broken"]["reason"]
        assert httpx.post(f"{server.url}/tagged", content=IMAGE, headers=PNG).status_code == 200
        grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
        with pytest.raises(InferenceServerException, match="no such model"):
            grpc.load_model("nowhere")


def test_without_explicit_control_every_model_is_loaded_and_the_calls_say_control_is_off(tmp_path: Path) -> None:
    repository = write_repository(
        tmp_path / "models",
        {"tagged": {"api": "user_apis:Tagged", "api_path": "/tagged"}, "denoiser": {"model": "builtin:denoiser"}},
    )
    with running_server(tmp_path, model_repository=repository) as server:
        http = httpclient.InferenceServerClient(server.address)
        assert states(http) == {"tagged": "READY", "denoiser": "READY"}
        for call in (http.load_model, http.unload_model):
            with pytest.raises(InferenceServerException, match="model control is off"):
                call("tagged")
        assert http.is_model_ready("tagged")


def test_an_unload_answers_the_models_admitted_requests_first(tmp_path: Path) -> None:
    os.environ["USER_API_DELAY_S"] = "1.0"
    repository = write_repository(tmp_path / "models", {"slow": {"api": "user_apis:Slow", "api_path": "/slow"}})
    settings = {"model_repository": repository, "model_control": "explicit", "load_model": "*"}
    try:
        with running_server(tmp_path, **settings) as server:
            statuses: list[int] = []
            asked = [
                threading.Thread(
                    target=lambda: statuses.append(
                        httpx.post(f"{server.url}/slow", content=IMAGE, headers=PNG, timeout=30).status_code
                    )
                )
                for _ in range(3)
            ]
            for thread in asked:
                thread.start()
            wait_until(lambda: server.metric("imgserve_queue_depth") == 3, 10, "three requests admitted")
            httpclient.InferenceServerClient(server.address).unload_model("slow")
            assert sorted(statuses) == [200, 200, 200], "an admitted request was not answered before the unload"
            for thread in asked:
                thread.join()
    finally:
        os.environ.pop("USER_API_DELAY_S", None)


def test_models_that_do_not_fit_one_device_stop_the_start_or_refuse_the_load_with_the_numbers(tmp_path: Path) -> None:
    root = tmp_path / "models"
    repository = write_repository(
        root, {"heavy": heavy_model(root / "heavy"), "denoiser": {"model": "builtin:denoiser"}}
    )
    command = [sys.executable, "-m", "imgserve", "serve", "--host", "127.0.0.1", "--port", str(free_port())]
    env = {key: value for key, value in os.environ.items() if not key.startswith("IMGSERVE_")}
    env["PYTHONPATH"] = os.pathsep.join([str(SUPPORT), str(SOURCE)])
    tiny = ["--gpu-memory-fraction", "0.0001", "--grpc-port", "0", "--model-repository", str(repository)]
    result = subprocess.run([*command, *tiny], capture_output=True, text=True, timeout=180, env=env)
    last = result.stderr.strip().splitlines()[-1]
    assert result.returncode == 2, result.stderr
    assert "do not fit on cpu" in last and f"heavy {HEAVY_MIB} MiB weights" in last and "budget is" in last, last
    assert "Traceback" not in result.stderr
