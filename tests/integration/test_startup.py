"""Start-up as a user meets it: bare boolean flags, and every mistake ends the server with one line and exit 2."""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from real_shapes import FixedSizeClassifier, Unservable
from safetensors.torch import save_file
from serving import SOURCE, SUPPORT, start_server, stop_server

from imgserve.cli import _add_settings_flags
from imgserve.config import Settings
from imgserve.models.loader import ModelLoadError, load_model


def test_boolean_settings_are_bare_flags_with_no_variants() -> None:
    parser = argparse.ArgumentParser()
    _add_settings_flags(parser)
    args = vars(parser.parse_args(["--trust-pickle", "--no-channels-last", "--access-log"]))
    assert (args["trust_pickle"], args["channels_last"], args["access_log"]) == (True, False, True)
    assert vars(parser.parse_args([]))["channels_last"] is None  # unset: IMGSERVE_CHANNELS_LAST or the default
    overrides = {k: v for k, v in args.items() if v is not None}
    assert Settings(**overrides).trust_pickle is True and Settings(**overrides).channels_last is False


def imgserve(*flags: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """`imgserve serve FLAGS` that is expected to stop at once (it never gets as far as listening)."""
    command = [sys.executable, "-m", "imgserve", "serve", "--host", "127.0.0.1", "--port", "1099", *flags]
    env = {k: v for k, v in os.environ.items() if not k.startswith("IMGSERVE_") and k != "PROMETHEUS_MULTIPROC_DIR"}
    env["PYTHONPATH"] = os.pathsep.join([str(SOURCE), str(SUPPORT)])  # this worktree's imgserve, wherever cwd is
    return subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=cwd, env=env)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--device", "tpu"], "imgserve: invalid settings: --device: Input should be 'auto', 'cpu' or 'cuda'"),
        (["--host", "localhost"], "imgserve: invalid settings: --host: Input should be '0.0.0.0', '127.0.0.1' or '::'"),
        (["--precision", "fp8"], "imgserve: invalid settings: --precision: Input should be 'fp32', 'fp16' or 'bf16'"),
        (["--mean", "0.5,0.5"], "imgserve: invalid settings: --mean: expects three comma-separated numbers R,G,B"),
        (
            ["--preprocess", "imagenet", "--input-size", "300"],
            "imgserve: invalid settings: --resize-size 256 is under the --input-size 300 crop",
        ),
    ],
)
def test_an_invalid_setting_is_one_line_and_exit_2(flags: list[str], message: str) -> None:
    result = imgserve(*flags)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and result.stderr.startswith(message), result.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_device_cuda_without_a_gpu_is_one_line_and_exit_2() -> None:
    result = imgserve("--device", "cuda")
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.endswith("imgserve: --device cuda was asked for but torch sees no GPU\n"), result.stderr


def test_files_torch_cannot_read_and_bad_labels_are_refused_before_any_worker(tmp_path: Path) -> None:
    (tmp_path / "garbage.pt").write_bytes(b"garbage")
    with pytest.raises(ModelLoadError, match="not a model file torch can read"):
        load_model(str(tmp_path / "garbage.pt"))
    (tmp_path / "labels.txt").write_text("cat\n\ndog\n")
    for flags, message in (
        (["--model", "garbage.pt"], "garbage.pt is not a model file torch can read"),
        (["--labels", "labels.txt"], "labels.txt: line 2 is blank"),
        (["--labels", "missing.txt"], "cannot read the labels file"),
    ):
        result = imgserve(*flags, cwd=tmp_path)
        last = result.stderr.strip().splitlines()[-1]
        assert result.returncode == 2 and message in last and "Traceback" not in result.stderr, result.stderr


def test_a_grpc_port_in_use_is_one_line_and_exit_2() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = imgserve("--grpc-port", str(port))
    last = result.stderr.strip().splitlines()[-1]
    expected = f"imgserve: --grpc-port {port} is already in use on 127.0.0.1 (0 turns gRPC off)"
    assert result.returncode == 2 and last.endswith(expected) and "Traceback" not in result.stderr, result.stderr


def test_the_built_in_models_settings_with_an_api_of_ones_own_are_one_line_and_exit_2() -> None:
    """--preprocess, --precision and the like describe the built-in model: with --api they would be silently
    ignored, so the start stops and names them (flags and IMGSERVE_ variables alike)."""
    result = imgserve("--api", "user_apis:Tagged", "--preprocess", "imagenet", "--precision", "fp16")
    expected = "imgserve: --preprocess, --precision: the built-in model's settings do not apply to an API of your own"
    assert result.returncode == 2 and result.stderr.strip().splitlines()[-1].endswith(expected), result.stderr
    assert "Traceback" not in result.stderr


def test_a_port_in_use_is_one_line_and_exit_2() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        command = [sys.executable, "-m", "imgserve", "serve", "--host", "127.0.0.1", "--port", str(port)]
        env = {k: v for k, v in os.environ.items() if not k.startswith("IMGSERVE_")}
        env["PYTHONPATH"] = str(SOURCE)
        result = subprocess.run([*command, "--grpc-port", "0"], capture_output=True, text=True, timeout=120, env=env)
    last = result.stderr.strip().splitlines()[-1]
    assert result.returncode == 2 and last.endswith(
        f"imgserve: cannot listen on 127.0.0.1:{port}: Address already in use"
    )
    assert "Traceback" not in result.stderr


def failed_start(settings: dict[str, object], log_dir: Path) -> list[str]:
    """Start a server that must fail in its workers; its log lines after it exited with 2."""
    server = start_server(settings, log_dir)
    try:
        assert server.process.wait(timeout=120) == 2, server.log_tail()
        return server.log().strip().splitlines()
    finally:
        stop_server(server)


@pytest.mark.parametrize(
    ("model", "labels", "message"),
    [
        (FixedSizeClassifier(), "cat\ndog\nbird\n", "labels.txt has 3 labels but the model outputs 10 classes"),
        (Unservable(), None, "imgserve: the model returned a tensor of shape (1, 3, 5), which imgserve cannot answer"),
    ],
)
def test_a_worker_that_cannot_serve_the_model_ends_the_server_with_its_reason_last(
    tmp_path: Path, model: torch.nn.Module, labels: str | None, message: str
) -> None:
    save_file(model.state_dict(), str(tmp_path / "model.safetensors"))
    settings = {
        "model": tmp_path / "model.safetensors",
        "model_factory": f"real_shapes:{type(model).__name__}",
        "input_size": 224,
        "compile": False,  # the model fails its warm-up; compiling is test_compiled.py's
        "workers_per_device": 2,  # both fail; the reason is said once
    }
    if labels:
        (tmp_path / "labels.txt").write_text(labels)
        settings["labels"] = tmp_path / "labels.txt"
    lines = failed_start(settings, tmp_path)
    assert message in lines[-1]
    assert sum(message in line for line in lines) == 1 and not any("Traceback" in line for line in lines), lines
    assert len(lines) < 8, lines
