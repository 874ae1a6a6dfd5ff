"""Real architectures' shapes over HTTP, each answer compared with the same model run in-process on the same input."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from PIL import Image
from real_shapes import (
    CLASSES,
    SEGMENT_CLASSES,
    DictSegmenter,
    FixedSizeClassifier,
    ListDetector,
    PatchTransformer,
    Probabilities,
    RGBAOutput,
    ThreeClassSegmenter,
    Unservable,
)
from reference import from_tensor, photo, to_tensor, torchvision_by_hand
from safetensors.torch import save_file
from serving import SOURCE, SUPPORT, Server, free_port, image_bytes, running_server, stop_server, wait_ready

from imgserve import codec
from imgserve.api import DEFAULT_MAX_IMAGE_PIXELS
from imgserve.models import outputs
from imgserve.models.loader import ModelLoadError
from imgserve.models.preprocess import Preprocess
from imgserve.models.render import mask_on_original

PNG = {"Content-Type": "image/png"}
EAGER = {"compile": False}  # these fixed-size models run eagerly: compiling is test_compiled.py's (a minute per server)


def saved(model: torch.nn.Module, directory: Path) -> dict[str, str]:
    """Settings serving `model` (a real_shapes class with its random weights) from a safetensors file."""
    path = directory / f"{type(model).__name__}.safetensors"
    save_file(model.state_dict(), str(path))
    return {"model": str(path), "model_factory": f"real_shapes:{type(model).__name__}"}


def post(server: Server, data: bytes, **params: object) -> httpx.Response:
    return httpx.post(f"{server.url}/predict", content=data, headers=PNG, params=params, timeout=60)


def run(model: torch.nn.Module, batch: torch.Tensor | np.ndarray) -> object:
    with torch.inference_mode():
        return model(torch.as_tensor(batch)[None] if batch.ndim == 3 else torch.as_tensor(batch))


def squashed(data: bytes, size: int) -> torch.Tensor:
    """--input-size alone: the whole image resized to size x size (bilinear), in [0, 1]."""
    image = Image.open(io.BytesIO(data)).convert("RGB").resize((size, size), Image.Resampling.BILINEAR)
    return torch.from_numpy(np.asarray(image, dtype=np.float32) / 255.0).permute(2, 0, 1)


@pytest.fixture(scope="module")
def vit(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, PatchTransformer]]:
    """A ViT-style classifier (fixed 224) with torchvision's ImageNet preprocessing and a labels file."""
    directory = tmp_path_factory.mktemp("vit")
    model = PatchTransformer().eval()
    (directory / "labels.txt").write_text("".join(f"class {i}\n" for i in range(CLASSES)))
    settings = {"preprocess": "imagenet", "labels": directory / "labels.txt", **saved(model, directory), **EAGER}
    with running_server(directory, **settings) as server:
        yield server, model


def test_vit_with_imagenet_preprocessing_scores_as_in_process(vit) -> None:
    server, model = vit
    for width, height in ((500, 375), (240, 333)):
        data = photo(width, height)
        response = post(server, data, top_k=CLASSES)
        assert response.status_code == 200, response.text
        expected = run(model, torchvision_by_hand(data, 256, 224)).softmax(dim=1)[0]
        answer = response.json()["top_k"]
        assert [t["label"] for t in answer] == [f"class {t['index']}" for t in answer]
        got = torch.tensor([t["score"] for t in sorted(answer, key=lambda t: t["index"])])
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
    assert httpx.get(f"{server.url}/info").json()["task"] == "classify"


def test_static_shape_export_starts_and_probabilities_are_not_softmaxed_again(tmp_path: Path) -> None:
    """A torch.export program with a fixed 224 x 224 input (dynamic batch only), whose output is probabilities."""
    model = Probabilities().eval()
    batch = torch.export.Dim("batch", min=1, max=64)
    program = torch.export.export(model, (torch.rand(2, 3, 224, 224),), dynamic_shapes={"x": {0: batch}})
    torch.export.save(program, str(tmp_path / "fixed.pt2"))
    settings = {"model": tmp_path / "fixed.pt2", "input_size": 224, "scores": "probabilities", **EAGER}
    with running_server(tmp_path, **settings) as server:
        data = photo(300, 200)
        answer = post(server, data, top_k=3).json()["top_k"]
        expected = run(model, squashed(data, 224))[0]
        assert [t["index"] for t in answer] == expected.argsort(descending=True)[:3].tolist()
        torch.testing.assert_close(torch.tensor([t["score"] for t in answer]), expected.sort(descending=True)[0][:3])


