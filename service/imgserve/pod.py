"""What the pod will be: its processes, threads, batches, queue and slots, planned from the settings and the machine.

`plan_pod(settings, machine)` is pure: the machine's facts (`Machine`: cores, devices, free memory, /dev/shm, and on
a GPU one probe batch timed on it) come in as data, so every decision is unit-tested without starting a process.
The composition root (server.py) reads the machine once (`read_machine`), builds exactly what the plan says and
shows it on /info. The reasoning behind each rule, with its measurements, is in docs/architecture.md.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from imgserve.config import (
    CPU_FRONT_ENDS,
    DEVICE_DECODE_FRONT_END_SHARE,
    GPU_BUSY_GOAL,
    MAX_CPU_WORKERS,
    MAX_GPU_WORKERS,
    Settings,
)

AUTO_BATCH_CAP = 256  # the largest batch max_batch_size auto may choose
QUEUED_BATCHES_PER_WORKER = 4  # max_queue_depth 0: this many full batches per worker may wait
SLOT_ROOM_PER_PIXEL = 3  # bytes a queued image holds in its slot per pixel (uint8 RGB)
CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")
SHM = Path("/dev/shm")


class TorchThreads(NamedTuple):
    """An inference worker's torch threads: for a batch that is all the pod has admitted, and while other requests
    are in flight."""

    alone: int
    busy: int


@dataclass(frozen=True)
class GpuProbe:
    """One batch of `batch` of the API's example items (`items` says what they are) timed on the first GPU: seconds
    of a worker's own CPU work (filling the batch, taking the results apart) and of `predict` on the device."""

    batch: int
    items: str
    cpu_s: float
    device_s: float


@dataclass(frozen=True)
class Machine:
    """The facts a plan is made from."""

    cpus: int
    device_type: str  # "cpu" or "cuda"
    devices: int
    free_memory_bytes: int  # RAM on a CPU, the first GPU's free memory on CUDA
    shm_bytes: int  # the size of /dev/shm (0 where there is none)
    gpu_probe: GpuProbe | None = None  # only for workers_per_device auto on a GPU


@dataclass(frozen=True)
class PodPlan:
    """Every number the server is built from; `describe` is what /info shows of it."""

    device_type: str
    devices: list[str]
    workers_per_device: int
    workers_per_device_why: str
    workers: int
    front_ends: int
    decode_on_device: bool  # the served API decodes its uploads on the device: the front ends need fewer cores
    codec_threads_per_front_end: int
    torch_threads: TorchThreads
    batch_size: int  # the workers' first batch size: max_batch_size, or 1 until `auto` is measured
    largest_batch: int  # the largest the batch size can become
    slots_per_front_end: int
    reserved_slot_bytes: int  # kept out of a CPU's batch memory: room for every admitted image in its slot
    pad_mixed_sizes: bool
    passive_openmp: bool
    warnings: list[str] = field(default_factory=list)
    max_queue_depth: int = 0  # the operator's bound (0: from the batch size, `queue_bound`)

    def queue_bound(self, batch_size: int) -> int:
        """Admitted-but-unanswered requests per pod: max_queue_depth, or `QUEUED_BATCHES_PER_WORKER` full batches
        per worker at `batch_size` (the batch size the workers settled on)."""
        return self.max_queue_depth or batch_size * self.workers * QUEUED_BATCHES_PER_WORKER

    def describe(self) -> dict[str, Any]:
        """The plan as JSON for /info."""
        plan = asdict(self)
        plan["torch_threads"] = self.torch_threads._asdict()
        return plan


