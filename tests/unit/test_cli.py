"""The `imgserve` command as a newcomer first meets it: every --help works and names its flags; a wrong flag value
is one line and exit 2."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file
from serving import SOURCE, SUPPORT

from imgserve.config import Settings
from imgserve.models.denoiser import Denoiser


def imgserve(*arguments: str) -> subprocess.CompletedProcess:
    """`python -m imgserve ARGUMENTS` as a real process, with this worktree's imgserve and no IMGSERVE_* settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("IMGSERVE_") and k != "PROMETHEUS_MULTIPROC_DIR"}
    env["PYTHONPATH"] = os.pathsep.join([str(SOURCE), str(SUPPORT)])
    command = [sys.executable, "-m", "imgserve", *arguments]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)


@pytest.mark.parametrize(
    ("command", "flags"),
    [
        ([], ["serve", "train", "plan"]),
        (["serve"], ["--port", "--api-key-file", "--workers-per-device", "--trust-pickle", "--no-trust-pickle"]),
        (["plan"], ["--out", "--strict"]),
        (["train"], ["--steps", "--seed", "--out"]),
    ],
    ids=["imgserve", "serve", "plan", "train"],
)
def test_every_help_works_and_names_its_flags(command: list[str], flags: list[str]) -> None:
    result = imgserve(*command, "--help")
    assert (result.returncode, result.stderr) == (0, ""), result.stderr
    assert result.stdout.startswith("usage: imgserve")
    for flag in flags:
        assert flag in result.stdout, flag


def test_help_and_a_refused_setting_do_not_import_torch() -> None:
    """`imgserve --help` and a one-line refusal answer without importing torch (seconds of a newcomer's first try):
    only the commands that need it import it."""
    probe = (
        "import sys\nfrom imgserve import cli\n"
        "for argv in (['--help'], ['serve', '--port', 'abc']):\n"
        "    try:\n        cli.main(argv)\n    except SystemExit:\n        pass\n"
        "print('torch' in sys.modules)"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("IMGSERVE_")}
    env["PYTHONPATH"] = os.pathsep.join([str(SOURCE), str(SUPPORT)])
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, env=env)
    assert result.stdout.strip().splitlines()[-1] == "False", result.stdout + result.stderr


def test_train_writes_weights_the_denoiser_loads(tmp_path: Path) -> None:
    """`imgserve train` runs as the command line gives it (its module is imported only then) and writes weights."""
    out = tmp_path / "weights.safetensors"
    result = imgserve("train", "--steps", "2", "--out", str(out))
    assert result.returncode == 0 and f"wrote {out}" in result.stdout, result.stderr
    Denoiser().load_state_dict(load_file(out))


def test_serve_help_shows_every_setting_description_as_written() -> None:
    """Every setting's description is printed as is, a `%` included (argparse %-formats help texts)."""
    text = "".join(imgserve("serve", "--help").stdout.split())  # whatever the line wrapping
    descriptions = [field.description or "" for field in Settings.model_fields.values()]
    for description in descriptions:
        assert "".join(description.split()) in text, description


def test_a_wrong_flag_value_is_one_line_and_exit_2() -> None:
    result = imgserve("serve", "--port", "abc")
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("imgserve: invalid settings: --port"), result


@pytest.mark.parametrize("arguments", [["serve", "--nope"], [], ["serve", "--port"], ["plan"]])
def test_a_command_line_argparse_refuses_is_one_line_and_exit_2(arguments: list[str]) -> None:
    """An unknown flag, a missing command or value: one line naming the problem and where --help is, no usage dump."""
    result = imgserve(*arguments)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("imgserve"), result.stderr
    assert "--help" in result.stderr and "usage:" not in result.stderr