@pytest.fixture(scope="module")
def segmenter(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, DictSegmenter, Preprocess]]:
    """A dict-output segmenter ({"out": N x 21 x H x W}), resized to 72 and centre-cropped to 64."""
    directory = tmp_path_factory.mktemp("segment")
    model = DictSegmenter().eval()
    (directory / "labels.txt").write_text("".join(f"part {i}\n" for i in range(SEGMENT_CLASSES)))
    settings = {
        "resize_size": 72,
        "input_size": 64,
        "labels": directory / "labels.txt",
        **saved(model, directory),
        **EAGER,
    }
    with running_server(directory, **settings) as server:
        yield server, model, Preprocess(resize_size=72, input_size=64)


def test_segmenter_answers_a_class_mask_of_the_upload_size(segmenter) -> None:
    server, model, preprocess = segmenter
    data = photo(120, 90)
    response = post(server, data)
    assert (response.status_code, response.headers["content-type"]) == (200, "image/png")
    mask = Image.open(io.BytesIO(response.content))
    assert (mask.mode, mask.size) == ("P", (120, 90))
    prepared = preprocess(codec.open_image(data, DEFAULT_MAX_IMAGE_PIXELS))  # as decode_request does
    logits = run(model, to_tensor(prepared.pixels))["out"][0]
    expected = mask_on_original(logits.argmax(dim=0).to(torch.uint8).numpy(), prepared.geometry)
    got = np.asarray(mask)
    assert (got == expected).all()
    # 120 x 90 -> 96 x 72 -> the crop's 64 columns start at 16: the upload's first 20 columns were not seen.
    assert (got[:, :19] == outputs.UNSEEN).all() and (got[45, 21:99] < SEGMENT_CLASSES).all()

    classes = post(server, data, format="json").json()
    assert (classes["width"], classes["height"]) == (120, 90)
    indices, counts = np.unique(got[got != outputs.UNSEEN], return_counts=True)
    expected_counts = dict(zip(indices.tolist(), counts.tolist(), strict=True))
    assert {c["index"]: c["pixels"] for c in classes["classes"]} == expected_counts
    assert all(c["label"] == f"part {c['index']}" for c in classes["classes"])
    assert sum(c["fraction"] for c in classes["classes"]) == pytest.approx((got != outputs.UNSEEN).mean())

    refused = post(server, data, format="jpeg")
    assert (refused.status_code, refused.json()["error"]["code"]) == (422, "bad_parameters")
    assert httpx.get(f"{server.url}/info").json()["task"] == "segment"


def console_script_server(settings: dict[str, object], cwd: Path) -> Server:
    """`imgserve serve` as a user runs it: the console script, from `cwd`, with settings as flags (a boolean as a
    bare --x or --no-x)."""
    port = free_port()
    flags = []
    for name, value in settings.items():
        flag = name.replace("_", "-")
        flags += [f"--{flag}" if value else f"--no-{flag}"] if isinstance(value, bool) else [f"--{flag}", str(value)]
    command = [str(Path(sys.executable).parent / "imgserve"), "serve", "--host", "127.0.0.1", "--port", str(port)]
    command += ["--grpc-port", "0"]  # the default 8001 may be another server's
    env = {k: v for k, v in os.environ.items() if not k.startswith("IMGSERVE_") and k != "PROMETHEUS_MULTIPROC_DIR"}
    env["PYTHONPATH"] = os.pathsep.join([str(SOURCE), str(SUPPORT)])  # this worktree's imgserve; not the cwd
    log_path = cwd / "imgserve.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            command + flags, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    return Server(f"http://127.0.0.1:{port}", process, log_path)


@pytest.fixture(scope="module")
def detector(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, ListDetector]]:
    """A list-of-dicts detector whose factory is nets:build in the directory `imgserve` is started from."""
    directory = tmp_path_factory.mktemp("detect")
    model = ListDetector().eval()
    save_file(model.state_dict(), str(directory / "detector.safetensors"))
    (directory / "nets.py").write_text("from real_shapes import ListDetector\n\nbuild = ListDetector\n")
    server = console_script_server(
        {"model": "detector.safetensors", "model_factory": "nets:build", "input_size": 96, **EAGER}, directory
    )
    try:
        wait_ready(server)
        yield server, model
    finally:
        stop_server(server)


