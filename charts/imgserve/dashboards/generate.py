"""Generate the imgserve Grafana dashboard (`imgserve.json` next to this file) with grafana-foundation-sdk.

The JSON is generated, never hand-edited: change a panel here, run
`python charts/imgserve/dashboards/generate.py`, and commit both files. tests/deploy/test_dashboard.py fails when
the committed JSON differs from a fresh generation; tests/integration/test_prometheus.py runs every query against a
real Prometheus.
Every query uses only the metrics of the contract (docs/metrics.md).
"""

from __future__ import annotations

import json
from pathlib import Path

from grafana_foundation_sdk.builders import dashboard, heatmap, prometheus, table, timeseries
from grafana_foundation_sdk.builders.common import VizLegendOptions
from grafana_foundation_sdk.cog.builder import Builder
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.common import LegendDisplayMode, LegendPlacement
from grafana_foundation_sdk.models.dashboard import DashboardCursorSync, DataSourceRef, VariableRefresh, VariableSort
from grafana_foundation_sdk.models.prometheus import PromQueryFormat

OUTPUT = Path(__file__).with_name("imgserve.json")
DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")

# Series of the selected pods; every imgserve query starts from it.
PODS = 'namespace="$namespace",pod=~"$pod"'
# ... and of the selected models (all: `.*`, which also keeps the series of no model, such as a refused connection's).
MODELS = f'{PODS},model=~"$model"'
# The route labels that are no inference: health checks, metadata, scrapes, the docs, the repository extension and
# unknown paths (imgserve.frontend.telemetry's fixed labels). Every other route is a prediction route: /predict,
# /v1/images:predict, each model's own path (/<name>/predict, an API's api_path), /v2/infer and grpc/ModelInfer. The
# alert rules use the same selector; tests/deploy/test_dashboard.py checks it against the server's labels.
NOT_PREDICTIONS = (
    "/|/docs|/docs/assets|/openapi.json|/health|/health/live|/health/ready|/info|/metrics|/v2|/v2/stats|/v2/repository|"
    "grpc|other"
)
PREDICT = f'route!~"{NOT_PREDICTIONS}"'
RATE = "$__rate_interval"
# The models that answered requests in the selected namespace (the `model` variable's values).
MODEL_VALUES = 'label_values(imgserve_requests_total{namespace="$namespace"}, model)'
# The autoscaler of the selected Deployment: the chart's HPA, or KEDA's keda-hpa-<name>.
HPA = '{namespace="$namespace",horizontalpodautoscaler=~"(keda-hpa-)?$deployment"}'


def dcgm_on_pods(metric: str) -> str:
    """A DCGM metric moved onto the serving pods: dcgm-exporter's workload labels arrive as exported_pod /
    exported_namespace (honorLabels false) or pod / namespace (honorLabels true); label_replace handles both."""
    relabelled = (
        f'label_replace(label_replace({metric}, "pod", "$1", "exported_pod", "(.+)"), '
        '"namespace", "$1", "exported_namespace", "(.+)")'
    )
    return f"{relabelled} and on (namespace, pod) imgserve_build_info{{{PODS}}}"


def quantiles(histogram: str, selector: str, levels: tuple[float, ...]) -> list[tuple[str, str]]:
    """histogram_quantile targets (expression, legend) of one histogram, one per level."""
    return [
        (
            f"histogram_quantile({level}, sum by (le) (rate({histogram}_bucket{{{selector}}}[{RATE}])))",
            f"p{round(level * 100)}",
        )
        for level in levels
    ]


def p95_by_model(histogram: str, selector: str) -> tuple[str, str]:
    """The histogram's 95th percentile per model: a target (expression, legend)."""
    return f"histogram_quantile(0.95, sum by (model, le) (rate({histogram}_bucket{{{selector}}}[{RATE}])))", "{{model}}"


def mean(histogram: str, selector: str, by: str = "") -> str:
    """Average observation of a histogram: rate of its sum over rate of its count."""
    group = f" by ({by})" if by else ""
    return (
        f"sum{group} (rate({histogram}_sum{{{selector}}}[{RATE}])) / "
        f"sum{group} (rate({histogram}_count{{{selector}}}[{RATE}]))"
    )


