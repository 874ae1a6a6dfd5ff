"""What `imgserve plan` reads: the chart values (defaults merged with -f files), the measured per-pod capacity
(the JSON written by `python -m loadtests.capacity`), and the load profile (arrivals per second)."""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import yaml
from pydantic import BaseModel

from imgserve.tools.plan.hpa import Behavior, behavior

CHART_VALUES = Path(__file__).resolve().parents[2] / "charts" / "imgserve" / "values.yaml"

# The keys the planner reads, with the chart's defaults: used when the chart is not next to the package.
BUILTIN_VALUES: dict[str, Any] = {
    "replicaCount": 1,
    "gpu": {"enabled": True, "count": 1},
    "autoscaling": {
        "hpa": {"enabled": False},
        "keda": {
            "enabled": False,
            "pollingInterval": 15,
            "cooldownPeriod": 300,
            "activationQueueDepth": 1,
            "idleReplicaCount": None,
            "wakeQuery": "",
            "wakeThreshold": 10,
            "wakeActivationThreshold": 0,
        },
        "minReplicas": 1,
        "maxReplicas": 8,
        "queueDepth": {"target": 8},
        "gpuUtilization": {"enabled": True, "source": "imgserve", "target": 80},
        "behavior": {
            "scaleUp": {
                "stabilizationWindowSeconds": 0,
                "selectPolicy": "Max",
                "policies": [{"type": "Pods", "value": 2, "periodSeconds": 60}],
            },
            "scaleDown": {
                "stabilizationWindowSeconds": 300,
                "selectPolicy": "Min",
                "policies": [{"type": "Percent", "value": 50, "periodSeconds": 60}],
            },
        },
    },
}


def merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """Helm's merge: maps merge key by key, anything else replaces, and null deletes the key."""
    out = dict(base)
    for key, value in override.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


@dataclass(frozen=True)
class Autoscaler:
    """The autoscaling the chart renders for the given values."""

    kind: Literal["none", "hpa", "keda"]
    replicas: int  # fixed count when kind is none, else the starting count
    min_replicas: int
    max_replicas: int
    queue_target: float
    gpu_target: float | None  # percent; None when not scaling on GPU
    gpus_per_pod: int
    rules: Behavior
    polling_interval: int
    cooldown: int
    activation_queue_depth: float
    scale_to_zero: bool
    wake_threshold: float | None  # per-pod requests/s of the wakeQuery trigger; None without wakeQuery
    wake_activation: float

    def describe(self) -> str:
        if self.kind == "none":
            return f"no autoscaler: {self.replicas} replicas"
        metrics = [f"queue depth {self.queue_target:g}/pod"]
        if self.gpu_target is not None:
            metrics.append(f"GPU {self.gpu_target:g}%")
        if self.wake_threshold is not None:
            metrics.append(f"wakeQuery {self.wake_threshold:g} req/s per pod")
        zero = ", scale to zero" if self.scale_to_zero else ""
        return f"{self.kind.upper()} on {' + '.join(metrics)}, {self.min_replicas}-{self.max_replicas} replicas{zero}"


def load_values(files: list[Path], chart_values: Path = CHART_VALUES) -> Autoscaler:
    """Merge the chart's values.yaml (or the built-in defaults) and each -f file, in order."""
    values = BUILTIN_VALUES
    for path in ([chart_values] if chart_values.exists() else []) + list(files):
        values = merge(values, yaml.safe_load(path.read_text()) or {})
    scaling, keda = values["autoscaling"], values["autoscaling"].get("keda") or {}
    hpa_on, keda_on = bool(scaling.get("hpa", {}).get("enabled")), bool(keda.get("enabled"))
    if hpa_on and keda_on:
        raise ValueError("autoscaling.hpa.enabled and autoscaling.keda.enabled are mutually exclusive")
    gpu, gpu_scaling = values.get("gpu") or {}, scaling.get("gpuUtilization") or {}
    gpu_on = bool(gpu.get("enabled", True))
    low = int(scaling.get("minReplicas", 1))
    wake_query = bool(keda.get("wakeQuery"))
    return Autoscaler(
        kind="keda" if keda_on else "hpa" if hpa_on else "none",
        replicas=int(values.get("replicaCount", 1)) if not (hpa_on or keda_on) else max(low, 1),
        min_replicas=max(low, 1),  # KEDA: minReplicaCount 0 still gives the HPA minReplicas 1
        max_replicas=int(scaling.get("maxReplicas", 8)),
        queue_target=float(scaling["queueDepth"]["target"]),
        gpu_target=float(gpu_scaling["target"]) if gpu_on and gpu_scaling.get("enabled") else None,
        gpus_per_pod=int(gpu.get("count", 1)) if gpu_on else 0,
        rules=behavior(scaling.get("behavior")),
        polling_interval=int(keda.get("pollingInterval", 30)),
        cooldown=int(keda.get("cooldownPeriod", 300)),
        activation_queue_depth=float(keda.get("activationQueueDepth", 0)),
        scale_to_zero=keda_on and (keda.get("idleReplicaCount") == 0 or low == 0),
        wake_threshold=float(keda.get("wakeThreshold", 10)) if wake_query else None,
        wake_activation=float(keda.get("wakeActivationThreshold", 0)),
    )


class Step(BaseModel):
    users: int
    rps: float
    p50_ms: float
    p99_ms: float
    queue_depth: float | None = None
    shed_rate: float = 0.0
    gpu_utilization: float | None = None


