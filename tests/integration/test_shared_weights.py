"""One copy of the weights per device: every model format adopts the main process's prepared weights without copying
them, and N workers serving a 256 MiB model cost about one copy of it, measured as PSS of the whole process tree.

The bound: going from 1 to 4 workers may cost at most 0.3 W more than it costs with a 1 MiB model (a private copy
per worker would cost 3 W more). The negative control serves the same model with --no-share-weights and must miss it.
"""

from __future__ import annotations

import hashlib
import io
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from pathlib import Path

import httpx
import numpy as np
import psutil
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file
from serving import Server, image_bytes, running_server
from test_models import _save_formats

from imgserve.api import Request
from imgserve.config import Settings
from imgserve.models.builtin import LocalKinds, ModelAPI
from imgserve.models.denoiser import build_denoiser
from imgserve.models.loader import adopt, load_model
from imgserve.models.shared import prepare
from imgserve.testing import InProcess
from loadtests.lib.closed_loop import run_closed_loop
from loadtests.lib.toy_models import heavy_weights, light_weights

MIB = 2**20
W = 256 * MIB
BOUND = 0.3 * W
HEAVY = "loadtests.lib.toy_models:heavy_weights"
LIGHT = "loadtests.lib.toy_models:light_weights"
PROBE = image_bytes(96, 64)


@pytest.fixture(scope="module")
def formats(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, str]]:
    return {"builtin": {"model": "builtin:denoiser"}, **_save_formats(tmp_path_factory.mktemp("models"))}


@pytest.mark.parametrize(
    "name", ["builtin", "torchscript", "torch.export", "safetensors+factory", "state dict+factory", "pickled, trusted"]
)
def test_every_format_adopts_the_shared_weights_without_a_copy(formats: dict, name: str, tmp_path: Path) -> None:
    args = (formats[name]["model"], formats[name].get("model_factory"), "trust_pickle" in formats[name])
    weights = prepare(load_model(*args), "cpu", ["cpu"], tmp_path, enabled=True, channels_last=True)
    assert weights.shared and weights.path is not None
    private = weights.describe()["private_per_worker"]
    assert (private == "nothing") == (name not in ("torchscript", "torch.export")), private
    mapped = weights.tensors("cpu")
    model = load_model(*args, shared=mapped).to(memory_format=torch.channels_last)  # as the worker's runner does
    storages = {tensor.untyped_storage().data_ptr() for tensor in mapped.values()}
    own = [key for key, tensor in model.state_dict().items() if tensor.untyped_storage().data_ptr() not in storages]
    assert own == [] and model.state_dict(), f"{name}: these are private copies: {own}"
    x = torch.rand(2, 3, 24, 40)
    with torch.inference_mode():
        torch.testing.assert_close(model(x), build_denoiser()(x), atol=1e-5, rtol=0)


class Tied(torch.nn.Module):
    """Two layers sharing one weight tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
        self.b.weight = self.a.weight


def test_tied_weights_stay_one_tensor(tmp_path: Path) -> None:
    weights = prepare(Tied(), "cpu", ["cpu"], tmp_path, enabled=True, channels_last=True)
    with torch.device("meta"):
        model = adopt(Tied(), weights.tensors("cpu"))
    assert model.a.weight.data_ptr() == model.b.weight.data_ptr() and not model.a.weight.is_meta


def test_a_directory_that_cannot_hold_the_weights_means_private_copies_not_a_crash(tmp_path: Path) -> None:
    blocked = tmp_path / "a-file"  # a /dev/shm that cannot be written (here: its model folder cannot be made)
    blocked.write_bytes(b"")
    weights = prepare(build_denoiser(), "cpu", ["cpu"], blocked / "model", enabled=True, channels_last=True)
    assert not weights.shared and "cannot" in weights.describe()["route"]


@pytest.fixture(scope="module")
def weight_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    directory = tmp_path_factory.mktemp("weights")
    files = {}
    for name, build in (("heavy", heavy_weights), ("light", light_weights)):
        files[name] = directory / f"{name}.safetensors"
        save_file(build().state_dict(), str(files[name]))
    return files


def served(weight_file: Path, factory: str, workers: int, **settings: object) -> AbstractContextManager[Server]:
    return running_server(
        model=weight_file, model_factory=factory, workers_per_device=workers, max_batch_size=4, **settings
    )


def settled_pss(server: Server) -> int:
    """The tree's PSS once a few requests went through (every worker read every weight at warm-up already)."""
    with ThreadPoolExecutor(8) as pool:
        assert set(pool.map(lambda _: post_png(server).status_code, range(16))) == {200}
    time.sleep(1)
    return server.tree_pss()


def post_png(server: Server) -> httpx.Response:
    return httpx.post(
        f"{server.url}/predict", params={"format": "png"}, content=PROBE, headers={"Content-Type": "image/png"}
    )


@pytest.fixture(scope="module")
def light_growth(weight_files: dict[str, Path]) -> int:
    """What 3 extra workers cost apart from the weights: PSS at 4 workers less PSS at 1, with the 1 MiB model."""
    pss = {}
    for workers in (1, 4):
        with served(weight_files["light"], LIGHT, workers) as server:
            pss[workers] = settled_pss(server)
    return pss[4] - pss[1]


def one_worker_pss(weight_file: Path, **settings: object) -> int:
    with served(weight_file, HEAVY, 1, **settings) as server:
        return settled_pss(server)


