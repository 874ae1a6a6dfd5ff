"""Compiled models: --compile compiles the built-in model before it is ready, for every batch size and thread count a
worker runs, and keeps the compiled code in a private directory a restart reuses; an AOTInductor package is served
only with --trust-native-code. Real torch.compile and aoti_compile_and_package runs (a C++ compiler is on the host)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from serving import SOURCE, SUPPORT, Server, free_port, image_bytes, start_server, stop_server, wait_ready
from torch import nn

from imgserve.config import Settings
from imgserve.models import compiled
from imgserve.models.builtin import LocalKinds, ModelAPI
from imgserve.models.loader import ModelLoadError, load_model
from imgserve.testing import InProcess

pytestmark = pytest.mark.timeout(900)  # a first compile takes minutes on a busy 2-core machine
SIDE = 32
READY_S = 600
CACHED = re.compile(r"(\d+) graphs, (\d+) of them from the cache")
FROZEN = re.compile(r"frozen into a package, (made|found in the cache)")


class SmallNet(nn.Module):
    """A small CNN classifier of fixed-size input: quick to compile, big enough to have kernels to fuse."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3))
        self.head = nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).relu().mean(dim=(2, 3)))


def seeded_net() -> SmallNet:
    torch.manual_seed(0)
    return SmallNet().eval()


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The same seeded SmallNet as a torch.export program (dynamic batch), as an AOTInductor package of it, and as
    TorchScript."""
    directory = tmp_path_factory.mktemp("models")
    net = seeded_net()
    example = (torch.rand(2, 3, SIDE, SIDE),)
    program = torch.export.export(net, example, dynamic_shapes={"x": {0: torch.export.Dim("batch", min=1, max=16)}})
    paths = {"export": directory / "net.pt2", "native": directory / "net_native.pt2", "script": directory / "net.ts"}
    torch.export.save(program, str(paths["export"]))
    native = {"aot_inductor.check_lowerbound": False}  # else the package refuses a batch of one (docs/models.md)
    torch._inductor.aoti_compile_and_package(program, package_path=str(paths["native"]), inductor_configs=native)
    torch.jit.save(torch.jit.script(net), str(paths["script"]))
    return paths


@contextlib.contextmanager
def served(settings: dict[str, object], log_dir: Path) -> Iterator[Server]:
    server = start_server({"input_size": SIDE, **settings}, log_dir)
    try:
        wait_ready(server, READY_S)
        yield server
    finally:
        stop_server(server)


def scores(server: Server, data: bytes) -> list[tuple[int, float]]:
    response = httpx.post(f"{server.url}/predict", content=data, headers={"Content-Type": "image/png"}, timeout=60)
    assert response.status_code == 200, response.text
    return [(item["index"], item["score"]) for item in response.json()["top_k"]]


def assert_same_answers(answers: list[list[tuple[int, float]]], atol: float) -> None:
    """The eager server's top classes (the first answer) are every compiled server's, its scores the first compiled
    one's within `atol`."""
    assert [index for index, _ in answers[1]] == [index for index, _ in answers[0]] == [i for i, _ in answers[2]]
    assert np.allclose([s for _, s in answers[1]], [s for _, s in answers[0]], atol=atol)


def refusal(*flags: str, env: dict[str, str] | None = None) -> str:
    """The one line `imgserve serve FLAGS` stops with (exit 2, no traceback), from where imgserve prints it."""
    command = [sys.executable, "-m", "imgserve", "serve", "--host", "127.0.0.1", "--port", str(free_port())]
    command += ["--grpc-port", "0", "--input-size", str(SIDE), *flags]
    environment = {k: v for k, v in (env or os.environ).items() if not k.startswith("IMGSERVE_")}
    environment.pop("PROMETHEUS_MULTIPROC_DIR", None)
    environment["PYTHONPATH"] = os.pathsep.join([str(SOURCE), str(SUPPORT)])
    result = subprocess.run(command, capture_output=True, text=True, timeout=READY_S, env=environment)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert "imgserve: " in last, result.stderr[-3000:]
    return last[last.index("imgserve: ") :]