class CapacityFile(BaseModel):
    """The format `python -m loadtests.capacity` writes (version 1)."""

    version: Literal[1]
    target: str = ""
    model: str = ""
    device: str = ""
    steps: list[Step]
    max_rps: float


@dataclass(frozen=True)
class PodModel:
    """One pod, from its measured load steps: curves over the per-pod throughput (requests/s)."""

    max_rps: float
    max_queue: float  # queue depth where shedding starts
    rps: np.ndarray  # increasing throughputs of the steps before shedding
    queue: np.ndarray  # mean queue depth at those throughputs
    p99_s: np.ndarray
    gpu: np.ndarray | None  # GPU utilization 0..1 at those throughputs; None: not measured (CPU run)
    notes: tuple[str, ...] = ()

    def queue_at(self, rps: float) -> float:
        return float(np.interp(rps, np.r_[0.0, self.rps], np.r_[0.0, self.queue]))

    def p99_at(self, rps: float) -> float:
        return float(np.interp(rps, self.rps, self.p99_s))

    def gpu_at(self, rps: float) -> float:
        if self.gpu is None:
            return min(rps / self.max_rps, 1.0)
        return float(np.interp(rps, np.r_[0.0, self.rps], np.r_[0.0, self.gpu]))

    @property
    def max_gpu(self) -> float:
        return 1.0 if self.gpu is None else float(self.gpu.max())


def load_capacity(path: Path, max_queue: float | None = None) -> PodModel:
    """The pod model from a capacity file; `max_queue` overrides where shedding starts."""
    data = CapacityFile.model_validate(json.loads(path.read_text()))
    steps = sorted(data.steps, key=lambda s: s.users)
    if not steps or data.max_rps <= 0:
        raise ValueError(f"{path}: no load steps with throughput")
    notes = []
    for step in steps:
        if step.queue_depth is None:  # Little's law: L = lambda x W
            step.queue_depth = step.rps * step.p50_ms / 1000
            notes.append(f"queue depth at {step.users} users from Little's law (rps x p50)")
    shedding = [s for s in steps if s.shed_rate > 0]
    if max_queue is None:
        if shedding:
            max_queue = _depth(shedding[0])
        else:
            max_queue = max(_depth(s) for s in steps)
            notes.append(
                f"no step shed: shedding assumed at the deepest queue seen ({max_queue:.1f}); see --max-queue-depth"
            )
    curve: list[Step] = []
    for step in steps:
        if step.shed_rate > 0:
            break
        if not curve or step.rps > curve[-1].rps:  # past the knee throughput stops growing
            curve.append(step)
    curve = curve or steps[:1]
    measured_gpu = all(s.gpu_utilization is not None for s in curve)
    if not measured_gpu:
        notes.append("GPU utilization not measured: modelled as throughput / max_rps")
    return PodModel(
        max_rps=data.max_rps,
        max_queue=float(max_queue),
        rps=np.array([s.rps for s in curve]),
        queue=np.maximum.accumulate([_depth(s) for s in curve]),
        p99_s=np.array([s.p99_ms / 1000 for s in curve]),
        gpu=np.array([s.gpu_utilization for s in curve]) if measured_gpu else None,
        notes=tuple(notes),
    )


def _depth(step: Step) -> float:
    """A step's queue depth, once load_capacity has filled in the ones the file left out."""
    if step.queue_depth is None:
        raise ValueError(f"no queue depth at {step.users} users")
    return step.queue_depth


@dataclass(frozen=True)
class Profile:
    """Arrivals per second, and what they are."""

    rps: np.ndarray
    label: str


def synthetic_profile(
    shape: str, base: float, peak: float, duration: int, rise_at: int, spike_seconds: int, period: int
) -> Profile:
    """step: base then peak from rise_at; spike: peak for spike_seconds from rise_at; diurnal: a cosine day
    between base and peak with the given period (its trough at t=0)."""
    t = np.arange(duration, dtype=float)
    if shape == "step":
        rps, label = np.where(t >= rise_at, peak, base), f"step {base:g} -> {peak:g} rps at {rise_at}s"
    elif shape == "spike":
        on = (t >= rise_at) & (t < rise_at + spike_seconds)
        rps, label = np.where(on, peak, base), f"spike {base:g} -> {peak:g} rps for {spike_seconds}s at {rise_at}s"
    elif shape == "diurnal":
        rps = base + (peak - base) * (1 - np.cos(2 * math.pi * t / period)) / 2
        label = f"diurnal {base:g}..{peak:g} rps, period {period}s"
    else:
        raise ValueError(f"unknown profile {shape!r}: step, spike, diurnal or locust:PATH")
    return Profile(rps, label)


def locust_profile(path: Path) -> Profile:
    """Requests/s of the Aggregated rows of a Locust `*_stats_history.csv`, held per second."""
    with path.open(newline="") as f:
        rows = [(float(r["Timestamp"]), float(r["Requests/s"])) for r in csv.DictReader(f) if r["Name"] == "Aggregated"]
    if len(rows) < 2:
        raise ValueError(f"{path}: fewer than two Aggregated rows")
    times, rates = np.array(rows).T
    times -= times[0]
    seconds = np.arange(int(times[-1]) + 1)
    held = rates[np.searchsorted(times, seconds, side="right") - 1]
    return Profile(held, f"Locust history {path.name} ({len(seconds)}s)")
