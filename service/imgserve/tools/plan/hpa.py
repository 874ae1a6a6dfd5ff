"""The autoscaling algorithms as documented, as pure functions: the HPA's replica count per metric, its
stabilization windows and `behavior` policies, and KEDA's activation (0 <-> 1).

Sources: kubernetes/website content/en/docs/concepts/workloads/autoscaling/horizontal-pod-autoscale.md
(https://kubernetes.io/docs/concepts/workloads/autoscaling/horizontal-pod-autoscale/), and kedacore/keda-docs
content/docs/2.21/reference/scaledobject-spec.md and concepts/scaling-deployments.md (https://keda.sh/docs/2.21/).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

SYNC_PERIOD_S = 15  # --horizontal-pod-autoscaler-sync-period default
TOLERANCE = 0.1  # --horizontal-pod-autoscaler-tolerance default

# The documented `behavior` defaults ("Default behavior"); given fields are merged over them per direction.
DEFAULT_SCALE_UP = {
    "stabilizationWindowSeconds": 0,
    "selectPolicy": "Max",
    "policies": [
        {"type": "Percent", "value": 100, "periodSeconds": 15},
        {"type": "Pods", "value": 4, "periodSeconds": 15},
    ],
}
DEFAULT_SCALE_DOWN = {
    "stabilizationWindowSeconds": 300,
    "selectPolicy": "Max",
    "policies": [{"type": "Percent", "value": 100, "periodSeconds": 15}],
}

Event = tuple[float, int]  # (time, replicas added (>0) or removed (<0)) by one HPA scaling action
Recommendation = tuple[float, int]  # (time, desired replicas before stabilization)


class _Spec(BaseModel):
    model_config = ConfigDict(frozen=True, populate_by_name=True, extra="forbid")


class Policy(_Spec):
    """One `behavior` policy: at most `value` pods (or percent) of change per `periodSeconds`."""

    type: Literal["Pods", "Percent"]
    value: int = Field(gt=0)
    period_seconds: int = Field(alias="periodSeconds", gt=0, le=1800)


class Rules(_Spec):
    """`behavior.scaleUp` or `behavior.scaleDown`."""

    stabilization_window_seconds: int = Field(alias="stabilizationWindowSeconds", ge=0, le=3600)
    select_policy: Literal["Max", "Min", "Disabled"] = Field("Max", alias="selectPolicy")
    policies: tuple[Policy, ...] = ()
    tolerance: float = Field(TOLERANCE, ge=0)


class Behavior(_Spec):
    """The HPA's `behavior`."""

    scale_up: Rules = Field(alias="scaleUp")
    scale_down: Rules = Field(alias="scaleDown")

    def within_tolerance(self, ratio: float) -> bool:
        """No scaling when the metric/target ratio is within the tolerance of 1 (per direction)."""
        return 1 - self.scale_down.tolerance <= ratio <= 1 + self.scale_up.tolerance


def behavior(spec: dict[str, Any] | None = None) -> Behavior:
    """A `behavior` block with the documented defaults filled in for every field it leaves out."""
    spec = spec or {}
    return Behavior.model_validate(
        {
            "scaleUp": {**DEFAULT_SCALE_UP, **(spec.get("scaleUp") or {})},
            "scaleDown": {**DEFAULT_SCALE_DOWN, **(spec.get("scaleDown") or {})},
        }
    )


DEFAULT_BEHAVIOR = behavior()


def _ceil(x: float) -> int:
    return math.ceil(round(x, 9))  # 2.0000000001 from float noise is 2, not 3


def pods_metric_replicas(
    current: int, values: Sequence[float], missing: int, target: float, rules: Behavior = DEFAULT_BEHAVIOR
) -> int | None:
    """Desired replicas for a `Pods` metric with an AverageValue target (the HPA + prometheus-adapter path).

    `values` are the pods that have a sample; `missing` pods have none (not Ready yet, so not scraped). As the
    docs say, missing pods count as 100% of the target on a scale-down and 0% on a scale-up, and the change is
    dropped if that recomputed ratio is within the tolerance or reverses the direction. None: no samples at all.
    """
    if not values:
        return None
    ratio = sum(values) / len(values) / target
    if not missing:
        return current if rules.within_tolerance(ratio) else _ceil(ratio * len(values))
    fill = target if ratio < 1 else 0.0
    pods = len(values) + missing
    adjusted = (sum(values) + fill * missing) / pods / target
    if rules.within_tolerance(adjusted) or (ratio < 1) != (adjusted < 1):
        return current
    return _ceil(adjusted * pods)


