"""The Grafana dashboard: generated (never hand-edited), complete, and shipped in the chart's ConfigMap."""

from __future__ import annotations

import importlib.util
import json
import re
from types import ModuleType

import pytest
from prom import (
    CHART_VALUES,
    CONTRACT_METRICS,
    DASHBOARD,
    GENERATOR,
    alert_rules,
    dashboard,
    helm_template,
    metric_names,
)

# What the dashboard must show, each as words of a panel title and a metric a panel of it queries.
REQUIRED_PANELS = {
    "Throughput by status code": "imgserve_requests_total",
    "Latency p50 / p95 / p99": "imgserve_request_duration_seconds",
    "Queue depth per pod": "imgserve_queue_depth",
    "Queue wait p50 / p95": "imgserve_queue_wait_seconds",
    "Batch size distribution": "imgserve_batch_size",
    "Inference time per batch": "imgserve_inference_duration_seconds",
    "Shed and timed-out requests by reason": "imgserve_rejected_total",
    "GPU utilization": "DCGM_FI_DEV_GPU_UTIL",
    "GPU memory": "DCGM_FI_DEV_FB_USED",
    "Replicas": "kube_horizontalpodautoscaler_spec_max_replicas",
    "OOM splits and process restarts": "imgserve_front_end_restarts_total",
    "Predictions per model": "imgserve_requests_total",
    "Latency p95 per model": "imgserve_request_duration_seconds",
    "Queue wait p95 per model": "imgserve_queue_wait_seconds",
    "Rejections per model": "imgserve_rejected_total",
    "Models per pod": "imgserve_model_info",
}
# The series that carry a `model` label: the dashboard shows the selected models' (`model=~"$model"`) everywhere,
# except imgserve_inflight_requests beside the pod-wide queue depth.
PER_MODEL = {
    "imgserve_requests_total",
    "imgserve_request_duration_seconds",
    "imgserve_queue_wait_seconds",
    "imgserve_batch_size",
    "imgserve_inference_duration_seconds",
    "imgserve_rejected_total",
    "imgserve_oom_splits_total",
    "imgserve_model_info",
    "imgserve_model_weight_bytes",
}


def generator() -> ModuleType:
    """charts/imgserve/dashboards/generate.py, imported from its path (it is not a package)."""
    spec = importlib.util.spec_from_file_location("imgserve_dashboard_generator", GENERATOR)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def panels() -> list[dict]:
    """The panels that query (rows excluded)."""
    return [panel for panel in dashboard()["panels"] if panel["type"] != "row"]


def test_committed_json_is_the_generated_one() -> None:
    fresh = generator().render()
    assert DASHBOARD.read_text() == fresh, (
        "imgserve.json was edited by hand: run charts/imgserve/dashboards/generate.py"
    )