@pytest.mark.parametrize("kind", ["export", "module"])
def test_every_batch_size_and_thread_count_is_compiled_before_the_model_is_ready(
    models, tmp_path: Path, kind: str
) -> None:
    """After setup, batches of every size on the worker's thread counts (all of them alone, half under load) run
    without a new graph: no request waits for a compile. Compiled answers are the eager model's. A torch.export
    program is frozen into a package; a module (what a factory builds) gets torch.compile's graphs."""
    settings = Settings(model=str(models["export"]), input_size=SIDE, max_batch_size=4, compile_cache_dir=str(tmp_path))
    runs = {}
    for compile_it in (False, True):
        api = ModelAPI(settings.model_copy(update={"compile": compile_it}), LocalKinds(), pad=False, max_batch_size=4)
        api.model_loader = lambda device: load_model(str(models["export"])) if kind == "export" else seeded_net()
        torch.set_num_threads(2)
        worker = InProcess(api).setup()
        before = compiled.graphs_compiled()
        rng = np.random.default_rng(0)
        images = [rng.integers(0, 256, (SIDE, SIDE, 3), dtype=np.uint8) for _ in range(4)]
        runs[compile_it] = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            runs[compile_it] += [worker.predict(images[:size]) for size in (3, 1, 4, 2)]
        torch.set_num_threads(2)
        if compile_it:
            assert isinstance(api.runner.call, compiled.CompiledModel)
            assert api.runner.call.frozen == ("made" if kind == "export" else None)
            assert api.runner.call.late_graphs == 0 and compiled.graphs_compiled() == before
    for eager, fast in zip(runs[False], runs[True], strict=True):
        for one, other in zip(eager, fast, strict=True):
            assert np.allclose(one, other, atol=1e-4)


def test_a_restart_reuses_the_frozen_package_and_answers_as_the_eager_server(models, tmp_path: Path) -> None:
    """On a CPU a model of a fixed input size in fp32 is compiled by default, frozen into one package: the first
    compiled server's first worker makes it (the others wait and load it), a second server with the same cache
    directory only loads it; both answer as the eager server does."""
    data = image_bytes(48, 40, seed=3)
    settings = {"model": str(models["export"]), "compile_cache_dir": str(tmp_path / "cache"), "max_batch_size": 4}
    answers, found = [], []
    for compile_it in ({"compile": "false"}, {}, {"compile": "true"}):
        with served({**settings, **compile_it}, tmp_path) as server:
            answers.append(scores(server, data))
            found.append(FROZEN.findall(server.log()))
    assert_same_answers(answers, atol=1e-4)
    assert found[0] == [] and sorted(found[1]) == ["found in the cache"] * (len(found[1]) - 1) + ["made"], found
    assert found[2] and set(found[2]) == {"found in the cache"}, found
    assert len(list((tmp_path / "cache").glob("frozen-*.pt2"))) == 1
    assert (tmp_path / "cache").stat().st_mode & 0o777 == 0o700


def test_a_restart_reuses_torch_compiles_graphs_where_the_model_is_not_frozen(models, tmp_path: Path) -> None:
    """bf16 runs under autocast, which a package cannot hold: torch.compile's graphs instead, cached. The first
    compiled server compiles (its log counts the graphs the cache already held: not all of them), a second one with
    the same cache directory finds every graph there; both answer as the eager server does, at bf16's precision. One
    worker each: how workers share a cache is the frozen package's test's."""
    data = image_bytes(48, 40, seed=3)
    cache = tmp_path / "cache"
    settings = {"model": str(models["export"]), "compile_cache_dir": str(cache), "max_batch_size": 4}
    settings |= {"workers_per_device": 1}
    answers, found = [], []
    for compile_it in ({"compile": "false"}, {"compile": "true"}, {"compile": "true"}):
        with served({**settings, "precision": "bf16", **compile_it}, tmp_path) as server:
            answers.append(scores(server, data))
            found += [tuple(map(int, match)) for match in CACHED.findall(server.log())]
    assert_same_answers(answers, atol=2e-2)
    workers = len(found) // 2
    first, second = found[:workers], found[workers:]
    assert all(graphs > 0 for graphs, _ in found) and workers >= 1
    assert any(hits < graphs for graphs, hits in first), first
    assert all(hits == graphs for graphs, hits in second), second
    assert len(list(cache.glob("warmed-*"))) == 1 and not list(cache.glob("frozen-*"))


