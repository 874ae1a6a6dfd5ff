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
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal, NamedTuple

from imgserve.config import (
    CPU_FRONT_ENDS,
    DEVICE_DECODE_FRONT_END_SHARE,
    GPU_BUSY_GOAL,
    MAX_CPU_WORKERS,
    MAX_GPU_WORKERS,
    ServerSettings,
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
    largest_queue: int  # the most requests the pod may admit, whatever batch sizes its models settle on
    slots_per_front_end: int
    reserved_slot_bytes: int  # kept out of a CPU's batch memory: room for every admitted image in its slot
    warnings: list[str] = field(default_factory=list)
    max_queue_depth: int = 0  # the operator's bound (0: from the batch size, `queue_bound`)

    def model_queue_bound(self, batch_size: int) -> int:
        """Admitted-but-unanswered requests of one model: the operator's max_queue_depth when set (a model may then
        take the whole pod), else `QUEUED_BATCHES_PER_WORKER` full batches per worker at `batch_size` (the batch size
        the model settled on)."""
        return self.max_queue_depth or batch_size * self.workers * QUEUED_BATCHES_PER_WORKER

    def queue_bound(self, batch_sizes: Sequence[int]) -> int:
        """Admitted-but-unanswered requests per pod: max_queue_depth, or the bounds of the models loaded (at the
        batch sizes they settled on) together."""
        return self.max_queue_depth or sum(self.model_queue_bound(size) for size in batch_sizes)

    def describe(self) -> dict[str, Any]:
        """The plan as JSON for /info."""
        plan = asdict(self)
        plan["torch_threads"] = self.torch_threads._asdict()
        return plan


def plan_pod(
    settings: ServerSettings,
    machine: Machine,
    batch_sizes: Sequence[int | Literal["auto"]] | None = None,
    decode_on_device: bool = False,
) -> PodPlan:
    """The pod for these settings on this machine, serving models of these batch sizes (the settings' one model's
    when none are given), whose uploads are decoded in the front ends, or on the device (`decode_on_device`)."""
    cuda = machine.device_type == "cuda"
    workers_per_device, why = _workers_per_device(settings, machine)
    workers = machine.devices * workers_per_device
    front_ends = _front_ends(settings, machine, workers, decode_on_device)
    largest = [AUTO_BATCH_CAP if size == "auto" else size for size in batch_sizes or [settings.max_batch_size]]
    largest_queue = settings.max_queue_depth or sum(largest) * workers * QUEUED_BATCHES_PER_WORKER
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
        largest_queue=largest_queue,
        slots_per_front_end=slots_per_front_end,
        reserved_slot_bytes=reserved,
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


def _workers_per_device(settings: ServerSettings, machine: Machine) -> tuple[int, str]:
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


def _front_ends(settings: ServerSettings, machine: Machine, workers: int, decode_on_device: bool) -> int:
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


def _torch_threads(settings: ServerSettings, machine: Machine, workers: int) -> TorchThreads:
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


def _warnings(settings: ServerSettings, machine: Machine, plan: PodPlan, largest_queue: int) -> list[str]:
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


@dataclass(frozen=True)
class Measured:
    """What a worker measured of a model on its example request: bytes per element of its items at the batch's peak,
    and the elements of one example item."""

    bytes_per_element: float
    example_elements: int


@dataclass(frozen=True)
class Limits:
    """What the main process gave a model on its device: its batch size, the elements a chunk may hold and the batch
    memory of each worker they come from."""

    batch_size: int
    element_budget: int
    budget_bytes: int


@dataclass(frozen=True)
class ModelNeed:
    """What a model needs of its device: its weights there (once when the workers share them, once per worker when
    not), what its workers measured (None: nothing to measure, its batches are bounded by their size alone), and
    its batch size (or auto)."""

    name: str
    weight_bytes: int
    measured: Measured | None
    batch_size: int | Literal["auto"]


@dataclass(frozen=True)
class DeviceMemory:
    """A device's memory as the models must share it: `fraction` of what was free before any weights, its workers,
    each worker process's own memory (the interpreter and libraries; on a GPU its CUDA context), and what the request
    slots keep (a CPU's RAM holds them too)."""

    device: str
    free_bytes: int
    fraction: float
    workers: int
    overhead_bytes: int
    reserved_bytes: int = 0

    @property
    def budget_bytes(self) -> int:
        return int(self.fraction * self.free_bytes)


def fit_models(memory: DeviceMemory, needs: Sequence[ModelNeed]) -> dict[str, Limits]:
    """Each model's batch limits on the device, or MemoryRefusal (one line with the numbers) when the models do not
    fit together. A worker runs one batch at a time, whatever its model: what remains of the budget after the weights,
    the worker processes and the slots' room is each worker's batch memory, and every model's chunks may use all of
    it. max_batch_size auto is the largest batch of example items that fits."""
    weights = sum(need.weight_bytes for need in needs)
    after = memory.budget_bytes - weights - memory.workers * memory.overhead_bytes
    per_worker = (after - min(memory.reserved_bytes, max(after, 0) // 2)) // max(memory.workers, 1)
    limits: dict[str, Limits] = {}
    too_big = []
    for need in needs:
        if need.measured is None:
            limits[need.name] = Limits(need.batch_size if isinstance(need.batch_size, int) else 1, 0, 0)
            continue
        element_budget = max(int(per_worker / need.measured.bytes_per_element), 0)
        whole = element_budget // max(need.measured.example_elements, 1)
        size = min(whole, AUTO_BATCH_CAP) if need.batch_size == "auto" else need.batch_size
        if size < 1 or whole < size:
            too_big.append(need)
        limits[need.name] = Limits(max(size, 1), max(element_budget, 1), max(per_worker, 0))
    if too_big or per_worker <= 0:
        kept = min(memory.reserved_bytes, max(after, 0) // 2)
        raise MemoryRefusal(_refusal(memory, needs, too_big, per_worker, kept))
    return limits


class MemoryRefusal(Exception):
    """The models do not fit their device's memory together; the message gives the numbers."""


def _refusal(
    memory: DeviceMemory, needs: Sequence[ModelNeed], too_big: list[ModelNeed], per_worker: int, kept: int
) -> str:
    def mib(value: float) -> str:
        return f"{value / 2**20:.0f} MiB"

    described = []
    for need in needs:
        batch = 1 if need.batch_size == "auto" else need.batch_size
        batch_bytes = need.measured.bytes_per_element * need.measured.example_elements * batch if need.measured else 0
        described.append(f"{need.name} {mib(need.weight_bytes)} weights + {mib(batch_bytes)} per batch of {batch}")
    names = ", ".join(need.name for need in too_big)
    if per_worker <= 0 or not too_big:
        what = "the models do not fit"
    else:
        what = f"model {names} does not fit" if len(too_big) == 1 else f"models {names} do not fit"
    return (
        f"{what} on {memory.device}: {'; '.join(described)}; {memory.workers} worker(s) x "
        f"{mib(memory.overhead_bytes)} each, {mib(kept)} kept for request slots; the device's "
        f"budget is {mib(memory.budget_bytes)} ({memory.fraction:g} of {mib(memory.free_bytes)} free), which leaves "
        f"{mib(max(per_worker, 0))} of batch memory per worker"
    )
