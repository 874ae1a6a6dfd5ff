"""PromQL of the project, read from where it lives: the dashboard, the alert rules and the chart's autoscaling.

Shared by test_dashboard.py, test_alerts.py and test_prometheus.py.
"""

from __future__ import annotations

import json
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import yaml
from tools import tool

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "imgserve"
DASHBOARD = CHART / "dashboards" / "imgserve.json"
GENERATOR = CHART / "dashboards" / "generate.py"
RULES = CHART / "rules" / "imgserve-alerts.yaml"
RULE_TESTS = CHART / "rules" / "imgserve-alerts.test.yaml"
ADAPTER_VALUES = CHART / "prometheus-adapter-values.yaml"
CHART_VALUES = REPO / "tests" / "chart_values"

# The metrics contract (DESIGN.md): ours, dcgm-exporter's and kube-state-metrics'. Nothing else may be queried.
HISTOGRAMS = frozenset(
    {
        "imgserve_request_duration_seconds",
        "imgserve_queue_wait_seconds",
        "imgserve_batch_size",
        "imgserve_inference_duration_seconds",
    }
)
CONTRACT_METRICS = HISTOGRAMS | {
    "imgserve_requests_total",
    "imgserve_queue_depth",
    "imgserve_inflight_requests",
    "imgserve_rejected_total",
    "imgserve_oom_splits_total",
    "imgserve_worker_restarts_total",
    "imgserve_front_end_restarts_total",
    "imgserve_gpu_utilization_ratio",
    "imgserve_gpu_memory_used_bytes",
    "imgserve_gpu_memory_total_bytes",
    "imgserve_model_info",
    "imgserve_model_weight_bytes",
    "imgserve_build_info",
    "DCGM_FI_DEV_GPU_UTIL",
    "DCGM_FI_DEV_FB_USED",
    "kube_deployment_status_replicas",
    "kube_horizontalpodautoscaler_status_current_replicas",
    "kube_horizontalpodautoscaler_spec_max_replicas",
}
_METRIC_TOKEN = re.compile(r"\b(?:imgserve_|DCGM_|kube_)\w+")
_COMPARISONS = ("==", "!=", ">=", "<=", ">", "<")
_NUMBER = re.compile(r"(?:bool\s+)?([-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?)", re.IGNORECASE)


@dataclass(frozen=True)
class Query:
    """One PromQL expression of the project: where it comes from, and what its result must look like."""

    source: str  # dashboard | alert | adapter | keda
    name: str
    expr: str
    labels: frozenset[str] = frozenset()  # labels every result element must carry
    exactly_one: bool = False  # KEDA: the trigger needs a single element


def metric_names(expr: str) -> set[str]:
    """Contract-prefixed metric names in an expression, histogram series folded onto their histogram."""
    names = set()
    for token in _METRIC_TOKEN.findall(expr):
        base = re.sub(r"_(bucket|sum|count)$", "", token)
        names.add(base if base in HISTOGRAMS else token)
    return names


def split_threshold(expr: str) -> tuple[str, str, float]:
    """Split `<signal> <comparison> <number>` at its top-level comparison; ValueError if the expr is not so.

    Brackets and quoted strings are skipped, so matchers like `code!="503"` or `le=~".."` never count.
    """
    depth, quote, found = 0, "", None
    index = 0
    while index < len(expr):
        char = expr[index]
        if quote:
            quote = "" if char == quote and expr[index - 1] != "\\" else quote
        elif char in "\"'`":
            quote = char
        elif char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
        elif depth == 0:
            op = next((op for op in _COMPARISONS if expr.startswith(op, index)), None)
            if op:
                found = (index, op)
                index += len(op)
                continue
        index += 1
    if found is None:
        raise ValueError(f"no top-level comparison in {expr!r}")
    at, op = found
    threshold = _NUMBER.fullmatch(expr[at + len(op) :].strip())
    if not threshold:
        raise ValueError(f"{expr!r} does not compare with a number")
    return expr[:at].strip(), op, float(threshold.group(1))


def template_labels(text: str) -> set[str]:
    """Label names that a Grafana legend ({{pod}}) or an alert annotation ({{ $labels.pod }}) shows."""
    return set(re.findall(r"\{\{\s*(?:\$labels\.)?(\w+)\s*\}\}", text)) - {"value"}


def alert_rules() -> list[dict]:
    """The alerting rules of the rule file, all groups."""
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"] if "alert" in rule]


def alert_queries() -> list[Query]:
    """Each alert's signal (its expr without the threshold), which must carry the labels its annotations show."""
    queries = []
    for rule in alert_rules():
        signal, _, _ = split_threshold(rule["expr"])
        shown = set().union(*(template_labels(text) for text in rule.get("annotations", {}).values()))
        queries.append(Query("alert", rule["alert"], signal, frozenset(shown)))
    return queries


def dashboard() -> dict:
    """The committed dashboard JSON."""
    return json.loads(DASHBOARD.read_text())


def dashboard_queries(board: dict, substitutions: dict[str, str]) -> list[Query]:
    """Every panel target, with the dashboard variables replaced (variables without a substitution are kept)."""

    def substitute(expr: str) -> str:
        return re.sub(r"\$(\w+)", lambda m: substitutions.get(m.group(1), m.group(0)), expr)

    return [
        Query(
            "dashboard",
            f"{panel['title']} [{target['refId']}]",
            substitute(target["expr"]),
            frozenset(template_labels(target.get("legendFormat", ""))),
        )
        for panel in board["panels"]
        for target in panel.get("targets", [])
    ]


def adapter_rules() -> list[dict]:
    """The custom rules of prometheus-adapter-values.yaml."""
    return yaml.safe_load(ADAPTER_VALUES.read_text())["rules"]["custom"]


def adapter_queries(label_matchers: str) -> list[Query]:
    """Each adapter rule's metricsQuery as the adapter sends it for one HPA: grouped by pod, so one element per pod."""
    return [
        Query(
            "adapter",
            rule["name"]["as"],
            rule["metricsQuery"].replace("<<.LabelMatchers>>", label_matchers).replace("<<.GroupBy>>", "pod"),
            frozenset({"pod"}),
        )
        for rule in adapter_rules()
    ]


def helm_template(values: Path, namespace: str) -> list[dict]:
    """The chart rendered with one values file, as parsed documents."""
    helm = tool("helm")
    out = subprocess.run(
        [helm, "template", "imgserve", str(CHART), "-f", str(values), "--namespace", namespace],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def keda_queries(values: Path, namespace: str) -> list[Query]:
    """The prometheus trigger queries of the rendered ScaledObject; KEDA needs exactly one element from each."""
    return [
        Query(
            "keda",
            f"{values.stem}: {trigger.get('name', trigger['metadata']['query'])}",
            trigger["metadata"]["query"],
            exactly_one=True,
        )
        for doc in helm_template(values, namespace)
        if doc["kind"] == "ScaledObject"
        for trigger in doc["spec"]["triggers"]
        if trigger["type"] == "prometheus"
    ]
