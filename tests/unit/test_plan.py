"""`imgserve plan`: the autoscaling algorithms against the worked examples of the docs, the simulation, the CLI,
and an end-to-end run on a capacity file measured against a real local server.

Doc sources (the stored copies read for the expectations below):
- HPA: kubernetes/website content/en/docs/concepts/workloads/autoscaling/horizontal-pod-autoscale.md
  https://kubernetes.io/docs/concepts/workloads/autoscaling/horizontal-pod-autoscale/
- KEDA: kedacore/keda-docs content/docs/2.21/reference/scaledobject-spec.md (triggers.metricType) and
  content/docs/2.21/concepts/scaling-deployments.md (Activating and Scaling thresholds)
  https://keda.sh/docs/2.21/reference/scaledobject-spec/ , https://keda.sh/docs/2.21/concepts/scaling-deployments/
"""

from __future__ import annotations

from pathlib import Path

import pytest
from plan_runs import assert_plan_outputs, run_plan
from serving import TESTS

from imgserve.cli import main
from imgserve.tools.plan import hpa, inputs, report
from imgserve.tools.plan.simulate import simulate

DATA = TESTS / "plan_data"
NO_CHART = Path("/nonexistent/values.yaml")  # the built-in defaults, not the chart being edited


def values(tmp_path: Path, text: str) -> inputs.Autoscaler:
    path = tmp_path / "values.yaml"
    path.write_text(text)
    return inputs.load_values([path], chart_values=NO_CHART)


@pytest.fixture
def pod() -> inputs.PodModel:
    return inputs.load_capacity(DATA / "capacity.json")


# --- HPA: "Algorithm details" -------------------------------------------------------------------------------


def test_ratio_doubles_and_halves() -> None:
    """Doc: current 200m, desired 100m -> replicas doubled (200.0/100.0 == 2.0); 50m -> halved (0.5)."""
    assert hpa.pods_metric_replicas(3, [0.2] * 3, 0, target=0.1) == 6
    assert hpa.pods_metric_replicas(4, [0.05] * 4, 0, target=0.1) == 2


def test_tolerance_skips_small_changes() -> None:
    """Doc: scaling is skipped when the ratio is within the tolerance of 1.0 (0.1 by default)."""
    assert hpa.pods_metric_replicas(10, [105] * 10, 0, target=100) == 10  # ratio 1.05
    assert hpa.pods_metric_replicas(10, [92] * 10, 0, target=100) == 10  # ratio 0.92
    assert hpa.pods_metric_replicas(10, [111] * 10, 0, target=100) == 12  # ratio 1.11: ceil(11.1)
    assert hpa.pods_metric_replicas(10, [85] * 10, 0, target=100) == 9  # ratio 0.85: ceil(8.5)


def test_missing_pods_dampen_the_change() -> None:
    """Doc: pods without metrics count as 0% of the target on a scale-up and 100% on a scale-down, and no action
    is taken if the recomputed ratio is within the tolerance or reverses the direction. Here 2 of 4 pods are not
    Ready yet (no sample), target 8 per pod."""
    # scale-up: (16+16+0+0)/4 = 8 -> ratio 1.0, within tolerance: stay at 4 (not ceil(2 x 2) = 4 more)
    assert hpa.pods_metric_replicas(4, [16, 16], 2, target=8) == 4
    # scale-up: (24+24+0+0)/4 = 12 -> ratio 1.5 -> ceil(1.5 x 4) = 6
    assert hpa.pods_metric_replicas(4, [24, 24], 2, target=8) == 6
    # scale-down: (2+2+8+8)/4 = 5 -> ratio 0.625 -> ceil(0.625 x 4) = 3 (not ceil(0.25 x 2) = 1)
    assert hpa.pods_metric_replicas(4, [2, 2], 2, target=8) == 3
    assert hpa.pods_metric_replicas(4, [], 4, target=8) is None


def test_largest_metric_wins_and_missing_metrics_block_scale_down() -> None:
    """Doc: with several metrics the largest desired count is chosen; if one cannot be computed and the others
    suggest a scale-down, scaling is skipped (a scale-up still happens)."""
    assert hpa.combine(4, [2, 7]) == 7
    assert hpa.combine(4, [2, None]) == 4
    assert hpa.combine(4, [6, None]) == 6


# --- HPA: "Configurable scaling behavior" ---------------------------------------------------------------------


def _scale_down_run(rules: hpa.Behavior, start: int, desired: int, every: int, syncs: int) -> list[int]:
    """Replica counts after each sync, with the same desired count each time (no stabilization)."""
    replicas, events, out = start, [], []
    for i in range(syncs):
        now = i * every
        new = hpa.rate_limit(replicas, desired, events, now, low=1, high=100, rules=rules)
        if new != replicas:
            events.append((now, new - replicas))
        replicas = new
        out.append(replicas)
    return out