def external_average_replicas(current: int, total: float, target: float, rules: Behavior = DEFAULT_BEHAVIOR) -> int:
    """Desired replicas for an External metric with an AverageValue target (KEDA `metricType: AverageValue`):
    ceil(total / target), "regardless of the current replica count"; the tolerance compares total/current."""
    if rules.within_tolerance(total / (target * current)):
        return current
    return _ceil(total / target)


def external_value_replicas(
    current: int, ready: int, value: float, target: float, rules: Behavior = DEFAULT_BEHAVIOR
) -> int:
    """Desired replicas for an External metric with a Value target (KEDA `metricType: Value`):
    ceil(ready pods x value / target); external metrics count Running and Ready pods."""
    ratio = value / target
    return current if rules.within_tolerance(ratio) else _ceil(ratio * ready)


def combine(current: int, proposals: Sequence[int | None]) -> int:
    """The largest proposal across metrics; if a metric is unavailable (None), only a scale-up is taken."""
    known = [p for p in proposals if p is not None]
    if not known:
        return current
    best = max(known)
    return current if len(known) < len(proposals) and best < current else best


def stabilize(
    current: int, desired: int, history: Sequence[Recommendation], now: float, rules: Behavior = DEFAULT_BEHAVIOR
) -> int:
    """Stabilization windows: scale up to at most the lowest, and down to at least the highest, recommendation
    within each direction's window (`history` plus `desired`)."""

    def recent(window: int) -> list[int]:
        return [desired] + [rec for at, rec in history if at > now - window]

    floor = min(recent(rules.scale_up.stabilization_window_seconds))
    ceiling = max(recent(rules.scale_down.stabilization_window_seconds))
    return min(max(current, floor), ceiling)


def _policy_limit(current: int, events: Sequence[Event], now: float, rules: Rules, up: bool) -> int:
    """The farthest replica count the policies allow, counting changes made within each policy's period."""
    if rules.select_policy == "Disabled" or not rules.policies:
        return current
    limits = []
    for policy in rules.policies:
        recent = [change for at, change in events if at > now - policy.period_seconds]
        start = current - sum(recent)  # replicas at the start of the period
        if policy.type == "Pods":
            limits.append(start + policy.value if up else start - policy.value)
        elif up:
            limits.append(-(-start * (100 + policy.value) // 100))  # rounded up, so 1 pod can always grow
        else:
            limits.append(start * (100 - policy.value) // 100)  # the removal is rounded up
    most_change = rules.select_policy == "Max"
    return max(limits) if most_change == up else min(limits)


def rate_limit(
    current: int,
    desired: int,
    events: Sequence[Event],
    now: float,
    low: int,
    high: int,
    rules: Behavior = DEFAULT_BEHAVIOR,
) -> int:
    """Apply the scale-up/scale-down policies and min/max replicas to a stabilized recommendation."""
    if current > high or current < low:
        return min(max(current, low), high)  # out of range: straight back into it
    if desired > current:
        return min(desired, high, max(current, _policy_limit(current, events, now, rules.scale_up, up=True)))
    if desired < current:
        return max(desired, low, min(current, _policy_limit(current, events, now, rules.scale_down, up=False)))
    return current


def keda_active(value: float, activation_threshold: float) -> bool:
    """A trigger is active only when its value is greater than (not equal to) its activation threshold."""
    return value > activation_threshold


def keda_replicas(
    replicas: int, active: bool, idle_for: float, min_replicas: int, scale_to_zero: bool, cooldown: float
) -> int:
    """KEDA's own step (every pollingInterval): from zero, an active trigger sets minReplicaCount (1 if 0);
    with idleReplicaCount 0, no active trigger for cooldownPeriod sets 0. Otherwise the HPA owns 1 <-> N."""
    if replicas == 0:
        return max(min_replicas, 1) if active else 0
    if scale_to_zero and not active and idle_for >= cooldown:
        return 0
    return replicas
