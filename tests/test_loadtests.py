"""Load-test tooling against a real `imgserve serve` on loopback: a short Locust run, capacity.json, bench --quick."""

from __future__ import annotations

import csv
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from loadtests import bench, capacity
from loadtests.images import check_answer, sample_images
from loadtests.inprocess import Limit
from loadtests.run import run_load_test
from loadtests.servers import RunningServer, free_port, imgserve_command, running_server
from loadtests.shapes import SHAPES


@pytest.fixture(scope="module")
def imgserve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    port = free_port()
    log = tmp_path_factory.mktemp("logs") / "imgserve.log"
    with running_server(imgserve_command(port), port, log, "/health/ready", ready_timeout_s=120) as server:
        yield server


def test_shapes_stay_between_one_user_and_the_peak() -> None:
    for shape in SHAPES.values():
        counts = [shape(i / 100, 40) for i in range(100)]
        assert min(counts) >= 1 and max(counts) == 40


def test_check_answer_catches_a_wrong_size() -> None:
    small, other = sample_images()[0], sample_images()[1]
    assert check_answer(small, 200, "image/png", other.data).startswith("answer is")
    assert check_answer(small, 200, "image/png", small.data) is None
    assert check_answer(small, 503, "application/json", b"{}").startswith("HTTP 503")


def test_locust_smoke_run_writes_reports(imgserve: RunningServer, tmp_path: Path) -> None:
    assert run_load_test(imgserve.url, "step", users=4, duration_s=5, out=tmp_path) == 0
    with (tmp_path / "locust_stats.csv").open() as f:
        total = next(row for row in csv.DictReader(f) if row["Name"] == "Aggregated")
    assert int(total["Request Count"]) > 0
    assert int(total["Failure Count"]) == 0
    for name in ("report.html", "plot.png", "metrics.csv", "locust_stats_history.csv"):
        assert (tmp_path / name).stat().st_size > 0, name
    assert len((tmp_path / "metrics.csv").read_text().splitlines()) > 2


def test_capacity_writes_the_contract(imgserve: RunningServer, tmp_path: Path) -> None:
    out = tmp_path / "capacity.json"
    assert capacity.main(["--host", imgserve.url, "--out", str(out), "--users", "1,4", "--step-seconds", "1.5"]) == 0
    document = json.loads(out.read_text())
    assert set(document) == {"version", "target", "model", "device", "steps", "max_rps"}
    assert (document["version"], document["target"]) == (1, imgserve.url)
    assert document["model"] == "builtin:denoiser" and document["device"] != "unknown"
    assert [step["users"] for step in document["steps"]] == [1, 4]
    for step in document["steps"]:
        assert set(step) == {"users", "rps", "p50_ms", "p99_ms", "queue_depth", "shed_rate", "gpu_utilization"}
        assert step["rps"] > 0 and step["p99_ms"] >= step["p50_ms"] > 0
        assert step["queue_depth"] is not None
    assert document["max_rps"] == max(step["rps"] for step in document["steps"])


@pytest.mark.timeout(240)
def test_bench_quick_compares_all_four(tmp_path: Path) -> None:
    out = tmp_path / "bench.md"
    assert bench.main(["--quick", "--out", str(out)]) == 0
    report = out.read_text()
    assert "In-process limit, measured right before imgserve: **" in report and "ratios use the higher" in report
    assert "The same in NCHW memory" in report
    for users in ("| 1 |", "| 20 |", "| 200 (10x overload) |"):
        assert users in report
    for server in (bench.BASELINE, bench.PLAIN, bench.IMGSERVE):
        assert report.count(f"| {server} |") == 3
    assert report.count("**met**") + report.count("**missed**") == 5


def test_imgserve_is_held_to_the_higher_of_the_two_limit_measurements() -> None:
    before = Limit({4: 90.0, 8: 100.0})
    assert bench.Limits(before, before, after_images_per_s=120.0).reference == 120.0
    assert bench.Limits(before, before, after_images_per_s=80.0).reference == 100.0
