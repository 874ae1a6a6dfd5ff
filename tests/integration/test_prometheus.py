"""Every PromQL query of the project returns data from a real Prometheus scraping a real imgserve under load.

Prometheus 2.42 (Debian's package) runs on 127.0.0.1 with a 1 s scrape interval and the alert rules loaded. It
scrapes `imgserve serve` with the target labels a ServiceMonitor gives a pod, so cluster-style queries work. The
series no laptop has (GPU, dcgm-exporter, kube-state-metrics) come from labelled stand-ins, the only fake here.

Queries evaluated: every dashboard target (variables substituted), every alert's signal, every prometheus-adapter
rule, and the KEDA trigger queries that `helm template` renders. An alert's expr is `<signal> <op> <number>`
(tests/deploy/test_alerts.py enforces it); a healthy server rightly makes the whole expr empty, so the signal on the
left is evaluated: it must return data with the labels the alert's annotations show. The threshold logic itself is
covered by the promtool unit tests, and Prometheus here evaluates the full rules (each must report health ok).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import pytest
import yaml
from prom import (
    CHART_VALUES,
    RULES,
    Query,
    adapter_queries,
    adapter_rules,
    alert_queries,
    alert_rules,
    dashboard,
    dashboard_queries,
    helm_template,
    keda_queries,
)
from prometheus_client import CollectorRegistry, Gauge, start_http_server
from serving import Server, image_bytes, running_server
from tools import tool

from imgserve.testing import LOOPBACK, free_port
from loadtests.lib.servers import running_server as running_process

NAMESPACE = "imgserve-test"
POD = "imgserve-abc12-xyz"
POD_LABELS = {"namespace": NAMESPACE, "pod": POD, "service": "imgserve"}
# Grafana's variables as a user who picked this namespace and "All" pods and models would have them. The rate window
# is wider than Grafana's 4 x scrape interval so that the whole load, not only its last seconds, lies inside it.
SUBSTITUTIONS = {"namespace": NAMESPACE, "pod": ".*", "model": ".*", "deployment": "imgserve", "__rate_interval": "1m"}
QUERIES = [
    *dashboard_queries(dashboard(), SUBSTITUTIONS),
    *alert_queries(),
    *adapter_queries(f'namespace="{NAMESPACE}",pod=~".+"'),
    *keda_queries(CHART_VALUES / "keda.yaml", NAMESPACE),
    *keda_queries(CHART_VALUES / "keda-dcgm.yaml", NAMESPACE),
]


@dataclass
class StandIn:
    """A labelled fake exporter on loopback and the scrape job that reads it."""

    job: str
    port: int
    target_labels: dict[str, str]
    honor_labels: bool


def stand_in_registries() -> dict[str, tuple[CollectorRegistry, dict[str, str], bool]]:
    """STAND-INS for what only a GPU cluster has, each with the labels the real exporter's series carry there.

    - the GPU path of our own pod (imgserve_gpu_*: absent on this CPU-only machine), scraped with the pod's labels;
    - dcgm-exporter, scraped as its own pod: its workload labels pod/namespace become exported_pod /
      exported_namespace (honor_labels false), exactly the rename the dashboard and the adapter must undo;
    - kube-state-metrics (honor_labels true, as kube-prometheus-stack scrapes it): the HPA is at its maximum.
    """
    gpu, dcgm, ksm = CollectorRegistry(), CollectorRegistry(), CollectorRegistry()
    device = {"device": "cuda:0"}
    Gauge("imgserve_gpu_utilization_ratio", "stand-in", ["device"], registry=gpu).labels(**device).set(0.42)
    Gauge("imgserve_gpu_memory_used_bytes", "stand-in", ["device"], registry=gpu).labels(**device).set(30e9)
    Gauge("imgserve_gpu_memory_total_bytes", "stand-in", ["device"], registry=gpu).labels(**device).set(80e9)
    workload = {"gpu": "0", "UUID": "GPU-stand-in", "pod": POD, "namespace": NAMESPACE, "container": "imgserve"}
    Gauge("DCGM_FI_DEV_GPU_UTIL", "stand-in", list(workload), registry=dcgm).labels(**workload).set(42)
    Gauge("DCGM_FI_DEV_FB_USED", "stand-in", list(workload), registry=dcgm).labels(**workload).set(28610)
    deployment = {"namespace": NAMESPACE, "deployment": "imgserve"}
    Gauge("kube_deployment_status_replicas", "stand-in", list(deployment), registry=ksm).labels(**deployment).set(8)
    hpa = {"namespace": NAMESPACE, "horizontalpodautoscaler": "keda-hpa-imgserve"}
    for name in (
        "kube_horizontalpodautoscaler_status_current_replicas",
        "kube_horizontalpodautoscaler_spec_max_replicas",
    ):
        Gauge(name, "stand-in", list(hpa), registry=ksm).labels(**hpa).set(8)
    return {
        "imgserve-gpu-stand-in": (gpu, POD_LABELS, False),
        "dcgm-exporter-stand-in": (dcgm, {"namespace": "gpu-operator", "pod": "dcgm-exporter-x7k2p"}, False),
        "kube-state-metrics-stand-in": (ksm, {"namespace": "monitoring", "pod": "kube-state-metrics-5d9c8"}, True),
    }


@pytest.fixture(scope="module")
def stand_ins() -> Iterator[list[StandIn]]:
    """The stand-in exporters, served on OS-chosen loopback ports until the module ends."""
    servers, exporters = [], []
    for job, (registry, labels, honor) in stand_in_registries().items():
        server, _ = start_http_server(0, addr=LOOPBACK, registry=registry)
        servers.append(server)
        exporters.append(StandIn(job, server.server_port, labels, honor))
    yield exporters
    for server in servers:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def imgserve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The built-in model with a tiny queue bound, so a burst gets shed."""
    with running_server(tmp_path_factory.mktemp("imgserve"), max_queue_depth=2, max_batch_size=2) as server:
        yield server


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory: pytest.TempPathFactory, imgserve: Server, stand_ins: list[StandIn]) -> Iterator[str]:
    """Prometheus on a free loopback port, scraping imgserve as a pod would be scraped, plus the stand-ins."""
    workdir = tmp_path_factory.mktemp("prometheus")
    jobs = [
        {"job_name": "imgserve", "static_configs": [{"targets": [imgserve.url.split("//")[1]], "labels": POD_LABELS}]}
    ]
    jobs += [
        {
            "job_name": exporter.job,
            "honor_labels": exporter.honor_labels,
            "static_configs": [{"targets": [f"{LOOPBACK}:{exporter.port}"], "labels": exporter.target_labels}],
        }
        for exporter in stand_ins
    ]
    config = {
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(RULES)],
        "scrape_configs": jobs,
    }
    (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    command = [
        tool("prometheus"),
        f"--config.file={workdir / 'prometheus.yml'}",
        f"--storage.tsdb.path={workdir / 'data'}",
        f"--web.listen-address={LOOPBACK}:{port}",
    ]
    with running_process(command, port, workdir / "prometheus.log", "/-/ready", ready_timeout_s=30) as running:
        yield running.url


def post(url: str, body: bytes, headers: dict[str, str] | None = None) -> int:
    """One prediction; the status code."""
    files = {"file": ("image.png", body, "image/png")}
    return httpx.post(f"{url}/predict", files=files, headers=headers, timeout=30).status_code


def drive_load(url: str) -> dict[int, int]:
    """~60 predictions over several seconds: good ones from 3 threads, undecodable ones (400), ones whose deadline
    is too short to be met (504), and a burst of 20 at once against a queue bound of 2 (503). Status -> count."""
    good, bad = image_bytes(64, 48), b"\x89PNG\r\n\x1a\n not an image"

    def paced(body: bytes, headers: dict[str, str] | None = None) -> int:
        status = post(url, body, headers)
        time.sleep(0.25)  # spread the load over several scrapes, so rates see it rise
        return status

    statuses: list[int] = []
    with ThreadPoolExecutor(3) as pool:
        statuses += pool.map(lambda seed: paced(image_bytes(64, 48, seed=seed)), range(24))
        statuses += pool.map(lambda _: paced(bad), range(6))
        statuses += pool.map(lambda _: paced(good, {"X-Request-Timeout": "0.001"}), range(6))
    with ThreadPoolExecutor(20) as pool:
        statuses += pool.map(lambda _: post(url, good), range(20))
    return {code: statuses.count(code) for code in set(statuses)}


def evaluate(prometheus: str, expr: str) -> dict:
    """Evaluate one PromQL expression now (HTTP API); the `data` of a successful answer."""
    answer = httpx.get(f"{prometheus}/api/v1/query", params={"query": expr}, timeout=10).json()
    assert answer["status"] == "success", f"{expr}\n{answer}"
    return answer["data"]


def wait_for_predictions(prometheus: str, count: int, timeout_s: float = 20) -> None:
    """Wait until Prometheus has scraped at least `count` answered predictions of our pod."""
    expr = f'sum(imgserve_requests_total{{pod="{POD}",route="/predict"}})'
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        result = evaluate(prometheus, expr)["result"]
        if result and float(result[0]["value"][1]) >= count:
            return
        time.sleep(0.5)
    pytest.fail(f"Prometheus did not see {count} predictions within {timeout_s:.0f} s")


@pytest.fixture(scope="module")
def loaded(prometheus: str, imgserve: Server) -> dict[int, int]:
    """One prediction that Prometheus sees first (a counter's first sample is no increase), then the load; waits
    (bounded) until Prometheus has scraped the final counts."""
    assert post(imgserve.url, image_bytes(64, 48)) == 200
    wait_for_predictions(prometheus, 1)
    statuses = drive_load(imgserve.url)
    wait_for_predictions(prometheus, 1 + sum(statuses.values()))
    time.sleep(2)  # a couple more scrapes, so every rate has samples after the last change
    return statuses


def test_load_reached_every_outcome(loaded: dict[int, int]) -> None:
    """Without 200s, 400s, 503 sheds and 504 deadlines the queries below would prove less."""
    assert {200, 400, 503, 504} <= set(loaded), loaded


@pytest.mark.parametrize("query", QUERIES, ids=lambda query: f"{query.source}: {query.name}")
def test_query_returns_data(query: Query, prometheus: str, loaded: dict[int, int]) -> None:
    assert "$" not in query.expr.replace('"$1"', ""), f"unsubstituted variable in {query.expr}"
    data = evaluate(prometheus, query.expr)
    assert data["resultType"] == "vector", data
    result = data["result"]
    assert result, f"empty result: {query.expr}"
    if query.exactly_one:
        assert len(result) == 1, result
    for element in result:
        missing = query.labels - set(element["metric"])
        assert not missing, f"result lacks labels {missing}: {element}"
        if "pod" in query.labels:
            assert element["metric"]["pod"] == POD, element
    assert any(math.isfinite(float(element["value"][1])) for element in result), result


@pytest.mark.parametrize(
    ("label", "match", "expected"),
    [
        ("namespace", "imgserve_build_info", NAMESPACE),
        ("pod", f'imgserve_build_info{{namespace="{NAMESPACE}"}}', POD),
        ("model", f'imgserve_requests_total{{namespace="{NAMESPACE}"}}', "denoiser"),
        ("deployment", f'kube_deployment_status_replicas{{namespace="{NAMESPACE}"}}', "imgserve"),
    ],
)
def test_dashboard_variables_list_values(label: str, match: str, expected: str, prometheus: str, loaded: dict) -> None:
    """The label_values() queries of the dashboard's variables, as Grafana runs them (the label values API)."""
    variables = {variable["name"]: variable["query"] for variable in dashboard()["templating"]["list"]}
    assert variables[label] == f"label_values({match.replace(NAMESPACE, '$namespace')}, {label})"
    answer = httpx.get(f"{prometheus}/api/v1/label/{label}/values", params={"match[]": match}, timeout=10).json()
    assert expected in answer["data"], answer


@pytest.mark.parametrize("rule", adapter_rules(), ids=lambda rule: rule["name"]["as"])
def test_adapter_discovers_series(rule: dict, prometheus: str, loaded: dict) -> None:
    """prometheus-adapter finds its metrics with seriesQuery; each found series must name the pod."""
    answer = httpx.get(f"{prometheus}/api/v1/series", params={"match[]": rule["seriesQuery"]}, timeout=10).json()
    assert answer["data"], rule["seriesQuery"]
    assert all(series.get("pod") == POD for series in answer["data"]), answer["data"]


def test_hpa_asks_for_metrics_the_adapter_serves() -> None:
    """The HPA's Pods metrics are the names the adapter rules publish."""
    served = {rule["name"]["as"] for rule in adapter_rules()}
    hpas = [
        doc for doc in helm_template(CHART_VALUES / "hpa.yaml", NAMESPACE) if doc["kind"] == "HorizontalPodAutoscaler"
    ]
    assert hpas
    asked = {metric["pods"]["metric"]["name"] for metric in hpas[0]["spec"]["metrics"] if metric["type"] == "Pods"}
    assert asked and asked <= served, asked - served


def test_prometheus_evaluates_every_alert_rule(prometheus: str, loaded: dict) -> None:
    """Prometheus itself ran the full rules (threshold included) on the live series without an error."""
    deadline = time.monotonic() + 10
    while True:
        groups = httpx.get(f"{prometheus}/api/v1/rules", timeout=10).json()["data"]["groups"]
        rules = {rule["name"]: rule for group in groups for rule in group["rules"]}
        if (
            all(rule.get("lastEvaluation", "").startswith("2") for rule in rules.values())
            or time.monotonic() > deadline
        ):
            break
        time.sleep(0.5)
    assert set(rules) == {rule["alert"] for rule in alert_rules()}
    for name, rule in rules.items():
        assert rule["health"] == "ok", f"{name}: {rule.get('lastError')}"
    # The kube-state-metrics stand-in reports the HPA at its maximum: that alert must be pending (for: 15m).
    assert rules["ImgserveAtMaxReplicas"]["state"] == "pending", rules["ImgserveAtMaxReplicas"]


def test_query_count() -> None:
    """Every source contributes: nothing silently dropped from the evaluation."""
    sources = {
        source: sum(query.source == source for query in QUERIES) for source in ("dashboard", "alert", "adapter", "keda")
    }
    assert sources["dashboard"] >= 20 and sources["alert"] == len(alert_rules()), sources
    assert sources["adapter"] == len(adapter_rules()) and sources["keda"] >= 4, sources
