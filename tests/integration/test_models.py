"""The built-in denoiser does its job, training is reproducible, and every model format loads and serves."""

from __future__ import annotations

import io
from pathlib import Path

import httpx
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file
from serving import image_bytes, running_server
from toy_models import TinyClassifier

from imgserve.models.denoiser import Denoiser, build_denoiser
from imgserve.models.loader import ModelLoadError, load_model
from imgserve.tools.train import evaluate, train


def test_shipped_denoiser_raises_psnr() -> None:
    noisy_db, denoised_db = evaluate(build_denoiser(), sigma=0.1, seed=99)
    assert denoised_db > noisy_db + 5


def test_training_is_reproducible() -> None:
    first, second = train(steps=3, seed=5, batch=2, patch=16), train(steps=3, seed=5, batch=2, patch=16)
    for a, b in zip(first.state_dict().values(), second.state_dict().values(), strict=True):
        assert torch.equal(a, b)


def _save_formats(directory: Path) -> dict[str, dict[str, str]]:
    """The user's model saved every way imgserve accepts, with the settings that serve it."""
    model = build_denoiser()
    example = torch.rand(2, 3, 32, 32)
    paths = {name: directory / name for name in ("m.ts", "m.pt2", "m.safetensors", "state.pt", "whole.pt")}
    torch.jit.save(torch.jit.trace(model, example), str(paths["m.ts"]))
    dims = {"x": {d: torch.export.Dim(n, min=1, max=4096) for d, n in ((0, "batch"), (2, "height"), (3, "width"))}}
    torch.export.save(torch.export.export(model, (example,), dynamic_shapes=dims), str(paths["m.pt2"]))
    save_file(model.state_dict(), str(paths["m.safetensors"]))
    torch.save(model.state_dict(), paths["state.pt"])
    torch.save(model, paths["whole.pt"])
    factory = "imgserve.models.denoiser:Denoiser"
    return {
        "torchscript": {"model": str(paths["m.ts"])},
        "torch.export": {"model": str(paths["m.pt2"])},
        "safetensors+factory": {"model": str(paths["m.safetensors"]), "model_factory": factory},
        "state dict+factory": {"model": str(paths["state.pt"]), "model_factory": factory},
        "pickled, trusted": {"model": str(paths["whole.pt"]), "trust_pickle": "true"},
    }


@pytest.fixture(scope="module")
def formats(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, str]]:
    return _save_formats(tmp_path_factory.mktemp("models"))


@pytest.mark.parametrize(
    "name", ["torchscript", "torch.export", "safetensors+factory", "state dict+factory", "pickled, trusted"]
)
def test_each_format_loads_like_the_builtin(formats: dict, name: str) -> None:
    settings = formats[name]
    model = load_model(settings["model"], settings.get("model_factory"), settings.get("trust_pickle") == "true")
    x = torch.rand(2, 3, 40, 56)
    with torch.inference_mode():
        torch.testing.assert_close(model(x), build_denoiser()(x), atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", ["torchscript", "torch.export", "safetensors+factory"])
def test_each_format_serves(formats: dict, name: str, tmp_path: Path) -> None:
    with running_server(tmp_path, **formats[name]) as server:
        response = httpx.post(
            f"{server.url}/predict", content=image_bytes(70, 50), headers={"Content-Type": "image/png"}
        )
        assert response.status_code == 200
        assert Image.open(io.BytesIO(response.content)).size == (70, 50)


def test_pickled_model_is_refused_without_trust(formats: dict) -> None:
    with pytest.raises(ModelLoadError, match="--trust-pickle"):
        load_model(formats["pickled, trusted"]["model"])


def test_state_dict_without_factory_or_wrong_weights_is_explained(formats: dict, tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="--model-factory"):
        load_model(formats["state dict+factory"]["model"])
    with pytest.raises(ModelLoadError, match="cannot import model factory"):
        load_model(formats["state dict+factory"]["model"], "nowhere.module:build")
    save_file(Denoiser(channels=8).state_dict(), str(tmp_path / "small.safetensors"))
    with pytest.raises(ModelLoadError, match="do not fit"):
        load_model(str(tmp_path / "small.safetensors"), "imgserve.models.denoiser:Denoiser")


def test_classifier_answers_json_top_k(tmp_path: Path) -> None:
    save_file(TinyClassifier().state_dict(), str(tmp_path / "cls.safetensors"))
    (tmp_path / "labels.txt").write_text("cat\ndog\nbird\nfish\n")
    settings = {
        "model": str(tmp_path / "cls.safetensors"),
        "model_factory": "toy_models:TinyClassifier",
        "labels": str(tmp_path / "labels.txt"),
        "input_size": 32,
        "compile": False,  # eager: compiling is test_compiled.py's (a minute per server on 2 cores)
    }
    with running_server(tmp_path, **settings) as server:
        response = httpx.post(
            f"{server.url}/predict",
            params={"top_k": 2},
            content=image_bytes(50, 30),
            headers={"Content-Type": "image/png"},
        )
        assert response.status_code == 200
        top = response.json()["top_k"]
        assert len(top) == 2 and top[0]["score"] >= top[1]["score"]
        assert {t["label"] for t in top} <= {"cat", "dog", "bird", "fish"}
        assert 0.25 < top[0]["score"] + top[1]["score"] <= 1.0 + 1e-6