def targets(queries: list[tuple[str, str]], fmt: PromQueryFormat = PromQueryFormat.TIME_SERIES) -> list[Builder]:
    """Prometheus targets A, B, C, ... from (expression, legend) pairs."""
    built = []
    for index, (expr, legend) in enumerate(queries):
        query = prometheus.Dataquery().expr(expr).legend_format(legend).ref_id(chr(ord("A") + index)).format(fmt)
        built.append(query.instant() if fmt == PromQueryFormat.TABLE else query.range())
    return built


def graph(title: str, description: str, unit: str, queries: list[tuple[str, str]], width: int = 12) -> Builder:
    """A time series panel."""
    legend = VizLegendOptions().display_mode(LegendDisplayMode.LIST).placement(LegendPlacement.BOTTOM)
    legend = legend.show_legend(True)
    return (
        timeseries.Panel()
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .unit(unit)
        .min(0)
        .span(width)
        .height(8)
        .legend(legend)
        .targets(targets(queries))
    )


def batch_heatmap() -> Builder:
    """Batch sizes of the selected models as a heatmap of the histogram's buckets."""
    return (
        heatmap.Panel()
        .title("Batch size distribution")
        .description("Batches per batch-size bucket (imgserve_batch_size). Mostly 1 under load = batching not helping.")
        .datasource(DATASOURCE)
        .span(12)
        .height(8)
        .calculate(False)
        .rows_frame(heatmap.RowsHeatmapOptions().layout("le"))
        .y_axis(heatmap.YAxisConfig().unit("short"))
        .targets(
            targets(
                [(f"sum by (le) (increase(imgserve_batch_size_bucket{{{MODELS}}}[{RATE}]))", "{{le}}")],
                PromQueryFormat.HEATMAP,
            )
        )
    )


def model_table() -> Builder:
    """Which models each pod has loaded: what each serves (its file or API class), device, precision, version."""
    expr = (
        f"max by (pod, model, source, precision, device) (imgserve_model_info{{{MODELS}}}) "
        f"* on (pod) group_left (version) max by (pod, version) (imgserve_build_info{{{PODS}}})"
    )
    return (
        table.Panel()
        .title("Models per pod")
        .description(
            "imgserve_model_info (one series per loaded model) joined with imgserve_build_info: the model's name, "
            "its file or API class (source), device, precision, version."
        )
        .datasource(DATASOURCE)
        .span(24)
        .height(6)
        .targets(targets([(expr, "")], PromQueryFormat.TABLE))
    )


def query_variable(name: str, label: str, query: str, several: bool = False) -> dashboard.QueryVariable:
    """A variable filled from label_values() on the selected data source; `several`: any of its values, or All."""
    variable = (
        dashboard.QueryVariable(name)
        .label(label)
        .datasource(DATASOURCE)
        .query(query)
        .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(VariableSort.ALPHABETICAL_ASC)
    )
    return variable.multi(True).include_all(True).all_value(".*") if several else variable


def traffic() -> list[Builder]:
    """Prediction answers, latency, sheds and errors of the selected pods and models."""
    requests = f"imgserve_requests_total{{{MODELS},{PREDICT}}}"
    all_answers = f"sum(rate({requests}[{RATE}]))"
    return [
        graph(
            "Throughput by status code",
            "Prediction answers per second by HTTP status (200 ok, 4xx bad input, 503 shed, 504 deadline).",
            "reqps",
            [(f"sum by (code) (rate({requests}[{RATE}]))", "{{code}}")],
        ),
        graph(
            "Latency p50 / p95 / p99",
            "Time from request to answer of the prediction routes (imgserve_request_duration_seconds).",
            "s",
            quantiles("imgserve_request_duration_seconds", f"{MODELS},{PREDICT}", (0.5, 0.95, 0.99)),
        ),
        graph(
            "Shed and timed-out requests by reason",
            "imgserve_rejected_total: queue_full/draining/worker_lost answer 503, deadline answers 504.",
            "reqps",
            [(f"sum by (reason) (rate(imgserve_rejected_total{{{MODELS}}}[{RATE}]))", "{{reason}}")],
        ),
        graph(
            "Error and rejection share",
            "Share of prediction answers that are 5xx other than a 503 shed, and share rejected (all reasons).",
            "percentunit",
            [
                (
                    f'sum(rate(imgserve_requests_total{{{MODELS},{PREDICT},code=~"5..",code!="503"}}[{RATE}])) '
                    f"/ {all_answers}",
                    "errors (5xx except 503)",
                ),
                (f"sum(rate(imgserve_rejected_total{{{MODELS}}}[{RATE}])) / {all_answers}", "rejected"),
            ],
        ),
    ]


