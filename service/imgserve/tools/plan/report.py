"""What `imgserve plan` shows: the summary table, the warnings, and the plot."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from imgserve.tools.plan.inputs import Autoscaler, PodModel
from imgserve.tools.plan.simulate import Timeline


@dataclass(frozen=True)
class Summary:
    peak_replicas: int
    gpu_minutes: float
    shedding_seconds: int
    shed_share: float
    p99_latency_s: float  # over served requests; nan if none served
    oscillations: int  # direction changes of the replica count
    catch_up_s: int | None  # longest stretch with fewer Ready pods than the load needs; None: never caught up


def _direction_changes(replicas: np.ndarray) -> np.ndarray:
    """Indices where the replica count turns around (up after down, or down after up)."""
    moves = np.flatnonzero(np.diff(replicas))
    signs = np.sign(np.diff(replicas)[moves])
    turns: np.ndarray = moves[1:][signs[1:] != signs[:-1]]
    return turns


def _weighted_percentile(values: np.ndarray, weights: np.ndarray, q: float) -> float:
    keep = weights > 0
    if not keep.any():
        return math.nan
    order = np.argsort(values[keep])
    cumulative = np.cumsum(weights[keep][order])
    return float(values[keep][order][np.searchsorted(cumulative, q * cumulative[-1])])


def _needed(arrivals: np.ndarray, pod: PodModel) -> np.ndarray:
    """Pods the load needs: ceil(arrivals / pod capacity)."""
    return np.ceil(np.round(arrivals / pod.max_rps, 9))


def _under_capacity(tl: Timeline, pod: PodModel) -> list[tuple[int, int]]:
    """(start, end) stretches where fewer pods are Ready than the load needs."""
    short = tl.ready < _needed(tl.arrivals, pod)
    edges = np.flatnonzero(np.diff(np.r_[0, short.astype(int), 0]))
    return list(zip(edges[::2], edges[1::2], strict=True))


def summarize(tl: Timeline, pod: PodModel, scaler: Autoscaler) -> Summary:
    stretches = _under_capacity(tl, pod)
    unresolved = bool(stretches) and stretches[-1][1] == len(tl.arrivals)
    return Summary(
        peak_replicas=int(tl.replicas.max()),
        gpu_minutes=float(tl.replicas.sum()) / 60 * scaler.gpus_per_pod,
        shedding_seconds=int((tl.shed > 1e-9).sum()),
        shed_share=float(tl.shed.sum() / tl.arrivals.sum()) if tl.arrivals.sum() else 0.0,
        p99_latency_s=_weighted_percentile(tl.latency_s, tl.served, 0.99),
        oscillations=len(_direction_changes(tl.replicas)),
        catch_up_s=None if unresolved else max((end - start for start, end in stretches), default=0),
    )


def table(s: Summary, tl: Timeline, scaler: Autoscaler) -> str:
    """The summary as a markdown table."""
    latency = "n/a" if math.isnan(s.p99_latency_s) else f"{s.p99_latency_s * 1000:.0f} ms"
    catch_up = "never (still short at the end)" if s.catch_up_s is None else f"{s.catch_up_s} s"
    rows = [
        ("Peak replicas", f"{s.peak_replicas} (min {scaler.min_replicas}, max {scaler.max_replicas})"),
        ("GPU-minutes", f"{s.gpu_minutes:.1f} ({scaler.gpus_per_pod} GPU/pod)"),
        ("Time with shedding", f"{s.shedding_seconds} s of {len(tl.arrivals)} s"),
        ("Shed requests", f"{s.shed_share:.2%} ({tl.shed.sum():.0f} of {tl.arrivals.sum():.0f})"),
        ("p99-ish latency", latency),
        ("Oscillations", f"{s.oscillations} direction changes"),
        ("Time to reach needed capacity", catch_up),
    ]
    return "\n".join(["| Metric | Value |", "|---|---|", *(f"| {name} | {value} |" for name, value in rows)])


def warnings(scaler: Autoscaler, pod: PodModel, tl: Timeline, startup: float) -> list[str]:
    """Settings that will not do what they seem to, from the values and from what the run showed."""
    out: list[str] = []
    if scaler.kind == "none":
        return out
    reach = 1 + scaler.rules.scale_up.tolerance  # the ratio a metric must pass to scale up
    queue_stuck = pod.max_queue <= scaler.queue_target * reach
    gpu_stuck = scaler.gpu_target is None or pod.max_gpu * 100 <= scaler.gpu_target * reach
    if queue_stuck:
        out.append(
            f"queue-depth target {scaler.queue_target:g} is above what one pod reaches (it sheds at "
            f"{pod.max_queue:.1f} queued, and scaling needs > target x {reach:g}): "
            + ("will never scale" if gpu_stuck and scaler.wake_threshold is None else "queue depth will never scale")
        )
    if scaler.gpu_target is not None and pod.max_gpu * 100 <= scaler.gpu_target * reach:
        out.append(
            f"GPU target {scaler.gpu_target:g}% is above what one pod reaches ({pod.max_gpu:.0%}): "
            "GPU utilization will never scale"
        )
    if scaler.scale_to_zero and scaler.wake_threshold is None:
        lost = tl.shed[tl.replicas == 0].sum()
        out.append(
            "scale to zero without a wake metric (autoscaling.keda.wakeQuery): will never wake, at zero pods the "
            f"pods' own metrics read 0 ({lost:.0f} requests refused at zero replicas in this run)"
        )
    turns = _direction_changes(tl.replicas)
    window = scaler.rules.scale_down.stabilization_window_seconds
    if len(turns) >= 2:
        period = 2 * float(np.diff(turns).mean())
        if window < period:
            out.append(
                f"scale-down window ({window} s) shorter than the load's period (~{period:.0f} s): flapping, "
                f"replicas changed direction {len(turns)} times; raise behavior.scaleDown.stabilizationWindowSeconds"
            )
    for start, end in _under_capacity(tl, pod):
        shed, asked = tl.shed[start:end].sum(), np.flatnonzero(tl.replicas[start:end] > tl.replicas[start])
        if shed > 0 and end < len(tl.arrivals) and asked.size and tl.ready[end - 1] <= tl.ready[start]:
            out.append(
                f"start-up time longer than the spike at {start} s: it lasted {end - start} s, new pods were asked "
                f"for after {asked[0]} s and are Ready {startup:g} s later; {shed:.0f} requests shed"
            )
    needed = int(_needed(tl.arrivals, pod).max())
    if needed > scaler.max_replicas:
        out.append(f"peak load needs {needed} pods, maxReplicas is {scaler.max_replicas}: sheds at the peak")
    return out


def plot(tl: Timeline, pod: PodModel, scaler: Autoscaler, title: str, path: Path) -> None:
    """Replicas, traffic vs capacity, queue depth vs target, latency and shed rate over time, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = np.arange(len(tl.arrivals))
    fig, (pods, traffic, queue, latency) = plt.subplots(4, 1, figsize=(9, 9), sharex=True, dpi=80)
    pods.step(t, tl.replicas, where="post", label="desired (replicas)")
    pods.step(t, tl.ready, where="post", label="Ready")
    pods.axhline(scaler.max_replicas, color="grey", ls=":", lw=1, label="maxReplicas")
    pods.set_ylabel("pods")
    traffic.plot(t, tl.arrivals, label="arrivals")
    traffic.plot(t, tl.ready * pod.max_rps, label="Ready capacity")
    traffic.plot(t, tl.served, label="served", lw=1)
    traffic.set_ylabel("requests/s")
    queue.plot(t, tl.queue, label="per-pod queue depth")
    queue.axhline(scaler.queue_target, color="C1", ls="--", label="target")
    queue.axhline(pod.max_queue, color="C3", ls=":", label="sheds above")
    queue.set_ylabel("queued")
    latency.plot(t, tl.latency_s * 1000, label="p99-ish latency")
    latency.set_ylabel("ms")
    latency.set_xlabel("seconds")
    shed = latency.twinx()
    with np.errstate(invalid="ignore", divide="ignore"):
        shed.fill_between(t, np.where(tl.arrivals > 0, tl.shed / tl.arrivals, 0) * 100, color="C3", alpha=0.3)
    shed.set_ylabel("shed %", color="C3")
    shed.set_ylim(0, 100)
    for ax in (pods, traffic, queue, latency):
        ax.legend(loc="upper left", fontsize=8)
        ax.grid(alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
