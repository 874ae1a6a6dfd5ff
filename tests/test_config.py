"""Settings that resolve from the machine: usable CPUs under a container CPU limit, and workers per device."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from imgserve import config
from imgserve.config import MAX_CPU_WORKERS, MAX_GPU_WORKERS, Settings, gpu_workers_for, usable_cpus


@pytest.mark.parametrize(
    ("cpu_max", "expected"),
    [("max 100000\n", None), ("150000 100000\n", 1), ("50000 100000\n", 1), ("not a quota\n", None)],
)
def test_usable_cpus_honours_a_cgroup_cpu_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cpu_max: str, expected: int | None
) -> None:
    affinity = len(os.sched_getaffinity(0))
    (tmp_path / "cpu.max").write_text(cpu_max)
    monkeypatch.setattr(config, "CGROUP_CPU_MAX", tmp_path / "cpu.max")
    assert usable_cpus() == (affinity if expected is None else min(affinity, expected))


def test_usable_cpus_without_a_cgroup_file_is_the_affinity_mask(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(config, "CGROUP_CPU_MAX", tmp_path / "missing")
    assert usable_cpus() == len(os.sched_getaffinity(0))


def test_workers_per_device_auto_is_one_per_gpu_and_one_per_core_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(config, "usable_cpus", lambda: 16)  # a 16-core machine, which this one is not
    assert Settings().workers_on("cuda") == 1
    assert Settings().workers_on("cuda", gpu_workers=3) == 3
    assert Settings().workers_on("cpu") == MAX_CPU_WORKERS
    assert Settings(workers_per_device="3").workers_on("cuda") == 3
    monkeypatch.setattr(config, "usable_cpus", lambda: 2)
    assert Settings().workers_on("cpu") == 2
    with pytest.raises(ValueError, match="workers_per_device must be >= 1"):
        Settings(workers_per_device=0)


def test_workers_per_gpu_auto_overlaps_the_workers_cpu_work_with_the_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(config, "usable_cpus", lambda: 16)
    assert gpu_workers_for(cpu_s=0.001, device_s=0.050) == 1  # the GPU is busy 98% of the time with one worker
    assert gpu_workers_for(cpu_s=0.020, device_s=0.020) == 2  # 50% alone: a second worker fills the gaps
    assert gpu_workers_for(cpu_s=0.060, device_s=0.020) == 4  # 25% alone
    assert gpu_workers_for(cpu_s=1.0, device_s=0.001) == MAX_GPU_WORKERS
    assert gpu_workers_for(cpu_s=0.01, device_s=0.0) == 1
    monkeypatch.setattr(config, "usable_cpus", lambda: 4)
    assert gpu_workers_for(cpu_s=0.060, device_s=0.020) == 2  # half the cores stay with the front ends


@pytest.mark.parametrize(
    ("device", "cpus", "workers", "alone", "busy"),
    [
        ("cpu", 2, 2, 2, 1),
        ("cpu", 1, 1, 1, 1),
        ("cpu", 16, 4, 8, 4),
        ("cpu", 3, 2, 2, 1),
        ("cuda", 16, 2, 8, 8),
        ("cuda", 2, 4, 1, 1),
    ],
)
def test_a_cpu_worker_alone_gets_twice_its_share_of_the_cores_at_most_all_else_its_share_as_a_gpu_worker_always(
    device: str, cpus: int, workers: int, alone: int, busy: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(config, "usable_cpus", lambda: cpus)
    assert Settings().torch_threads_on(device, workers) == (alone, busy)
    assert Settings(torch_threads="3").torch_threads_on(device, workers) == (3, 3)  # a count the user chose holds


def test_torch_threads_must_be_a_count_or_auto() -> None:
    with pytest.raises(ValueError, match="torch_threads must be >= 1"):
        Settings(torch_threads=0)


@pytest.mark.parametrize(("cpus", "front_ends"), [(1, 1), (2, 2), (16, 2)])
def test_a_cpu_pod_runs_two_front_ends_at_most_one_per_core(
    cpus: int, front_ends: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(config, "usable_cpus", lambda: cpus)
    assert Settings().front_ends_on("cpu", workers=min(cpus, MAX_CPU_WORKERS)) == front_ends
    assert Settings(api_servers="3").front_ends_on("cpu", workers=1) == 3
