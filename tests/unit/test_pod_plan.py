"""The pod plan (imgserve/pod.py): every decision from the settings and the machine's facts, without a process."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from imgserve import pod
from imgserve.api import ImageAPI
from imgserve.config import MAX_CPU_WORKERS, MAX_GPU_WORKERS, Batching, Settings
from imgserve.handoff.model_state import READY, UNAVAILABLE
from imgserve.handoff.state import SharedState
from imgserve.pod import GpuProbe, Limits, Machine, gpu_workers_for, plan_pod, usable_cpus
from imgserve.served import Catalog, ServedModel
from imgserve.server import Pod

GIB = 1 << 30


def machine(cpus: int = 2, device_type: str = "cpu", devices: int = 1, probe: GpuProbe | None = None) -> Machine:
    return Machine(cpus, device_type, devices, free_memory_bytes=16 * GIB, shm_bytes=8 * GIB, gpu_probe=probe)


def test_a_two_core_cpu_pod_as_these_machines_run_it() -> None:
    plan = plan_pod(Settings(), machine(cpus=2))
    assert (plan.device_type, plan.devices, plan.workers_per_device, plan.workers, plan.front_ends) == (
        "cpu",
        ["cpu"],
        2,
        2,
        2,
    )
    assert plan.codec_threads_per_front_end == 1
    assert tuple(plan.torch_threads) == (2, 1)
    assert plan.largest_queue == 8 * 2 * 4
    assert plan.queue_bound([8]) == 8 * 2 * 4 and plan.slots_per_front_end == 2 * 64
    assert plan.reserved_slot_bytes == 64 * 3 * Settings().max_image_pixels
    assert plan.warnings == []


def test_max_batch_size_auto_starts_at_one_and_makes_room_for_the_largest_batch() -> None:
    plan = plan_pod(Settings(max_batch_size="auto", max_queue_depth=0), machine(cpus=4))
    assert plan.largest_queue == pod.AUTO_BATCH_CAP * plan.workers * pod.QUEUED_BATCHES_PER_WORKER
    assert plan.slots_per_front_end == 2 * pod.AUTO_BATCH_CAP * plan.workers * pod.QUEUED_BATCHES_PER_WORKER
    assert plan.queue_bound([16]) == 16 * plan.workers * pod.QUEUED_BATCHES_PER_WORKER  # what the workers settled on
    assert plan_pod(Settings(max_queue_depth=50), machine()).queue_bound([16]) == 50  # the operator's bound holds


def test_several_models_each_have_their_queue_bound_inside_the_pods() -> None:
    """Each model's bound is its own batches', or max_queue_depth when the operator sets one (as with one model);
    the pod's is theirs together, or max_queue_depth; the slots make room for every model's largest queue."""
    plan = plan_pod(Settings(max_queue_depth=0), machine(cpus=2), [8, "auto", 2])
    per_batch = plan.workers * pod.QUEUED_BATCHES_PER_WORKER
    assert plan.largest_queue == (8 + pod.AUTO_BATCH_CAP + 2) * per_batch
    assert [plan.model_queue_bound(size) for size in (8, 2)] == [8 * per_batch, 2 * per_batch]
    assert plan.queue_bound([8, 2]) == 10 * per_batch
    bounded = plan_pod(Settings(max_queue_depth=20), machine(cpus=2), [8, 2])
    assert (bounded.queue_bound([8, 2]), bounded.model_queue_bound(8), bounded.model_queue_bound(2)) == (20, 20, 20)
    assert plan_pod(Settings(max_queue_depth=32), machine(cpus=2), [1]).model_queue_bound(1) == 32  # not 1 x 2 x 4


def test_workers_per_device_auto_is_one_per_core_on_a_cpu_and_from_the_probe_on_a_gpu() -> None:
    assert plan_pod(Settings(), machine(cpus=16)).workers_per_device == MAX_CPU_WORKERS
    assert plan_pod(Settings(), machine(cpus=1)).workers_per_device == 1
    assert plan_pod(Settings(workers_per_device="3"), machine(cpus=16, device_type="cuda")).workers_per_device == 3
    assert plan_pod(Settings(), machine(cpus=16, device_type="cuda")).workers_per_device == 1  # no probe
    probe = GpuProbe(batch=8, items="256x256 images", cpu_s=0.020, device_s=0.020)
    plan = plan_pod(Settings(), machine(cpus=16, device_type="cuda", devices=2, probe=probe))
    assert (plan.workers_per_device, plan.workers, plan.devices) == (2, 4, ["cuda:0", "cuda:1"])
    assert "20.0 ms of a worker's CPU and 20.0 ms on the GPU: 2 worker(s)" in plan.workers_per_device_why
    assert plan.reserved_slot_bytes == 0


def test_workers_per_gpu_overlap_the_workers_cpu_work_with_the_gpus() -> None:
    assert gpu_workers_for(cpu_s=0.001, device_s=0.050, cpus=16) == 1  # busy 98% of the time with one worker
    assert gpu_workers_for(cpu_s=0.020, device_s=0.020, cpus=16) == 2  # 50% alone: a second fills the gaps
    assert gpu_workers_for(cpu_s=0.060, device_s=0.020, cpus=16) == 4  # 25% alone
    assert gpu_workers_for(cpu_s=1.0, device_s=0.001, cpus=16) == MAX_GPU_WORKERS
    assert gpu_workers_for(cpu_s=0.01, device_s=0.0, cpus=16) == 1
    assert gpu_workers_for(cpu_s=0.060, device_s=0.020, cpus=4) == 2  # half the cores stay with the front ends


@pytest.mark.parametrize(
    ("device", "cpus", "workers", "alone", "busy"),
    [
        ("cpu", 2, "2", 2, 1),
        ("cpu", 1, "1", 1, 1),
        ("cpu", 16, "4", 8, 4),
        ("cpu", 3, "2", 2, 1),
        ("cuda", 16, "2", 8, 8),
        ("cuda", 2, "4", 1, 1),
    ],
)
def test_a_cpu_worker_alone_gets_twice_its_share_of_the_cores_a_gpu_worker_its_share(
    device: str, cpus: int, workers: str, alone: int, busy: int
) -> None:
    facts = machine(cpus=cpus, device_type=device)
    assert tuple(plan_pod(Settings(workers_per_device=workers), facts).torch_threads) == (alone, busy)
    chosen = Settings(workers_per_device=workers, torch_threads="3")
    assert tuple(plan_pod(chosen, facts).torch_threads) == (3, 3)  # a count the user chose holds


@pytest.mark.parametrize(("cpus", "front_ends"), [(1, 1), (2, 2), (16, 2)])
def test_a_cpu_pod_runs_two_front_ends_at_most_one_per_core(cpus: int, front_ends: int) -> None:
    assert plan_pod(Settings(), machine(cpus=cpus)).front_ends == front_ends
    assert plan_pod(Settings(api_servers="3"), machine(cpus=cpus)).front_ends == 3


def test_a_gpu_pod_leaves_the_workers_cores_to_the_front_ends() -> None:
    """A 16-core host with one GPU: every core the workers leave decodes uploads (no cap of 4, which left most of
    them idle while the GPU waited on decoding)."""
    probe = GpuProbe(8, "256x256 images", cpu_s=0.060, device_s=0.020)
    plan = plan_pod(Settings(), machine(cpus=16, device_type="cuda", probe=probe))
    assert (plan.workers_per_device, plan.front_ends, plan.codec_threads_per_front_end) == (4, 12, 1)
    light = GpuProbe(8, "224x224 images", cpu_s=0.001, device_s=0.050)
    plan = plan_pod(Settings(), machine(cpus=16, device_type="cuda", probe=light))
    assert (plan.workers, plan.front_ends, plan.decode_on_device) == (1, 15, False)
    assert plan_pod(Settings(), machine(cpus=2, device_type="cuda")).front_ends == 1
    two_gpus = plan_pod(Settings(workers_per_device="2"), machine(cpus=16, device_type="cuda", devices=2))
    assert (two_gpus.workers, two_gpus.front_ends) == (4, 12)  # every worker's core is taken, on every device


def test_where_the_device_decodes_the_front_ends_get_fewer_cores() -> None:
    """The same 16-core host with one GPU, with an API that decodes its uploads on the device: a front end then only
    reads and hands over the bytes, so it needs a share of the cores the workers leave."""
    light = GpuProbe(8, "224x224 images", cpu_s=0.001, device_s=0.050)
    plan = plan_pod(Settings(), machine(cpus=16, device_type="cuda", probe=light), decode_on_device=True)
    assert (plan.workers, plan.front_ends, plan.decode_on_device) == (1, 8, True)
    assert plan.describe()["decode_on_device"] is True  # /info shows why there are fewer
    assert plan_pod(Settings(), machine(cpus=2, device_type="cuda"), decode_on_device=True).front_ends == 1
    chosen = plan_pod(Settings(api_servers="6"), machine(cpus=16, device_type="cuda"), decode_on_device=True)
    assert chosen.front_ends == 6  # a count the user chose holds
    on_a_cpu = plan_pod(Settings(), machine(cpus=16), decode_on_device=True)
    assert on_a_cpu.front_ends == 2  # a CPU's front ends are bounded by their event loops, not by decoding


def test_a_small_dev_shm_or_little_free_memory_is_a_warning() -> None:
    small = Machine(2, "cpu", 1, free_memory_bytes=GIB, shm_bytes=64 << 20)
    warnings = plan_pod(Settings(), small).warnings
    assert len(warnings) == 2
    assert "/dev/shm has 64 MiB" in warnings[0] and "over half the free memory" in warnings[1]
    assert plan_pod(Settings(max_image_pixels=1 << 16), small).warnings == []


def test_the_plan_on_info_is_plain_json() -> None:
    described = plan_pod(Settings(), machine()).describe()
    assert described["torch_threads"] == {"alone": 2, "busy": 1}
    assert described["workers"] == 2 and isinstance(described["warnings"], list)


@pytest.mark.parametrize(
    ("cpu_max", "expected"),
    [("max 100000\n", None), ("150000 100000\n", 1), ("50000 100000\n", 1), ("not a quota\n", None)],
)
def test_usable_cpus_honours_a_cgroup_cpu_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cpu_max: str, expected: int | None
) -> None:
    affinity = len(os.sched_getaffinity(0))
    (tmp_path / "cpu.max").write_text(cpu_max)
    monkeypatch.setattr(pod, "CGROUP_CPU_MAX", tmp_path / "cpu.max")
    assert usable_cpus() == (affinity if expected is None else min(affinity, expected))


def test_usable_cpus_without_a_cgroup_file_is_the_affinity_mask(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(pod, "CGROUP_CPU_MAX", tmp_path / "missing")
    assert usable_cpus() == len(os.sched_getaffinity(0))


class Echo(ImageAPI):
    def predict(self, batch: Any) -> Any:
        return batch


def test_the_pods_bounds_follow_each_change_of_a_models_state_or_limits() -> None:
    """Pod.bounds is asked three times a request and kept between changes: a load, an unload or new limits are seen
    at once."""
    settings = Settings(max_queue_depth=0)
    plan = plan_pod(settings, machine(cpus=2), [8, 8])
    state = SharedState(plan.workers, 1, 1, 2)
    catalog = Catalog([ServedModel(i, f"m{i}", Echo(api_path=f"/m{i}"), Batching(max_batch_size=8)) for i in (0, 1)])
    served = Pod(settings, catalog, plan, state, control=None)  # type: ignore[arg-type]  # no model is loaded here
    per_batch = plan.workers * pod.QUEUED_BATCHES_PER_WORKER
    state.models.set_limits(0, Limits(8, 1, 1))
    state.models.set_state(0, READY)
    assert served.bounds(0) == (8 * per_batch, 8 * per_batch)
    state.models.set_limits(0, Limits(2, 1, 1))  # the main process fitted it again
    assert served.bounds(0) == (2 * per_batch, 2 * per_batch)
    state.models.set_limits(1, Limits(4, 1, 1))
    state.models.set_state(1, READY)  # loaded: the pod's bound holds both models' queues
    assert served.bounds(0) == (6 * per_batch, 2 * per_batch) and served.bounds(1) == (6 * per_batch, 4 * per_batch)
    state.models.set_state(1, UNAVAILABLE)  # unloaded
    assert served.bounds(0) == (2 * per_batch, 2 * per_batch)
