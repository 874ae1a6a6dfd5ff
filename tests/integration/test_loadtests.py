"""Load-test tooling against a real `imgserve serve` on loopback: a short Locust run, capacity.json, bench --quick."""

from __future__ import annotations

import csv
import io
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from imgserve.testing import RunningServer, free_port, serve_command
from loadtests import (
    admission_cost,
    bench,
    capacity,
    compile_ways,
    decode,
    front_end_split,
    gpu_check,
    latency,
    overhead,
    resnet50,
    sidebyside,
    start_time,
    tracing_cost,
    weight_reorders,
)
from loadtests.lib import closed_loop
from loadtests.lib.closed_loop import LoadResult, Outcome, run_closed_loop
from loadtests.lib.grpc_loop import run_grpc_closed_loop
from loadtests.lib.images import check_answer, check_scores, sample_images, square_jpegs
from loadtests.lib.inprocess import Limit
from loadtests.lib.servers import CpuWindow, running_server
from loadtests.lib.shapes import SHAPES
from loadtests.run import run_load_test


@pytest.fixture(scope="module")
def imgserve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    port = free_port()
    log = tmp_path_factory.mktemp("logs") / "imgserve.log"
    with running_server(serve_command(port), port, log, "/health/ready", ready_timeout_s=120) as server:
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
    assert report.count(f"| {bench.STORM} | 200 (10x overload) |") == 1
    assert "goodput at 200 users (10x overload) with immediate retries >= 0.9x capacity (20 users)" in report
    assert "imgserve accepted p99 in the retry storm vs at capacity (20 users)" in report
    assert "retry storm's CPU per rejection, beyond the work of its answers: server " in report
    assert report.count("**met**") + report.count("**missed**") == 7


@pytest.mark.timeout(240)
def test_sidebyside_serves_every_contender_and_compares_each_pair(tmp_path: Path) -> None:
    out = tmp_path / "sidebyside.md"
    assert sidebyside.main(["--rounds", "1", "--seconds", "1", "--out", str(out)]) == 0
    rows = [line for line in out.read_text().splitlines() if line.startswith("| ")]
    for cell, contender in (
        ("denoiser, bench images, c=1", "denoiser"),
        ("denoiser, bench images, c=64", "denoiser"),
        ("near-free, 128x128, c=64", "near-free model file"),
        ("near-free, 128x128, c=64", "near-free ImageAPI"),
    ):
        (row,) = [row for row in rows if row.startswith(f"| {cell} | {contender} |")]
        answers_per_s, cpu_ms, workers_ms = (float(row.split("|")[column]) for column in (4, 7, 8))
        assert answers_per_s > 0 and 0 < workers_ms < cpu_ms  # the workers' part of the server's CPU
    (ratio,) = [row for row in rows if row.startswith("| | near-free ImageAPI / near-free model file | ")]
    each_round, of_medians = ratio.split("|")[3:5]
    assert float(each_round) > 0 and of_medians.strip().endswith("x")


def test_sidebyside_with_tracing_adds_the_traced_denoiser_to_the_c64_cell(tmp_path: Path) -> None:
    """--tracing: one more contender, this tree's denoiser with OpenTelemetry on at 10% to the given endpoint, in the
    64-user denoiser cell only, after the code before (each cell's reference) and tracing off."""
    found = sidebyside.contenders(tmp_path, tmp_path, "http://127.0.0.1:4318")
    (traced,) = [contender for contender in found if contender.name == sidebyside.TRACED]
    assert traced.env == {
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318",
        "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
        "OTEL_TRACES_SAMPLER_ARG": "0.1",
    }
    assert sidebyside.TRACED not in {c.name for c in sidebyside.contenders(tmp_path, tmp_path)}
    plan = {cell.name: cell.contenders for cell in sidebyside.cells(tmp_path, traced=True)}
    assert plan["denoiser, bench images, c=64"] == ("denoiser before", "denoiser", sidebyside.TRACED)
    assert plan["denoiser, bench images, c=1"] == ("denoiser before", "denoiser")