def plan_pod(settings: Settings, machine: Machine, decode_on_device: bool = False) -> PodPlan:
    """The pod for these settings on this machine, for an API that decodes its uploads in the front ends, or on the
    device (`decode_on_device`)."""
    cuda = machine.device_type == "cuda"
    workers_per_device, why = _workers_per_device(settings, machine)
    workers = machine.devices * workers_per_device
    front_ends = _front_ends(settings, machine, workers, decode_on_device)
    auto_batch = settings.max_batch_size == "auto"
    batch_size = 1 if auto_batch else int(settings.max_batch_size)
    largest_batch = AUTO_BATCH_CAP if auto_batch else batch_size
    largest_queue = settings.max_queue_depth or largest_batch * workers * QUEUED_BATCHES_PER_WORKER
    # A front end may hold every admitted request, and as many again given up on whose workers still have them.
    slots_per_front_end = 2 * largest_queue
    # On a CPU the slots live in the same RAM as the batches: room for every admitted image at its largest.
    reserved = 0 if cuda else largest_queue * SLOT_ROOM_PER_PIXEL * settings.max_image_pixels
    plan = PodPlan(
        device_type=machine.device_type,
        devices=[f"cuda:{index}" for index in range(machine.devices)] if cuda else ["cpu"],
        workers_per_device=workers_per_device,
        workers_per_device_why=why,
        workers=workers,
        front_ends=front_ends,
        decode_on_device=decode_on_device,
        codec_threads_per_front_end=max(1, machine.cpus // front_ends),
        torch_threads=_torch_threads(settings, machine, workers),
        batch_size=batch_size,
        largest_batch=largest_batch,
        slots_per_front_end=slots_per_front_end,
        reserved_slot_bytes=reserved,
        pad_mixed_sizes=cuda if settings.pad_mixed_sizes == "auto" else bool(settings.pad_mixed_sizes),
        passive_openmp=not cuda,
        max_queue_depth=settings.max_queue_depth,
    )
    plan.warnings.extend(_warnings(settings, machine, plan, largest_queue))
    return plan


def gpu_workers_for(cpu_s: float, device_s: float, cpus: int) -> int:
    """Workers per GPU from one batch's seconds of a worker's own CPU work and of the model on the GPU. A worker does
    the two in turn, so alone it keeps the GPU busy device/(cpu + device) of the time; k workers overlap one's CPU
    work with another's model call: the fewest that reach GPU_BUSY_GOAL, at most MAX_GPU_WORKERS and half the
    cores (the front ends decode on the others). Extra workers cost a CUDA context each, not another copy of the
    weights."""
    if device_s <= 0:
        return 1
    wanted = math.ceil(GPU_BUSY_GOAL * (cpu_s + device_s) / device_s)
    return max(1, min(wanted, MAX_GPU_WORKERS, cpus // 2))


def _workers_per_device(settings: Settings, machine: Machine) -> tuple[int, str]:
    """On a CPU one worker per core (under load several narrow workers beat one wide one); on a GPU as many as keep
    it GPU_BUSY_GOAL busy, from the probe."""
    if settings.workers_per_device != "auto":
        return settings.workers_per_device, "set by --workers-per-device"
    if machine.device_type != "cuda":
        return min(machine.cpus, MAX_CPU_WORKERS), f"one per core, at most {MAX_CPU_WORKERS}"
    probe = machine.gpu_probe
    if probe is None:
        return 1, "no probe batch was timed on the GPU"
    workers = gpu_workers_for(probe.cpu_s, probe.device_s, machine.cpus)
    return workers, (
        f"a batch of {probe.batch} {probe.items} took {1000 * probe.cpu_s:.1f} ms of a worker's "
        f"CPU and {1000 * probe.device_s:.1f} ms on the GPU: {workers} worker(s) keep it "
        f"{GPU_BUSY_GOAL:.0%} busy"
    )


def _front_ends(settings: Settings, machine: Machine, workers: int, decode_on_device: bool) -> int:
    """HTTP front ends: on a GPU every core the workers leave free (reading, decoding and resizing uploads is what
    feeds the GPU), or DEVICE_DECODE_FRONT_END_SHARE of them where the device decodes the uploads. On a CPU the
    workers share the cores with them, and one front end's event loop caps a cheap model: CPU_FRONT_ENDS, at most one
    per core."""
    if settings.api_servers != "auto":
        return settings.api_servers
    if machine.device_type != "cuda":
        return min(machine.cpus, CPU_FRONT_ENDS)
    free = machine.cpus - workers
    return max(1, math.ceil(free * DEVICE_DECODE_FRONT_END_SHARE) if decode_on_device else free)


def _torch_threads(settings: Settings, machine: Machine, workers: int) -> TorchThreads:
    """On a GPU, the worker's share of the cores. On a CPU, twice its share (at most every core) for a batch that is
    all the pod has admitted, so a lone request runs on every core while the other workers wait (their OpenMP
    threads wait passively); its share while other requests are in flight, so the workers do not take turns on the
    same cores. A count the user chose holds for both."""
    if settings.torch_threads != "auto":
        return TorchThreads(settings.torch_threads, settings.torch_threads)
    share = max(1, machine.cpus // workers)
    if machine.device_type == "cuda":
        return TorchThreads(share, share)
    return TorchThreads(min(machine.cpus, 2 * share), share)


def _warnings(settings: Settings, machine: Machine, plan: PodPlan, largest_queue: int) -> list[str]:
    """What on this machine may bound the pod before its own limits do."""
    found = []
    slot_bytes = largest_queue * SLOT_ROOM_PER_PIXEL * settings.max_image_pixels
    if machine.shm_bytes and machine.shm_bytes < slot_bytes:
        found.append(
            f"/dev/shm has {machine.shm_bytes >> 20} MiB, less than the {slot_bytes >> 20} MiB that {largest_queue} "
            "admitted images at --max-image-pixels could hold: a request that finds it full gets 503 "
            "(raise --shm-size / the chart's shmSize, or lower --max-image-pixels)"
        )
    if plan.reserved_slot_bytes > machine.free_memory_bytes // 2:
        found.append(
            f"room for every admitted image ({plan.reserved_slot_bytes >> 20} MiB) is over half the free memory "
            f"({machine.free_memory_bytes >> 20} MiB): the batches get the rest"
        )
    return found


def usable_cpus() -> int:
    """CPUs this process may use: its affinity mask, capped by a cgroup v2 CPU quota (a container's CPU limit)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    with contextlib.suppress(OSError, ValueError):
        quota, period = CGROUP_CPU_MAX.read_text().split()
        if quota != "max":
            cpus = min(cpus, max(1, int(quota) // int(period)))
    return cpus


def available_ram() -> int:
    """MemAvailable: what the system can give without swapping."""
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("MemAvailable missing from /proc/meminfo")


def shm_bytes() -> int:
    """The size of /dev/shm (0 where there is none)."""
    return shutil.disk_usage(SHM).total if SHM.is_dir() else 0


def read_machine(device_type: str, devices: int, free_memory_bytes: int, gpu_probe: GpuProbe | None) -> Machine:
    """This machine's facts; the device side comes from the caller (it needs torch, and a probe needs the model)."""
    return Machine(usable_cpus(), device_type, devices, free_memory_bytes, shm_bytes(), gpu_probe)
