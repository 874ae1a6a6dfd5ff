"""The cluster over time, one second a step: arrivals split evenly across Ready pods, each serves up to its
capacity, the excess waits in the pods' queues up to the depth where they shed (503); the autoscaler acts on
what Prometheus saw `lag` seconds ago, and new pods serve only once Ready (`startup` seconds after creation)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from imgserve.tools.plan.hpa import (
    SYNC_PERIOD_S,
    Event,
    Recommendation,
    combine,
    external_average_replicas,
    external_value_replicas,
    keda_active,
    keda_replicas,
    pods_metric_replicas,
    rate_limit,
    stabilize,
)
from imgserve.tools.plan.inputs import Autoscaler, PodModel


class Second(NamedTuple):
    """One second of the cluster (per-pod values are those of each Ready pod)."""

    arrivals: float  # requests/s offered
    served: float
    shed: float
    replicas: float  # pods that exist (the scale target's replicas)
    ready: float
    queue: float  # per-pod queue depth (admitted, not answered)
    latency_s: float  # p99-ish latency of the requests admitted in this second
    gpu: float  # per-pod GPU utilization 0..1


@dataclass(frozen=True)
class Timeline:
    """`Second`'s fields as arrays over the run (after the warm-up)."""

    arrivals: np.ndarray
    served: np.ndarray
    shed: np.ndarray
    replicas: np.ndarray
    ready: np.ndarray
    queue: np.ndarray
    latency_s: np.ndarray
    gpu: np.ndarray


@dataclass
class Cluster:
    """The pods (when each is or becomes Ready), the requests waiting beyond one second's service, and the
    autoscaler's memory (recommendations for the stabilization windows, scale events for the policies)."""

    ready_at: list[float]
    backlog: float = 0.0
    recommendations: list[Recommendation] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    last_active: float = 0.0

    @property
    def replicas(self) -> int:
        return len(self.ready_at)

    def ready(self, now: float) -> int:
        return sum(at <= now for at in self.ready_at)

    def scale(self, replicas: int, now: float, startup: float) -> None:
        """Add pods that become Ready after `startup`, or remove the not-yet-Ready and then the newest first
        (the ReplicaSet's order); removed pods drain their own share of the backlog."""
        before = self.ready(now)
        self.ready_at = sorted(self.ready_at)[:replicas] + [now + startup] * (replicas - self.replicas)
        if before:
            self.backlog *= self.ready(now) / before


def serve(pod: PodModel, cluster: Cluster, arrivals: float, now: float) -> Second:
    """One second of traffic through the Ready pods."""
    ready = cluster.ready(now)
    if not ready:  # no endpoints: everything is refused
        cluster.backlog = 0.0
        return Second(arrivals, 0.0, arrivals, cluster.replicas, 0, 0.0, math.nan, 0.0)
    work = cluster.backlog + arrivals
    served = min(work, ready * pod.max_rps)
    room = ready * max(0.0, pod.max_queue - pod.queue_at(pod.max_rps))
    shed = max(0.0, work - served - room)
    cluster.backlog = work - served - shed
    waiting, per_pod = cluster.backlog / ready, served / ready
    return Second(
        arrivals,
        served,
        shed,
        cluster.replicas,
        ready,
        min(pod.max_queue, pod.queue_at(per_pod) + waiting),
        pod.p99_at(per_pod) + waiting / pod.max_rps,
        pod.gpu_at(per_pod),
    )


def _proposals(scaler: Autoscaler, seen: Second, sampled: int, current: int, ready: int) -> list[int | None]:
    """Desired replicas per metric. HPA: Pods metrics over the sampled pods (the rest are missing);
    KEDA: the queue total as AverageValue, GPU average as Value (no sample reads 0), wakeQuery as AverageValue."""
    rules = scaler.rules
    if scaler.kind == "hpa":
        missing = current - sampled
        out = [pods_metric_replicas(current, [seen.queue] * sampled, missing, scaler.queue_target, rules)]
        if scaler.gpu_target is not None:
            out.append(pods_metric_replicas(current, [seen.gpu * 100] * sampled, missing, scaler.gpu_target, rules))
        return out
    out = [external_average_replicas(current, seen.queue * sampled, scaler.queue_target, rules)]
    if scaler.gpu_target is not None:
        gpu = seen.gpu * 100 if sampled else 0.0
        out.append(external_value_replicas(current, ready, gpu, scaler.gpu_target, rules))
    if scaler.wake_threshold is not None:
        out.append(external_average_replicas(current, seen.arrivals, scaler.wake_threshold, rules))
    return out


def _keda_active(scaler: Autoscaler, seen: Second, sampled: int) -> bool:
    """Any trigger above its activation threshold (the GPU trigger has none: KEDA's default 0)."""
    return (
        keda_active(seen.queue * sampled, scaler.activation_queue_depth)
        or (scaler.gpu_target is not None and sampled > 0 and keda_active(seen.gpu * 100, 0))
        or (scaler.wake_threshold is not None and keda_active(seen.arrivals, scaler.wake_activation))
    )


def autoscale(scaler: Autoscaler, cluster: Cluster, history: list[Second], now: int, startup: float, lag: int) -> None:
    """KEDA's poll (0 <-> 1) every pollingInterval, then the HPA's sync (1 <-> N) every 15 s."""
    seen = history[max(0, now - lag)]
    sampled = sum(at <= now - lag for at in cluster.ready_at)  # pods Prometheus had scraped by then
    if scaler.kind == "keda" and now % scaler.polling_interval == 0:
        active = _keda_active(scaler, seen, sampled)
        if active:
            cluster.last_active = now
        idle_for = now - cluster.last_active
        replicas = keda_replicas(
            cluster.replicas, active, idle_for, scaler.min_replicas, scaler.scale_to_zero, scaler.cooldown
        )
        cluster.scale(replicas, now, startup)
    if not cluster.replicas or now % SYNC_PERIOD_S:  # at zero the HPA is inactive
        return
    current, rules = cluster.replicas, scaler.rules
    desired = combine(current, _proposals(scaler, seen, sampled, current, cluster.ready(now)))
    stable = stabilize(current, desired, cluster.recommendations, now, rules)
    cluster.recommendations.append((now, desired))
    replicas = rate_limit(current, stable, cluster.events, now, scaler.min_replicas, scaler.max_replicas, rules)
    if replicas != current:
        cluster.events.append((now, replicas - current))
        cluster.scale(replicas, now, startup)


def warmup_seconds(scaler: Autoscaler, startup: float) -> int:
    """Long enough at the first load value for the windows and the cooldown to settle."""
    cooldown = scaler.cooldown if scaler.scale_to_zero else 0
    return int(startup + max(scaler.rules.scale_down.stabilization_window_seconds, cooldown) + 300)


def simulate(scaler: Autoscaler, pod: PodModel, arrivals: np.ndarray, startup: float, lag: int = 15) -> Timeline:
    """Replay `arrivals` (requests/s, one per second), starting from the steady state of its first value."""
    warmup = warmup_seconds(scaler, startup)
    cluster = Cluster(ready_at=[0.0] * scaler.replicas)
    history: list[Second] = []
    for now, rate in enumerate(np.r_[np.full(warmup, arrivals[0]), arrivals]):
        history.append(serve(pod, cluster, float(rate), now))
        if scaler.kind != "none":
            autoscale(scaler, cluster, history, now, startup, lag)
    columns = np.array(history[warmup:], dtype=float).T
    return Timeline(*columns)
