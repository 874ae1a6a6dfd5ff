"""`imgserve plan` end to end: a capacity file measured with `python -m loadtests.capacity` on a real local server,
replayed through the chart's autoscaling."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from plan_runs import assert_plan_outputs, run_plan
from serving import REPO, running_server

from imgserve.tools.plan import inputs

CAPACITY_FLAGS = ["--users", "1,4,16", "--step-seconds", "2"]  # short steps keep the test near 10 s


@pytest.fixture
def capacity_from_server(tmp_path: Path) -> Iterator[Path]:
    """Serve the built-in model on loopback, measure it with `python -m loadtests.capacity`, return the file."""
    with running_server(tmp_path) as server:
        out = tmp_path / "capacity.json"
        command = [sys.executable, "-m", "loadtests.capacity", "--host", server.url, "--out", str(out)]
        subprocess.run(command + CAPACITY_FLAGS, cwd=REPO, check=True, timeout=120)
        yield out


def test_end_to_end_on_measured_capacity(capacity_from_server: Path, tmp_path: Path) -> None:
    pod = inputs.load_capacity(capacity_from_server)
    assert pod.max_rps > 0
    code, summary = run_plan(
        tmp_path,
        capacity_from_server,
        "--profile",
        "step",
        "--peak-rps",
        str(round(pod.max_rps * 3, 1)),
        "--duration",
        "900",
    )
    assert code == 0
    assert_plan_outputs(tmp_path, summary, 1, 8)