def per_model() -> list[Builder]:
    """The selected models side by side: each one's predictions, latency, queue wait and rejections."""
    requests = f"imgserve_requests_total{{{MODELS},{PREDICT}}}"
    rejected = f'imgserve_rejected_total{{{MODELS},model!=""}}'
    return [
        graph(
            "Predictions per model",
            "Prediction answers per second of each model (all status codes), over /predict, its own path and v2.",
            "reqps",
            [(f"sum by (model) (rate({requests}[{RATE}]))", "{{model}}")],
        ),
        graph(
            "Latency p95 per model",
            "95th percentile of each model's time from request to answer (imgserve_request_duration_seconds).",
            "s",
            [p95_by_model("imgserve_request_duration_seconds", f"{MODELS},{PREDICT}")],
        ),
        graph(
            "Queue wait p95 per model",
            "95th percentile of each model's wait from admission to its batch: a model starved by the others "
            "waits longest (imgserve_queue_wait_seconds).",
            "s",
            [p95_by_model("imgserve_queue_wait_seconds", MODELS)],
        ),
        graph(
            "Rejections per model",
            "Each model's requests shed (503: its own queue bound or the pod's) or past their deadline (504).",
            "reqps",
            [(f"sum by (model, reason) (rate({rejected}[{RATE}]))", "{{model}} {{reason}}")],
        ),
    ]


def queue_and_batching() -> list[Builder]:
    """The pod's queue (the autoscaling signal, all models), and the selected models' waits, batches and calls."""
    return [
        graph(
            "Queue depth per pod",
            "Admitted, not yet answered (imgserve_queue_depth: the pod's, all models; the autoscaling signal) and in "
            "a model batch.",
            "short",
            [
                (f"sum by (pod) (imgserve_queue_depth{{{PODS}}})", "{{pod}} queued"),
                (f"sum by (pod) (imgserve_inflight_requests{{{PODS}}})", "{{pod}} in batch"),
            ],
        ),
        graph(
            "Queue wait p50 / p95",
            "Time from admission to the start of the model batch (imgserve_queue_wait_seconds).",
            "s",
            quantiles("imgserve_queue_wait_seconds", MODELS, (0.5, 0.95)),
        ),
        batch_heatmap(),
        graph(
            "Average batch size",
            "Images per model batch, averaged per pod and model (rate of imgserve_batch_size_sum over its count).",
            "short",
            [(mean("imgserve_batch_size", MODELS, "pod, model"), "{{pod}} {{model}}")],
        ),
        graph(
            "Inference time per batch",
            "One model call (imgserve_inference_duration_seconds): p50 and p95 of the selected models, and each one's "
            "mean.",
            "s",
            [
                *quantiles("imgserve_inference_duration_seconds", MODELS, (0.5, 0.95)),
                (mean("imgserve_inference_duration_seconds", MODELS, "model"), "{{model}} mean"),
            ],
        ),
        graph(
            "OOM splits and process restarts",
            "Batches split after running out of GPU memory, and inference workers and HTTP front ends "
            "restarted after dying.",
            "short",
            [
                (f"sum by (pod) (increase(imgserve_oom_splits_total{{{MODELS}}}[{RATE}]))", "{{pod}} OOM splits"),
                (
                    f"sum by (pod) (increase(imgserve_worker_restarts_total{{{PODS}}}[{RATE}]))",
                    "{{pod}} worker restarts",
                ),
                (
                    f"sum by (pod) (increase(imgserve_front_end_restarts_total{{{PODS}}}[{RATE}]))",
                    "{{pod}} front-end restarts",
                ),
            ],
        ),
    ]