def test_variables() -> None:
    variables = {variable["name"]: variable for variable in dashboard()["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert variables["namespace"]["query"] == "label_values(imgserve_build_info, namespace)"
    assert variables["pod"]["query"] == 'label_values(imgserve_build_info{namespace="$namespace"}, pod)'
    assert variables["pod"]["includeAll"] and variables["pod"]["allValue"] == ".*"
    assert variables["model"]["query"] == 'label_values(imgserve_requests_total{namespace="$namespace"}, model)'
    assert variables["model"]["multi"] and variables["model"]["includeAll"] and variables["model"]["allValue"] == ".*"
    for variable in variables.values():
        if variable["type"] == "query":
            assert variable["datasource"]["uid"] == "${datasource}"


@pytest.mark.parametrize("title", REQUIRED_PANELS)
def test_required_panel(title: str) -> None:
    matching = [panel for panel in panels() if panel["title"] == title]
    assert matching, f"no panel {title!r}"
    exprs = [target["expr"] for target in matching[0]["targets"]]
    assert any(REQUIRED_PANELS[title] in metric_names(expr) for expr in exprs), exprs


@pytest.mark.parametrize("panel", panels(), ids=lambda panel: panel["title"])
def test_panel_queries(panel: dict) -> None:
    """Every target: the selected data source, the selected namespace, contract metrics only, unique refIds."""
    assert panel["datasource"]["uid"] == "${datasource}"
    assert panel["targets"], "a panel without queries"
    ref_ids = [target["refId"] for target in panel["targets"]]
    assert len(set(ref_ids)) == len(ref_ids)
    for target in panel["targets"]:
        expr = target["expr"]
        assert 'namespace="$namespace"' in expr, expr
        assert metric_names(expr) and metric_names(expr) <= CONTRACT_METRICS, metric_names(expr) - CONTRACT_METRICS


def test_panel_ids_unique_and_grid_fits() -> None:
    board = dashboard()
    ids = [panel["id"] for panel in board["panels"]]
    assert len(set(ids)) == len(ids)
    for panel in board["panels"]:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]


def test_chart_configmap_carries_the_dashboard() -> None:
    """The sidecar-labelled ConfigMap holds exactly the committed JSON."""
    docs = helm_template(CHART_VALUES / "keda.yaml", "imgserve-test")
    maps = [doc for doc in docs if doc["kind"] == "ConfigMap" and doc["metadata"]["labels"].get("grafana_dashboard")]
    assert len(maps) == 1
    assert maps[0]["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(maps[0]["data"]["imgserve.json"]) == dashboard()


def test_the_prediction_panels_count_every_inference_route() -> None:
    """/predict, its alias, each model's own path, and the Open Inference Protocol's HTTP and gRPC inferences are
    predictions; every other route label the server writes (health, metadata, scrapes, docs, the repository
    extension, unknown paths) is not. The alert rules count predictions with the same selector."""
    from imgserve.frontend import telemetry as metrics

    pattern = generator().NOT_PREDICTIONS
    predictions = {*metrics.INFER_ROUTES, metrics.GRPC_INFER, "/classifier/predict", "/embed", "/v1/detect"}
    assert not [route for route in predictions if re.fullmatch(pattern, route)]
    others = {*(metrics.ROUTES - metrics.INFER_ROUTES), metrics.DOCS_ASSETS, metrics.GRPC_OTHER, "other"}
    others |= {metrics.V2_STATS, metrics.V2_REPOSITORY, metrics.V2_OTHER}
    assert [route for route in others if not re.fullmatch(pattern, route)] == []
    assert metrics.route("/v2/repository/models/a/load") in others and metrics.route("/nowhere") in others
    selector = generator().PREDICT
    for rule in alert_rules():
        if "imgserve_requests_total" in rule["expr"]:
            assert rule["expr"].count("imgserve_requests_total{") == rule["expr"].count(selector), rule["alert"]


def per_model_selectors(expr: str) -> list[tuple[str, str]]:
    """(metric, its label matchers) of every per-model series an expression selects."""
    found = re.findall(r"\b(imgserve_\w+?)(?:_bucket|_sum|_count)?\{([^}]*)\}", expr)
    return [(name, matchers) for name, matchers in found if name in PER_MODEL]


@pytest.mark.parametrize("panel", panels(), ids=lambda panel: panel["title"])
def test_panels_show_the_selected_models(panel: dict) -> None:
    """Every per-model series is filtered by the `model` variable; the queue depth, the autoscaling signal, stays
    the pod's (it has no model label), and so does the in-batch count shown beside it."""
    for target in panel["targets"]:
        expr = target["expr"]
        for name, matchers in per_model_selectors(expr):
            assert 'model=~"$model"' in matchers, (name, expr)
        if "imgserve_queue_depth" in expr:
            assert "$model" not in expr, expr


def test_the_model_filter_check_sees_a_missing_filter() -> None:
    assert per_model_selectors('sum(rate(imgserve_batch_size_sum{namespace="$namespace"}[1m]))') == [
        ("imgserve_batch_size", 'namespace="$namespace"')
    ]
    assert per_model_selectors('imgserve_queue_depth{pod="a"}') == []