def test_detector_boxes_come_back_in_the_uploads_pixels(detector) -> None:
    server, model = detector
    data = photo(200, 150)
    [found] = run(model, squashed(data, 96))
    scale = torch.tensor([200 / 96, 150 / 96, 200 / 96, 150 / 96])
    for threshold in (None, 0.0, float(found["scores"][2])):  # None: the default, 0.5
        answer = post(server, data, **({} if threshold is None else {"score_threshold": threshold})).json()
        keep = found["scores"] >= (0.5 if threshold is None else threshold)
        assert (answer["width"], answer["height"]) == (200, 150)
        assert [d["index"] for d in answer["detections"]] == found["labels"][keep].tolist()
        boxes = torch.tensor([d["box"] for d in answer["detections"]]).reshape(-1, 4)
        torch.testing.assert_close(boxes, found["boxes"][keep] * scale, atol=1e-3, rtol=0)
        torch.testing.assert_close(
            torch.tensor([d["score"] for d in answer["detections"]]), found["scores"][keep], atol=1e-5, rtol=0
        )
    assert httpx.get(f"{server.url}/info").json()["task"] == "detect"


def test_four_channel_output_is_rgba_in_png_and_webp_and_over_white_in_jpeg(tmp_path: Path) -> None:
    torch.manual_seed(0)  # the alpha head's weights, so the composite's JPEG error does not depend on the draw
    model = RGBAOutput().eval()
    data = image_bytes(40, 30)  # smooth, so JPEG's loss stays small
    with running_server(tmp_path, **saved(model, tmp_path)) as server:
        png, webp, jpeg = (post(server, data, format=fmt, quality=100) for fmt in ("png", "webp", "jpeg"))
    pixels = np.array(Image.open(io.BytesIO(data)).convert("RGB"))
    expected = from_tensor(run(model, to_tensor(pixels))[0])
    assert (np.asarray(Image.open(io.BytesIO(png.content))) == expected).all()
    assert Image.open(io.BytesIO(webp.content)).mode == "RGBA"
    alpha = expected[..., 3:].astype(np.float32) / 255
    over_white = expected[..., :3] * alpha + 255 * (1 - alpha)
    got = np.asarray(Image.open(io.BytesIO(jpeg.content)).convert("RGB"), dtype=np.float32)
    assert jpeg.headers["content-type"] == "image/jpeg"
    assert np.abs(got - over_white).mean() < min(6, np.abs(got - expected[..., :3]).mean() / 3)


@pytest.mark.parametrize(
    ("model", "task", "kind"),
    [
        (FixedSizeClassifier(), "auto", "classify"),
        (PatchTransformer(), "auto", "classify"),
        (DictSegmenter(), "auto", "segment"),
        (ListDetector(), "auto", "detect"),
        (RGBAOutput(), "auto", "image"),
        (ThreeClassSegmenter(), "auto", "image"),
        (ThreeClassSegmenter(), "segment", "segment"),
    ],
)
def test_the_output_kind_is_guessed_from_the_shape_or_set(model: torch.nn.Module, task: str, kind: str) -> None:
    assert outputs.decide(run(model.eval(), torch.rand(1, 3, 224, 224)), task) == kind


def test_outputs_that_fit_no_kind_are_refused_with_the_reason() -> None:
    with pytest.raises(ModelLoadError, match=r"a tensor of shape \(1, 3, 5\), which imgserve cannot answer"):
        outputs.decide(run(Unservable(), torch.rand(1, 3, 8, 8)), "auto")
    with pytest.raises(ModelLoadError, match="--task detect expects a list of N dicts"):
        outputs.decide(run(FixedSizeClassifier(), torch.rand(1, 3, 224, 224)), "detect")


USER_MODEL = """import torch


class Gain(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gain = torch.nn.Parameter(torch.ones(1))

    def forward(self, x):
        return x * self.gain


build = Gain
"""


@pytest.mark.parametrize(
    ("files", "factory"),
    [
        ({"service.py": USER_MODEL}, "service:build"),
        ({"service/__init__.py": "", "mynet.py": USER_MODEL}, "mynet:build"),
    ],
    ids=["factory-named-service", "beside-a-service-package"],
)
def test_a_users_service_module_in_the_working_directory_changes_nothing(
    tmp_path: Path, files: dict[str, str], factory: str
) -> None:
    """imgserve imports as `imgserve`: a project folder's own `service.py` or `service/` is the user's, not ours."""
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    save_file({"gain": torch.ones(1)}, str(tmp_path / "w.safetensors"))
    server = console_script_server({"model": "w.safetensors", "model_factory": factory}, tmp_path)
    try:
        wait_ready(server)
        answer = post(server, image_bytes(32, 24), format="png")
        assert answer.status_code == 200, answer.text
        assert Image.open(io.BytesIO(answer.content)).size == (32, 24)
    finally:
        stop_server(server)