def gpu() -> list[Builder]:
    """Utilization and memory of the pods' GPUs, ours and dcgm-exporter's, and each model's weights."""
    weights = f"imgserve_model_weight_bytes{{{MODELS}}}"
    return [
        graph(
            "GPU utilization",
            "Busy share per device from the pods (imgserve_gpu_utilization_ratio) and from dcgm-exporter "
            "(DCGM_FI_DEV_GPU_UTIL, joined to the pods). Empty on CPU pods.",
            "percent",
            [
                (
                    f"100 * avg by (pod, device) (imgserve_gpu_utilization_ratio{{{PODS}}})",
                    "{{pod}} {{device}} (imgserve)",
                ),
                (f"avg by (pod, gpu) ({dcgm_on_pods('DCGM_FI_DEV_GPU_UTIL')})", "{{pod}} GPU {{gpu}} (DCGM)"),
            ],
        ),
        graph(
            "GPU memory",
            "Used and total per device from the pods, framebuffer used from dcgm-exporter (MiB to bytes), and "
            "what each selected model's weights hold on each device (once when the workers share them).",
            "bytes",
            [
                (f"sum by (pod, device) (imgserve_gpu_memory_used_bytes{{{PODS}}})", "{{pod}} {{device}} used"),
                (f"sum by (pod, device, model) ({weights})", "{{pod}} {{device}} {{model}} weights"),
                (f"sum by (pod, device) (imgserve_gpu_memory_total_bytes{{{PODS}}})", "{{pod}} {{device}} total"),
                (
                    f"1048576 * max by (pod, gpu) ({dcgm_on_pods('DCGM_FI_DEV_FB_USED')})",
                    "{{pod}} GPU {{gpu}} used (DCGM)",
                ),
            ],
        ),
    ]


def scaling() -> list[Builder]:
    """Replicas from kube-state-metrics and the pods scraped, and the models each pod has loaded."""
    return [
        graph(
            "Replicas",
            "Deployment replicas and its autoscaler (kube-state-metrics; KEDA names its HPA keda-hpa-<name>), "
            "and the pods Prometheus scrapes.",
            "short",
            [
                ('sum(kube_deployment_status_replicas{namespace="$namespace",deployment="$deployment"})', "replicas"),
                (f"sum(kube_horizontalpodautoscaler_status_current_replicas{HPA})", "autoscaler current"),
                (f"sum(kube_horizontalpodautoscaler_spec_max_replicas{HPA})", "autoscaler max"),
                (f"count(imgserve_build_info{{{PODS}}})", "pods scraped"),
            ],
            width=24,
        ),
        model_table(),
    ]


def rows() -> list[tuple[str, list[Builder]]]:
    """The dashboard's rows and their panels, in the order a request travels."""
    return [
        ("Traffic", traffic()),
        ("Models", per_model()),
        ("Queue and batching", queue_and_batching()),
        ("GPU", gpu()),
        ("Scaling", scaling()),
    ]


def build() -> dict[str, object]:
    """The dashboard as the JSON object Grafana imports."""
    board = (
        dashboard.Dashboard("imgserve")
        .uid("imgserve")
        .description(
            "imgserve: throughput, latency, queue, batching, GPU and replicas of the selected pods and models."
        )
        .tags(["imgserve", "inference"])
        .editable()
        .tooltip(DashboardCursorSync.CROSSHAIR)
        .time("now-1h", "now")
        .refresh("30s")
        .with_variable(dashboard.DatasourceVariable("datasource").label("Data source").type("prometheus"))
        .with_variable(query_variable("namespace", "Namespace", "label_values(imgserve_build_info, namespace)"))
        .with_variable(
            query_variable("pod", "Pod", 'label_values(imgserve_build_info{namespace="$namespace"}, pod)', True)
        )
        .with_variable(query_variable("model", "Model", MODEL_VALUES, True))
        .with_variable(
            query_variable(
                "deployment",
                "Deployment",
                'label_values(kube_deployment_status_replicas{namespace="$namespace"}, deployment)',
            ).regex("/imgserve/")
        )
    )
    panel_id = 0
    for title, panels in rows():
        panel_id += 1
        board = board.with_row(dashboard.Row(title).id(panel_id))
        for panel in panels:
            panel_id += 1
            board = board.with_panel(panel.id(panel_id))
    return json.loads(json.dumps(board.build(), cls=JSONEncoder))


def render() -> str:
    """The file content: stable key order, two-space indent, trailing newline."""
    return json.dumps(build(), indent=2, sort_keys=True) + "\n"


if __name__ == "__main__":
    OUTPUT.write_text(render())
    print(f"wrote {OUTPUT}")