def test_scale_down_policies_example() -> None:
    """Doc (Scaling policies): Pods 4 per 60s and Percent 10 per 60s, 80 replicas to 10: "during the first step
    8 replicas will be reduced. In the next iteration when the number of replicas is 72, 10% of the pods is 7.2
    but the number is rounded up to 8", and below 40 replicas "4 replicas will be reduced at a time".
    The rest hand-computed: 64 -> 57 (6.4 -> 7), 51, 45, 40, then -4 each minute down to 10."""
    rules = hpa.behavior(
        {
            "scaleDown": {
                "stabilizationWindowSeconds": 0,
                "policies": [
                    {"type": "Pods", "value": 4, "periodSeconds": 60},
                    {"type": "Percent", "value": 10, "periodSeconds": 60},
                ],
            }
        }
    )
    assert _scale_down_run(rules, 80, 10, every=60, syncs=15) == [
        72,
        64,
        57,
        51,
        45,
        40,
        36,
        32,
        28,
        24,
        20,
        16,
        12,
        10,
        10,
    ]
    # the period holds: syncing every 15 s still removes at most 8 in the first minute
    assert _scale_down_run(rules, 80, 10, every=15, syncs=5) == [72, 72, 72, 72, 64]


def test_select_policy_min_and_disabled() -> None:
    """Doc: selectPolicy Min picks the policy with the smallest change (Percent 10 vs Pods 5 per minute);
    Disabled turns scaling in that direction off."""
    both = [{"type": "Percent", "value": 10, "periodSeconds": 60}, {"type": "Pods", "value": 5, "periodSeconds": 60}]
    least = hpa.behavior({"scaleDown": {"policies": both, "selectPolicy": "Min"}})
    assert hpa.rate_limit(100, 10, [], 0, 1, 100, least) == 95  # min(change 10, change 5) = 5
    assert hpa.rate_limit(30, 10, [], 0, 1, 100, least) == 27  # 10% of 30 = 3 < 5
    off = hpa.behavior({"scaleDown": {"selectPolicy": "Disabled"}})
    assert hpa.rate_limit(30, 10, [], 0, 1, 100, off) == 30
    assert hpa.rate_limit(30, 40, [], 0, 1, 100, off) == 40  # scale-up keeps its default (+100% per 15 s)


def test_default_scale_up() -> None:
    """Doc (Default behavior): scale-up adds at most max(100%, 4 pods) every 15 s, with no stabilization window.
    Hand-computed from 1 replica towards 20: 1 -> max(2, 5) = 5 -> max(10, 9) = 10 -> max(20, 14) = 20."""
    replicas, events = 1, []
    for now in (0, 15, 30):
        new = hpa.rate_limit(replicas, 20, events, now, 1, 50)
        events.append((now, new - replicas))
        replicas = new
        assert replicas == {0: 5, 15: 10, 30: 20}[now]
    assert hpa.DEFAULT_BEHAVIOR.scale_down.stabilization_window_seconds == 300
    assert hpa.rate_limit(10, 1, [], 0, 1, 50) == 1  # default scale-down: 100% per 15 s, down to min


def test_stabilization_windows() -> None:
    """Doc (Stabilization window): on a scale-down the highest recommendation of the window (300 s) is used;
    scale-up uses the lowest of its window."""
    history = [(0, 10), (60, 4), (120, 3)]
    assert hpa.stabilize(10, 2, history, now=150) == 10  # 10 is still within the last 300 s
    assert hpa.stabilize(10, 2, history, now=330) == 4  # t=0 has left the window, t=60 has not
    up = hpa.behavior({"scaleUp": {"stabilizationWindowSeconds": 60}})
    assert hpa.stabilize(2, 9, [(100, 3), (130, 6)], now=150, rules=up) == 3  # lowest of the last 60 s
    assert hpa.stabilize(2, 9, [(100, 3), (130, 6)], now=170, rules=up) == 6


def test_behavior_defaults_merge_per_field() -> None:
    """Doc: "These custom values are merged with default values" — only the given fields change."""
    rules = hpa.behavior({"scaleDown": {"stabilizationWindowSeconds": 60}})
    assert rules.scale_down.stabilization_window_seconds == 60
    assert rules.scale_down.policies == hpa.DEFAULT_BEHAVIOR.scale_down.policies
    assert rules.scale_up == hpa.DEFAULT_BEHAVIOR.scale_up