def test_a_cache_directory_another_user_can_write_is_refused(models, tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    line = refusal("--model", str(models["export"]), "--compile", "--compile-cache-dir", str(shared))
    assert line.startswith(f"imgserve: --compile-cache-dir {shared} is not a directory of this user's"), line


@pytest.mark.parametrize("kind", ["link", "file", "group-writable"])
def test_the_cache_directory_must_be_this_users_own_directory(tmp_path: Path, kind: str) -> None:
    target = tmp_path / "real"
    target.mkdir(mode=0o700)
    path = tmp_path / "cache"
    if kind == "link":
        path.symlink_to(target)
    elif kind == "file":
        path.write_text("")
    else:
        path.mkdir()
        path.chmod(0o770)
    with pytest.raises(ModelLoadError, match="--compile-cache-dir"):
        compiled.cache_directory(str(path))
    made = compiled.cache_directory(str(tmp_path / "new" / "cache"))
    assert made.is_dir() and made.stat().st_mode & 0o777 == 0o700


def test_an_aotinductor_package_is_refused_without_trust_native_code(models, tmp_path: Path) -> None:
    line = refusal("--model", str(models["native"]), "--trust-pickle")
    assert line == (
        f"imgserve: {models['native']} is an AOTInductor package: native code that would run as the server. "
        "Pass --trust-native-code if you trust its author."
    )


def test_an_aotinductor_package_with_trust_native_code_answers_as_its_program(models, tmp_path: Path) -> None:
    data = image_bytes(48, 40, seed=4)
    answers = []
    program = {"model": str(models["export"]), "compile": "false"}  # as exported: the package is compiled from it
    for settings in (program, {"model": str(models["native"]), "trust_native_code": "true"}):
        with served(settings, tmp_path) as server:
            answers.append(scores(server, data))
            weights = httpx.get(f"{server.url}/info", timeout=10).json()["weights"]
    assert [index for index, _ in answers[1]] == [index for index, _ in answers[0]]
    assert np.allclose([s for _, s in answers[1]], [s for _, s in answers[0]], atol=1e-4)
    assert "inside the compiled package" in weights["private_per_worker"]


def test_a_native_packages_extracted_code_goes_with_the_server_even_after_a_killed_worker(
    models, tmp_path: Path, monkeypatch
) -> None:
    """torch extracts each load of an AOTInductor package (its shared object, with the weights inside) into a folder
    of the temporary directory, and a stopped or killed worker never removes it: /tmp (a size-limited emptyDir in the
    chart) filled one worker start after another. The server's scratch directory holds them and goes with it. TMPDIR
    names an empty folder here, so whatever is in it at the end is what the server left."""
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    monkeypatch.setenv("TMPDIR", str(temporary))  # the server's environment is this process's
    data = image_bytes(48, 40, seed=4)
    with served({"model": str(models["native"]), "trust_native_code": "true"}, tmp_path) as server:
        first = scores(server, data)
        assert len(list(temporary.rglob("aotinductor_*"))) >= len(server.worker_pids())  # one per worker
        workers = set(server.worker_pids())
        os.kill(min(workers), signal.SIGKILL)
        server.replaced_worker(workers)  # a worker in its place, and the server ready again
        assert scores(server, data) == first
    assert list(temporary.iterdir()) == [], "the server left files in the temporary directory"


@pytest.mark.parametrize(
    ("kind", "flags", "what"),
    [("native", ["--trust-native-code"], "an AOTInductor package"), ("script", [], "a TorchScript model")],
)
def test_compile_is_refused_for_a_model_that_is_compiled_already(models, kind: str, flags: list, what: str) -> None:
    line = refusal("--model", str(models[kind]), "--compile", *flags)
    assert line.startswith(f"imgserve: --compile does not apply to {what}"), line


def test_without_a_compiler_an_explicit_compile_is_refused(models, tmp_path: Path) -> None:
    environment = {**os.environ, "CXX": str(tmp_path / "no-compiler")}
    flags = ["--model", str(models["export"]), "--compile", "--compile-cache-dir", str(tmp_path / "c")]
    assert refusal(*flags, env=environment).startswith("imgserve: the model failed warm-up on cpu"), flags


def test_without_a_compiler_the_default_leaves_the_model_eager(models, tmp_path: Path, monkeypatch) -> None:
    """compile unset on a CPU compiles a fixed-size model where it can; a host without a C++ compiler serves it
    eagerly, with a warning, instead of not starting."""
    monkeypatch.setenv("CXX", str(tmp_path / "no-compiler"))
    with served({"model": str(models["export"]), "compile_cache_dir": str(tmp_path / "c")}, tmp_path) as server:
        assert len(scores(server, image_bytes(48, 40, seed=5))) > 0
        assert "torch.compile failed (InductorError: InvalidCxxCompiler" in server.log()
        assert "running the model eagerly" in server.log()