def test_admission_cost_times_the_checks_a_request_passes(capsys: pytest.CaptureFixture) -> None:
    assert admission_cost.main(["--requests", "200"]) == 0
    assert float(capsys.readouterr().out.split("admission: ")[1].split(" us")[0]) > 0


def test_tracing_cost_times_the_request_id_and_the_steps_with_tracing_off(capsys: pytest.CaptureFixture) -> None:
    assert tracing_cost.main(["--requests", "200"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == ["request id middleware", "six steps, tracing off", "together"]
    assert all(float(line.split(":")[1].split()[0].lstrip("+")) > 0 for line in lines)


def test_sidebyside_turns_alternate_so_no_contender_always_runs_first() -> None:
    servers = [sidebyside.Contender(name, Path("."), {}) for name in ("a", "b", "c")]
    assert [[c.name for c in sidebyside.turns(servers, index)] for index in range(3)] == [
        ["a", "b", "c"],
        ["c", "b", "a"],
        ["a", "b", "c"],
    ]


def test_imgserve_is_held_to_the_higher_of_the_two_limit_measurements() -> None:
    before = Limit({4: 90.0, 8: 100.0})
    assert bench.Limits(before, before, after_images_per_s=120.0).reference == 120.0
    assert bench.Limits(before, before, after_images_per_s=80.0).reference == 100.0


def test_a_retry_storm_resends_at_once_where_polite_clients_wait(imgserve: RunningServer) -> None:
    """The load generator's storm option (the server's Retry-After hold is tested over raw sockets in
    test_hostile.py: here the clients' pooled connections mix first and repeated 503s)."""
    url = imgserve.url + "/predict"
    polite = run_closed_loop(url, users=200, seconds=2)
    storm = run_closed_loop(url, users=200, seconds=2, retry_at_once=True)
    assert polite.failed == storm.failed == 0
    assert polite.shed > 0 and len(storm.answered) > 0
    assert storm.shed > polite.shed  # polite users wait Retry-After (1 s) after each 503; the storm does not


def test_a_latency_ends_when_the_answer_is_in_not_after_the_client_checked_it(
    imgserve: RunningServer, monkeypatch
) -> None:
    """The client's own check of an answer (decoding a 1024x1024 JPEG takes it ~6 ms) is not the server's latency."""
    checked = []

    def slow_check(*args: object) -> None:
        checked.append(1)
        time.sleep(0.2)

    monkeypatch.setattr(closed_loop, "check_answer", slow_check)
    result = run_closed_loop(imgserve.url + "/predict", users=1, seconds=1.5)
    assert len(checked) >= 3 and len(result.answered) >= 3
    assert result.latency_ms(0.5) < 150, "a cell's latencies include only the request and its answer"


def test_a_user_that_dies_fails_the_run_instead_of_reading_as_no_answers(imgserve: RunningServer) -> None:
    """A check that raises (as resnet50's cells did, given the warm-up where the check belonged) is the load
    generator's own fault: the run raises it rather than report 0 answers/s."""

    def broken_check(*args: object) -> None:
        raise TypeError("'float' object is not callable")

    with pytest.raises(TypeError, match="not callable"):
        run_closed_loop(imgserve.url + "/predict", users=2, seconds=0.5, check=broken_check)


def _result(users: int, latencies_s: list[float], window_s: float = 1.0) -> LoadResult:
    return LoadResult(users, window_s, [Outcome(0.0, latency, 200, None) for latency in latencies_s])


def _limits(one: float, two: float, single_ms: float) -> overhead.SideLimits:
    before = (overhead.LimitRun(1, one, single_ms), overhead.LimitRun(2, two, 2 * single_ms))
    after = (overhead.LimitRun(1, one / 2, 3 * single_ms), overhead.LimitRun(2, two / 2, single_ms))
    return overhead.SideLimits(before, after)


def _overhead_run(rps_1024_c16: float, rps_128_c64: float, p50_1024_ms: float) -> overhead.OverheadRun:
    cells = [
        overhead.Cell(1024, _result(16, [0.5] * int(rps_1024_c16)), 2**30, 0.1),
        overhead.Cell(128, _result(64, [0.1] * int(rps_128_c64)), 2**30, 0.1),
        overhead.Cell(1024, _result(1, [p50_1024_ms / 1000] * 5), 2**30, 0.1),
    ]
    limits = {1024: _limits(40.0, 100.0, 20.0), 128: _limits(900.0, 1000.0, 1.0)}
    return overhead.OverheadRun(overhead.Plan.targets_only(1.0), limits, cells, {"device": "cpu"})


def test_overhead_holds_imgserve_to_the_higher_limit_and_the_faster_single_image() -> None:
    limits = _limits(40.0, 100.0, 20.0)
    assert (limits.images_per_s(1), limits.images_per_s(2), limits.single_image_ms) == (40.0, 100.0, 20.0)


@pytest.mark.parametrize(
    ("rps_1024", "rps_128", "p50_ms", "met"),
    [(60, 600, 26.0, [True, True, True]), (59, 599, 26.5, [False, False, False])],
)
def test_overhead_targets_sit_on_their_thresholds(rps_1024: int, rps_128: int, p50_ms: float, met: list[bool]) -> None:
    run = _overhead_run(rps_1024, rps_128, p50_ms)
    assert [v.met for v in run.verdicts()] == met
    report = overhead.render(run, "cmd", "host")
    assert report.count("**met**" if met[0] else "**missed**") == 3
    assert "| 1024x1024 | 16 | 40.0 | 100.0 | " in report and "| 128x128 | 64 | 900.0 | 1000.0 | " in report


@pytest.mark.parametrize(("p50_ms", "rps", "met"), [(11.5, 450.0, True), (11.6, 449.0, False)])
def test_latency_targets_sit_on_their_thresholds(p50_ms: float, rps: float, met: bool) -> None:
    """Issue 22's c=1 targets: p50 <= 1.15x (denoiser) or 1.3x (near-free 1024) of one image, >= 450/s at 128."""
    single = 10.0
    rows = [
        latency.Row(latency.CASES[0], single, _result(1, [p50_ms / 1000] * 5)),
        latency.Row(latency.CASES[1], 1.0, _result(1, [0.001] * int(rps))),
        latency.Row(latency.CASES[2], single, _result(1, [(p50_ms + 1.5) / 1000] * 5)),
    ]
    report = latency.render(rows, "cmd", "host")
    assert report.count("**met**" if met else "**missed**") == 3, report
    assert f"| denoiser | 128x128 | 10.00 | {p50_ms:.2f} |" in report


def test_gpu_check_exit_status_ranks_error_over_fail_over_pass() -> None:
    row = gpu_check.Row.of
    passed, failed = row(gpu_check.AUTO, "", True), row(gpu_check.AUTO, "", False)
    error = gpu_check.Row(gpu_check.OOM, "boom", "-", gpu_check.ERROR)
    assert gpu_check.exit_status([passed, gpu_check.Row.skipped(gpu_check.OOM)]) == 0
    assert gpu_check.exit_status([passed, failed]) == 1
    assert gpu_check.exit_status([failed, error]) == 2


def test_gpu_check_writes_its_table_after_every_check(tmp_path: Path, monkeypatch) -> None:
    """A run cut short (a lent GPU's time is up) still leaves the rows of the checks that finished; a check's error
    row keeps the end of its message, where a server log says why it failed."""
    out, seen = tmp_path / "checks.md", []

    def first(context: gpu_check.Context) -> list[gpu_check.Row]:
        return [gpu_check.Row.of(gpu_check.AUTO, "first one done", True)]

    def second(context: gpu_check.Context) -> list[gpu_check.Row]:
        seen.append(out.read_text())
        raise RuntimeError("x" * 400 + " the reason at the end")

    checks = (gpu_check.Check(first, (gpu_check.AUTO,), False), gpu_check.Check(second, (gpu_check.OOM,), False))
    monkeypatch.setattr(gpu_check, "CHECKS", checks)
    assert gpu_check.main(["--out-dir", str(tmp_path)]) == 2
    assert "| first one done |" in seen[0] and gpu_check.OOM not in seen[0]
    assert "the reason at the end | " in out.read_text()


@pytest.mark.timeout(180)
@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the check runs for real (minutes)")
def test_gpu_check_runs_on_a_cpu_with_the_gpu_rows_skipped(tmp_path: Path) -> None:
    status = gpu_check.main(["--cell-seconds", "1", "--out-dir", str(tmp_path)])
    table = (tmp_path / "checks.md").read_text()
    cells = [line.split(" | ") for line in table.splitlines() if line[:2] == "| "]
    rows = {cell[0][2:]: cell[-1][:-2] for cell in cells}
    why = {cell[0][2:]: cell[1] for cell in cells}
    assert set(gpu_check.GOALS) <= set(rows)
    gpu_rows = {gpu_check.CUDA, gpu_check.NVML, gpu_check.FP16, gpu_check.BF16, gpu_check.AUTO, gpu_check.FLOOD}
    gpu_rows |= {gpu_check.OOM, gpu_check.RESNET_COMPILED, gpu_check.RESNET_HTTP, gpu_check.RESNET_GRPC}
    gpu_rows |= set(gpu_check.DEVICE_DECODE)
    assert {rows[name] for name in gpu_rows} == {gpu_check.SKIPPED}
    assert {why[name] for name in gpu_rows} == {"no CUDA device"}  # each skipped row says why
    assert rows[gpu_check.SEED] == gpu_check.INFO  # measured; its goal is a GPU's
    overhead_rows = [gpu_check.overhead_row(target) for target in overhead.TARGETS]
    assert {rows[name] for name in overhead_rows} <= {gpu_check.PASS, gpu_check.FAIL}
    assert status in (0, 1)  # 2 would be a check that raised
    assert "| 1024x1024 | 16 |" in (tmp_path / "overhead.md").read_text()  # the overhead report, beside the table


def test_the_device_decode_check_times_the_workers_decode_and_pillow_on_the_cores(tmp_path: Path, monkeypatch) -> None:
    """LABELLED STAND-IN (no GPU here): the batched decoder is Pillow on the CPU and cuda:0 is the CPU, so the check's
    own code runs (the uploads read, both rates timed, a row per size); its numbers are the GPU's only on a GPU."""

    def stand_in(datas: list[bytes], device: torch.device) -> list[torch.Tensor]:
        return [torch.from_numpy(np.array(Image.open(io.BytesIO(data)).convert("RGB"))) for data in datas]

    monkeypatch.setattr(gpu_check, "gpu_jpeg_decoder", lambda: stand_in)
    monkeypatch.setattr(gpu_check, "DECODE_DEVICE", "cpu")
    rows = gpu_check.check_device_decode(gpu_check.Context(cuda=True, log_dir=tmp_path, cell_seconds=0.2))
    assert [row.check for row in rows] == list(gpu_check.DEVICE_DECODE)
    assert all(row.status in (gpu_check.PASS, gpu_check.FAIL) and "images/s" in row.result for row in rows), rows


def test_the_device_decode_rows_say_why_they_are_skipped_without_torchvision(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(gpu_check, "gpu_jpeg_decoder", lambda: None)
    rows = gpu_check.check_device_decode(gpu_check.Context(cuda=True, log_dir=tmp_path, cell_seconds=1))
    why = "torchvision's GPU JPEG decoder is not installed"
    assert {(row.status, row.result) for row in rows} == {(gpu_check.SKIPPED, why)}


def test_the_cpu_window_counts_the_measured_window_not_the_warm_up_or_the_tail(tmp_path: Path) -> None:
    """This process idles 0.3 s (warm-up), spins 0.6 s (the window), idles 0.6 s (the tail): about one core in the
    window, where the whole block averages 0.4. A sleeping server process counts about nothing."""
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        server = RunningServer("http://127.0.0.1:1", sleeper, tmp_path / "log")
        with CpuWindow(server, start_s=0.3, seconds=0.6) as cpu:
            time.sleep(0.3)
            until = time.perf_counter() + 0.6
            while time.perf_counter() < until:
                pass
            time.sleep(0.6)
        assert cpu.client_cores > 0.6, cpu.client_cores
        assert cpu.server_cores < 0.2, cpu.server_cores
    finally:
        sleeper.kill()
        sleeper.wait()


def test_the_grpc_load_generator_drives_modelinfer_and_counts_answers(tmp_path: Path) -> None:
    """The GPU check's gRPC users, against a real server's gRPC port: every request answered, none failed."""
    port, grpc_port = free_port(), free_port()
    with running_server(serve_command(port, grpc_port), port, tmp_path / "log", "/health/ready") as server:
        result = run_grpc_closed_loop(f"127.0.0.1:{grpc_port}", "denoiser", 4, 1.5, 0.5, square_jpegs(64))
        rejected = run_grpc_closed_loop(f"127.0.0.1:{grpc_port}", "nope", 1, 0.5, 0.0, square_jpegs(64))
    assert result.failed == 0 and len(result.answered) >= 4, result.errors()
    assert result.latency_ms(0.5) > 0 and server.url
    assert rejected.failed > 0 and "NOT_FOUND" in rejected.errors()[0]  # a wrong answer is a failure, not a pass


def test_check_scores_takes_a_classifiers_answer_only() -> None:
    image = sample_images()[0]
    assert check_scores(image, 200, "application/json", b'{"top_k": [{"index": 3, "score": 0.9}]}') is None
    assert check_scores(image, 200, "image/jpeg", image.data).startswith("not a classifier's answer")
    assert check_scores(image, 200, "application/json", b'{"top_k": []}').startswith("no scores")
    assert check_scores(image, 503, "application/json", b"{}").startswith("HTTP 503")


def test_decode_reports_whole_and_reduced_decodes_and_the_input_difference(tmp_path: Path) -> None:
    out = tmp_path / "decode.md"
    assert decode.main(["--seconds", "0.05", "--out", str(out)]) == 0
    rows = [line for line in out.read_text().splitlines() if line[:2] == "| " and line[2].isdigit()]
    assert [row.split(" | ")[0][2:] for row in rows] == [f"{w}x{h}" for w, h in decode.SIZES for _ in (0, 1)]
    assert "| 1024x1024 | photo-like | 256x256 |" in out.read_text()
    assert "| 500x375 | photo-like | 500x375 |" in out.read_text()  # no smaller scale keeps 256 px
    assert "**met**" in out.read_text()


def small_net(folder: Path) -> Path:
    """A small exported convolutional net of 32 px inputs, its batch dynamic (the ResNet-50's compiles take minutes
    on 2 cores)."""
    net = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1)
    ).eval()
    batch = torch.export.Dim("batch", min=1, max=64)
    program = torch.export.export(net, (torch.rand(2, 3, 32, 32),), dynamic_shapes=({0: batch},))
    torch.export.save(program, str(folder / "net.pt2"))
    return folder / "net.pt2"


def test_compile_ways_runs_each_way_in_a_fresh_process_and_holds_its_logits_to_eagers(tmp_path: Path) -> None:
    """One round (a fresh process per way): every way warms up, runs, and computes eager's logits."""
    out = tmp_path / "ways.md"
    argv = ["--model", str(small_net(tmp_path)), "--size", "32", "--rounds", "1", "--seconds", "0.05"]
    assert compile_ways.main([*argv, "--batches", "1", "4", "--out", str(out)]) == 0
    rows = {cells[0][2:]: cells for cells in (line.split(" | ") for line in out.read_text().splitlines())}
    rows = {way: cells for way, cells in rows.items() if way in compile_ways.WAYS}
    assert list(rows) == list(compile_ways.WAYS)
    for way, cells in rows.items():
        assert cells[1].endswith("x)") and float(cells[3]) > 0 and cells[4] == "-", way  # rates, the one warm-up
        assert float(cells[-1].rstrip(" |")) < 1e-4, way  # the same logits as eager's


def test_weight_reorders_counts_onednns_work_in_each_call_of_the_frozen_package(tmp_path: Path) -> None:
    """The package runs the net's one convolution through oneDNN at every batch, and never reorders its weights:
    they are packed in the package (models/packing.py)."""
    out = tmp_path / "reorders.md"
    argv = ["--model", str(small_net(tmp_path)), "--size", "32", "--batches", "1", "4", "--calls", "2"]
    assert weight_reorders.main([*argv, "--ways", "aoti-frozen", "--out", str(out)]) == 0
    rows = [line.strip("| ").split(" | ") for line in out.read_text().splitlines() if line.startswith("| ")]
    found = {(cells[0], cells[2]): cells for cells in rows[1:]}  # after the head
    assert set(found) == {("aoti-frozen", "1"), ("aoti-frozen", "4")}
    for batch in ("1", "4"):
        cells = found["aoti-frozen", batch]
        assert cells[1] == "1" and float(cells[3]) > 0 and cells[4] == "1" and cells[6] == "0", cells


def test_resnet50_cells_check_a_classifiers_scores_from_polite_clients() -> None:
    """Each load's answers are judged as a classifier's, by users that wait Retry-After, after a warm-up of seconds
    (the cells once took check_scores for the retry-storm flag and the warm-up for the check: every user died)."""
    for cell in resnet50.cells(limit_per_s=30.0):
        assert cell.check is check_scores and cell.retry_at_once is False
        assert 2.0 <= cell.warmup_s <= resnet50.MAX_WARMUP_S


@pytest.mark.parametrize(("compiled", "met"), [(24.0, True), (23.9, False)])
def test_resnet50_holds_the_compiled_server_to_1_2x_the_eager_one(compiled: float, met: bool) -> None:
    plan = resnet50.cells(limit_per_s=30.0)
    results = sidebyside.Results()
    for cell in plan:
        results.add((cell.name, resnet50.EAGER), 20.0, 100.0, 200.0, 50.0, 45.0)
        results.add((cell.name, resnet50.COMPILED), compiled, 90.0, 180.0, 40.0, 35.0)
    alone = resnet50.Alone(
        {resnet50.EAGER: 14.0, resnet50.COMPILED: 18.0}, {resnet50.EAGER: 1.0, resnet50.COMPILED: 16.0}
    )
    compiled_log = (
        "x model compiled for batches of 1 to 8 on 2 and 1 threads in {} s: 4 graphs, {} of them from the cache in /c"
    )
    frozen_log = "x model compiled for batches of 1 to 8 on 2 and 1 threads in 2.5 s: frozen into a package, {}: /c/f"
    starts = {
        resnet50.EAGER: [resnet50.Started(9.0, "", 900 * 2**20)],
        resnet50.COMPILED: [
            resnet50.Started(90.0, compiled_log.format(80.5, 0) + "\n" + compiled_log.format(81.0, 4)),
            resnet50.Started(12.0, compiled_log.format(3.5, 4)),
            resnet50.Started(5.0, frozen_log.format("made") + "\n" + frozen_log.format("found in the cache")),
        ],
    }
    batching = resnet50.Batching({})
    for cell in plan:  # 12 images in 3 batches and 1.2 s of the model, then twice that (medians: the second run)
        for scale in (1, 2, 3):
            counted = dict(zip(resnet50.BATCH_FIGURES, (12.0 * scale, 3.0 * scale, 1.2 * scale), strict=True))
            batching.add((cell.name, resnet50.COMPILED), dict.fromkeys(resnet50.BATCH_FIGURES, 0.0), counted)
    report = resnet50.render(alone, results, batching, plan, starts, 2)
    assert f"| {plan[1].name}, compiled | 36.0 | {compiled:.1f} | {compiled / 36:.2f}x | 4.0 | 100.0 (55.6) |" in report
    assert f"| {plan[1].name}, eager | 28.0 | 20.0 | 0.71x | 0.0 | 0.0 (71.4) |" in report  # none counted
    assert "idle PSS" not in report  # no server idled for a reading here: no empty table
    assert "at ready: eager 900 MiB; compiled 0 MiB (empty cache), 0, 0 MiB (with the cache)." in report
    assert report.count("**met**" if met else "**missed**") == (3 if met else 2)  # the second start: met
    assert "| eager | 14.0 | 1.0 | 28.0 |" in report and "| compiled | 18.0 | 16.0 | 36.0 |" in report
    assert (
        "compiled, empty cache 90.0 s (its workers' compile, one at a time: 80.5 s (4 graphs, 0 of them from the "
        "cache) + " in report
    )
    assert (
        "the same cache again 12.0 s (3.5 s (4 graphs, 4 of them from the cache)); 5.0 s (2.5 s (frozen into a "
        in report
    )
    assert "package, made) + 2.5 s (frozen into a package, found in the cache))." in report


def test_front_end_split_reads_each_front_ends_cpu_in_a_burst(tmp_path: Path) -> None:
    out = tmp_path / "split.md"
    assert front_end_split.main(["--starts", "1", "--users", "8", "--seconds", "1", "--out", str(out)]) == 0
    (row,) = [line for line in out.read_text().splitlines() if line.startswith("| 1 | this |")]
    rps, cpu = float(row.split(" | ")[2]), [float(s) for s in row.split(" | ")[3].strip(" |").split(", ")]
    assert rps > 0 and len(cpu) == 2 and sum(cpu) > 0  # the plan's two front ends on this 2-core machine


def test_start_time_times_a_start_and_a_worker_replacement(tmp_path: Path) -> None:
    out = tmp_path / "start.md"
    assert start_time.main(["--starts", "1", "--out", str(out)]) == 0
    (row,) = [line for line in out.read_text().splitlines() if line.startswith("| 1 | this |")]
    ready_s, pss, replaced_s = (float(cell) for cell in row.strip(" |").split(" | ")[2:])
    assert 0 < ready_s < 180 and 0 < replaced_s < 120 and pss > 100  # torch alone is over 100 MiB in each worker
    assert f"| median | this | {ready_s:.2f} | {pss:.0f} | {replaced_s:.2f} |" in out.read_text()


def test_a_source_without_imgserve_is_refused_rather_than_served_by_the_installed_one(tmp_path: Path) -> None:
    """A --before that names the service folder instead of the checkout's root once ran this tree's code on both sides
    of a comparison, reading as the code before."""
    port = free_port()
    checkout = tmp_path / "checkout"
    with (
        pytest.raises(FileNotFoundError, match="no imgserve package"),
        running_server(serve_command(port), port, tmp_path / "log", "/health/ready", source=checkout / "service"),
    ):
        pass


class SlowFirstRead(RunningServer):
    """A real server process whose first CPU read takes 1 s, as a read can on a loaded machine (labelled stand-in:
    the load itself cannot be had on cue)."""

    reads = 0

    def tree_cpu_s(self) -> float:
        self.reads += 1
        if self.reads == 1:
            time.sleep(1.0)
        return super().tree_cpu_s()


def test_a_slow_first_mark_still_opens_the_cpu_window(tmp_path: Path) -> None:
    """Two timers once took the window's marks: a start mark slower than the window appended after the end mark, and
    the window read -590,000,000 cores in CI."""
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        with CpuWindow(SlowFirstRead("http://127.0.0.1:1", sleeper, tmp_path / "log"), 0.1, 0.3) as cpu:
            time.sleep(0.15)
            until = time.perf_counter() + 0.2  # spins in the window
            while time.perf_counter() < until:
                pass
            time.sleep(1.2)
        assert 0 <= cpu.client_cores < 0.5 and 0 <= cpu.server_cores < 0.2, (cpu.client_cores, cpu.server_cores)
    finally:
        sleeper.kill()
        sleeper.wait()