def expected_answer(weight_file: Path) -> np.ndarray:
    """The heavy model run in-process on the probe, as the server runs it: the built-in API's own hooks."""
    settings = Settings(model=str(weight_file), model_factory=HEAVY)
    api = ModelAPI(settings, LocalKinds(), pad=False)
    model = load_model(settings.model[0], settings.model_factory)
    api.model_loader = lambda device: model.to(device)
    running = InProcess(api).setup()
    (answer,) = running.predict([api.decode_request(Request(body=PROBE, content_type="image/png"))])
    return answer


def test_four_workers_hold_one_copy_even_after_a_kill_and_a_load_test(
    weight_files: dict[str, Path], light_growth: int
) -> None:
    one = one_worker_pss(weight_files["heavy"])
    expected = expected_answer(weight_files["heavy"])
    with served(weight_files["heavy"], HEAVY, 4) as server:
        extra = settled_pss(server) - one - light_growth
        print(f"shared: PSS 1 worker {one / MIB:.0f} MiB; 3 more cost {extra / MIB:+.0f} MiB beyond a tiny model's")
        assert extra <= BOUND, f"3 more workers cost {extra / MIB:.0f} MiB beyond a tiny model's"
        weights = Path(httpx.get(f"{server.url}/info").json()["weights"]["route"].split()[-1])
        checksum = hashlib.sha256(weights.read_bytes()).hexdigest()
        before = set(server.worker_pids())
        os.kill(min(before), signal.SIGKILL)
        restarted = server.replaced_worker(before)
        assert str(weights) in Path(f"/proc/{restarted}/maps").read_text(), "the new worker does not map the weights"
        extra = settled_pss(server) - one - light_growth
        assert extra <= BOUND, f"after a restart 3 more workers cost {extra / MIB:.0f} MiB beyond a tiny model's"

        cpu_before = {pid: cpu_seconds(pid) for pid in server.worker_pids()}
        load = run_closed_loop(f"{server.url}/predict", users=8, seconds=120, max_requests=48)
        assert load.failed == 0 and len(load.answered) == 48, load.errors()
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda _: post_png(server), range(32)))
        for answer in answers:
            assert answer.status_code == 200
            np.testing.assert_array_equal(np.asarray(Image.open(io.BytesIO(answer.content))), expected)
        work = {pid: cpu_seconds(pid) - before for pid, before in cpu_before.items()}
        assert min(work.values()) > 0.1 * sum(work.values()) / len(work), f"a worker served nothing: {work}"
        assert hashlib.sha256(weights.read_bytes()).hexdigest() == checksum
        assert server.tree_pss() - one - light_growth <= BOUND, "the load test made private copies of the weights"
    assert not weights.parent.exists(), "the server left its weights in /dev/shm"


def test_negative_control_private_copies_miss_the_bound(weight_files: dict[str, Path], light_growth: int) -> None:
    one = one_worker_pss(weight_files["heavy"], share_weights="false")
    with served(weight_files["heavy"], HEAVY, 4, share_weights="false") as server:
        extra = settled_pss(server) - one - light_growth
    print(f"private: PSS 1 worker {one / MIB:.0f} MiB; 3 more cost {extra / MIB:+.0f} MiB beyond a tiny model's")
    assert extra > BOUND, "the test cannot tell private copies from shared weights"
    assert extra > 2 * W, f"3 private copies should cost about 3 W, not {extra / MIB:.0f} MiB"


def test_a_front_end_keeps_sharing_what_it_inherited_under_concurrent_load() -> None:
    """A forked front end shares the main process's Python objects until it writes to their pages; its first full
    garbage collection used to write to all of them (~50 MiB copied per front end)."""
    with running_server(api_servers=1) as server:
        [front_end] = (psutil.Process(pid) for pid in server.front_end_pids().values())
        post_png(server)
        before = front_end.memory_full_info().uss
        for _ in range(4):
            with ThreadPoolExecutor(4) as pool:
                assert set(pool.map(lambda _: post_png(server).status_code, range(32))) == {200}
        grown = front_end.memory_full_info().uss - before
    assert grown < 16 * MIB, f"the front end copied {grown / MIB:.0f} MiB of what it shares with the main process"


def test_a_worker_that_does_not_compile_holds_little_memory_of_its_own() -> None:
    """Workers fork from a fork server that holds torch and the built-in model's modules, shared: a worker's own
    memory (USS) is what its set-up adds. torch's compiler, imported by every worker when only a compiled model needs
    it, added about 100 MiB to each (123 MiB against 20)."""
    with running_server() as server:
        post_png(server)
        own = {pid: psutil.Process(pid).memory_full_info().uss for pid in server.worker_pids()}
    assert own and max(own.values()) < 48 * MIB, {pid: f"{uss / MIB:.0f} MiB" for pid, uss in own.items()}


def cpu_seconds(pid: int) -> float:
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


def test_info_and_metrics_say_what_the_weights_cost_and_what_each_worker_may_batch() -> None:
    with running_server(workers_per_device=2) as server:
        info = httpx.get(f"{server.url}/info").json()
        available = psutil.virtual_memory().available
        assert info["weights"]["shared"] and info["workers_per_device"] == 2, info
        assert server.metric("imgserve_model_weight_bytes", device="cpu") == info["weights"]["bytes"] > 0
        budget = info["batch_memory_budget_bytes_per_worker"]
        # The two workers together stay within the fraction (each used to plan for all of it).
        assert 0 < 2 * budget <= 1.05 * 0.8 * available, (budget, available)