# --- KEDA ---------------------------------------------------------------------------------------------------


def test_keda_metric_types() -> None:
    """KEDA scaledobject-spec (triggers.metricType), 3 running replicas: AverageValue, queue 20, threshold 5 ->
    20 / 5 = 4 replicas "regardless of the current replica count"; Value, average time 20 ms, threshold 5 ->
    3 x 20 / 5 = 12. And a total queue of 200 with a target of 20 per pod -> 10."""
    assert hpa.external_average_replicas(3, total=20, target=5) == 4
    assert hpa.external_value_replicas(3, ready=3, value=20, target=5) == 12
    assert hpa.external_average_replicas(4, total=200, target=20) == 10


def test_keda_activation() -> None:
    """KEDA scaling-deployments: activation "only occurs when this value is greater than the set value; not
    greater than or equal to"; from zero KEDA sets minReplicaCount (1 if 0) whatever the metric; with
    idleReplicaCount 0 it goes back to 0 after cooldownPeriod without an active trigger."""
    assert not hpa.keda_active(1, 1) and hpa.keda_active(1.5, 1)
    assert hpa.keda_replicas(0, True, 0, min_replicas=1, scale_to_zero=True, cooldown=300) == 1
    assert hpa.keda_replicas(0, True, 0, min_replicas=3, scale_to_zero=True, cooldown=300) == 3
    assert hpa.keda_replicas(0, False, 999, 1, True, 300) == 0
    assert hpa.keda_replicas(4, False, 299, 1, True, 300) == 4
    assert hpa.keda_replicas(4, False, 300, 1, True, 300) == 0
    assert hpa.keda_replicas(4, False, 999, 1, False, 300) == 4  # no idleReplicaCount: the HPA keeps min


# --- inputs -------------------------------------------------------------------------------------------------


def test_values_merge_like_helm(tmp_path: Path) -> None:
    scaler = values(tmp_path, "autoscaling:\n  hpa: {enabled: true}\n  maxReplicas: 3\n  behavior: null\n")
    assert (scaler.kind, scaler.max_replicas, scaler.gpu_target) == ("hpa", 3, 80)
    assert scaler.rules == hpa.DEFAULT_BEHAVIOR  # null deleted the chart's behavior: the HPA defaults apply
    with pytest.raises(ValueError, match="mutually exclusive"):
        values(tmp_path, "autoscaling:\n  hpa: {enabled: true}\n  keda: {enabled: true}\n")


def test_capacity_model(pod: inputs.PodModel, tmp_path: Path) -> None:
    assert pod.max_queue == 32.0  # the first shedding step
    assert pod.queue_at(10) == pytest.approx(0.9) and pod.queue_at(17.5) == pytest.approx(2.35)
    assert pod.gpu_at(15.25) == pytest.approx(0.5) and any("modelled" in n for n in pod.notes)
    little = tmp_path / "little.json"
    steps = (
        '[{"users": 1, "rps": 10, "p50_ms": 100, "p99_ms": 200}, {"users": 2, "rps": 20, "p50_ms": 100, "p99_ms": 200}]'
    )
    little.write_text(f'{{"version": 1, "steps": {steps}, "max_rps": 20}}')
    model = inputs.load_capacity(little)
    assert model.queue_at(20) == pytest.approx(2.0)  # L = 20/s x 0.1 s
    assert model.max_queue == pytest.approx(2.0) and any("--max-queue-depth" in n for n in model.notes)


def test_locust_history_profile() -> None:
    profile = inputs.locust_profile(DATA / "locust_stats_history.csv")
    assert len(profile.rps) == 31
    assert profile.rps[0] == 0 and profile.rps[10] == 20 and profile.rps[30] == 5  # Aggregated rows only


# --- simulation and warnings ----------------------------------------------------------------------------------


def test_step_load_scales_within_bounds(pod: inputs.PodModel, tmp_path: Path) -> None:
    scaler = values(tmp_path, "autoscaling:\n  hpa: {enabled: true}\n")
    profile = inputs.synthetic_profile("step", 5, 100, 1200, 300, 0, 0)
    tl = simulate(scaler, pod, profile.rps, startup=60)
    assert tl.replicas.min() >= 1 and tl.replicas.max() <= 8
    assert tl.ready[-1] >= 4  # 100 rps needs ceil(100 / 30.5) = 4 pods
    assert tl.shed[:300].sum() == 0 and tl.shed[600:].sum() == 0  # sheds only while new pods start
    assert (tl.ready <= tl.replicas).all()
    summary = report.summarize(tl, pod, scaler)
    assert summary.catch_up_s is not None and 60 <= summary.catch_up_s <= 300
    assert summary.gpu_minutes == pytest.approx(tl.replicas.sum() / 60)


def test_fixed_replicas_never_change(pod: inputs.PodModel, tmp_path: Path) -> None:
    scaler = values(tmp_path, "replicaCount: 2\n")
    tl = simulate(scaler, pod, inputs.synthetic_profile("step", 5, 100, 600, 100, 0, 0).rps, startup=60)
    assert set(tl.replicas) == {2} and tl.shed[200:].mean() == pytest.approx(100 - 61)


def test_queue_target_above_pod_max_never_scales(pod: inputs.PodModel, tmp_path: Path) -> None:
    scaler = values(
        tmp_path, "gpu: {enabled: false}\nautoscaling:\n  hpa: {enabled: true}\n  queueDepth: {target: 40}\n"
    )
    tl = simulate(scaler, pod, inputs.synthetic_profile("step", 5, 100, 900, 100, 0, 0).rps, startup=60)
    assert set(tl.replicas) == {1}
    assert any("will never scale" in w for w in report.warnings(scaler, pod, tl, 60))


def test_scale_to_zero_without_wake_never_wakes(pod: inputs.PodModel, tmp_path: Path) -> None:
    keda = "autoscaling:\n  keda: {enabled: true, idleReplicaCount: 0%s}\n"
    profile = inputs.synthetic_profile("step", 0, 20, 900, 300, 0, 0).rps
    asleep = values(tmp_path, keda % "")
    tl = simulate(asleep, pod, profile, startup=30)
    assert tl.replicas.max() == 0 and tl.shed.sum() == pytest.approx(tl.arrivals.sum())
    assert any("will never wake" in w for w in report.warnings(asleep, pod, tl, 30))
    awake = values(tmp_path, keda % ', wakeQuery: "sum(rate(ingress_requests[1m]))"')
    tl = simulate(awake, pod, profile, startup=30)
    assert tl.replicas[:300].max() == 0 and tl.ready[-1] >= 1 and tl.shed[400:].sum() == 0
    assert not any("never wake" in w for w in report.warnings(awake, pod, tl, 30))


def test_spike_shorter_than_startup_warns(pod: inputs.PodModel, tmp_path: Path) -> None:
    scaler = values(tmp_path, "autoscaling:\n  keda: {enabled: true}\n")
    tl = simulate(scaler, pod, inputs.synthetic_profile("spike", 5, 90, 900, 300, 60, 0).rps, startup=120)
    assert any("longer than the spike" in w for w in report.warnings(scaler, pod, tl, 120))
    assert tl.ready[300:360].max() == 1  # nothing new was Ready in time


def test_short_scale_down_window_flaps(pod: inputs.PodModel, tmp_path: Path) -> None:
    short = "autoscaling:\n  hpa: {enabled: true}\n  behavior:\n    scaleDown: {stabilizationWindowSeconds: %d}\n"
    profile = inputs.synthetic_profile("diurnal", 5, 100, 2400, 0, 0, 600).rps
    flappy = values(tmp_path, short % 30)
    tl = simulate(flappy, pod, profile, startup=60)
    assert report.summarize(tl, pod, flappy).oscillations >= 4
    assert any("flapping" in w for w in report.warnings(flappy, pod, tl, 60))
    steady = values(tmp_path, short % 900)
    tl = simulate(steady, pod, profile, startup=60)
    assert report.summarize(tl, pod, steady).oscillations <= 1


# --- CLI ------------------------------------------------------------------------------------------------------


def test_cli_writes_plot_and_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    keda = tmp_path / "keda.yaml"
    keda.write_text("autoscaling:\n  keda: {enabled: true}\n  maxReplicas: 6\n")
    code, summary = run_plan(
        tmp_path,
        DATA / "capacity.json",
        "-f",
        str(keda),
        "--profile",
        "spike",
        "--peak-rps",
        "150",
        "--duration",
        "900",
        "--strict",
    )
    assert code == 1  # --strict, and the 60 s spike is over before pods asked for after ~20 s + 45 s are Ready
    assert_plan_outputs(tmp_path, summary, 1, 6)
    assert "KEDA" in capsys.readouterr().out and "Warnings:" in summary


def test_cli_locust_profile_and_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, summary = run_plan(
        tmp_path, DATA / "capacity.json", "--profile", f"locust:{DATA / 'locust_stats_history.csv'}"
    )
    assert code == 0 and "Locust history" in summary
    assert main(["plan", "--capacity", str(DATA / "capacity.json"), "--profile", "step"]) == 2
    assert "needs --peak-rps" in capsys.readouterr().err
