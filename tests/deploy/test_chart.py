"""The Helm chart, checked with the real tools: helm lint/template, kubernetes-validate, KEDA's CRD schema, promtool,
checkov, and the helm test hook's script run against a real server."""

from __future__ import annotations

import functools
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import kubernetes_validate
import pytest
import yaml
from serving import REPO, TESTS, Server, running_server
from tools import tool

CHART = REPO / "charts" / "imgserve"
VALUES = TESTS / "chart_values"
RELEASE = "imgserve"
NAMESPACE = "imgserve-test"
K8S_VERSION = "1.35.0"
KEDA_CRD = TESTS / "data" / "keda.sh_scaledobjects.yaml"
KSERVE_CRDS = {  # kind -> KServe's CRD (trimmed, tests/data) and the version the chart renders
    "ServingRuntime": (TESTS / "data" / "serving.kserve.io_servingruntimes.yaml", "v1alpha1"),
    "InferenceService": (TESTS / "data" / "serving.kserve.io_inferenceservices.yaml", "v1beta1"),
}
CRD_KINDS = {"ScaledObject", "ServiceMonitor", "PrometheusRule", *KSERVE_CRDS}
VALID = [
    "defaults",
    "hpa",
    "keda",
    "keda-dcgm",
    "cpu-only",
    "scale-to-zero",
    "auth",
    "kserve",
    "grpc-off",
    "pod",
    "models",
]
AUTOSCALED = ["hpa", "keda", "keda-dcgm", "scale-to-zero"]
POD_SELECTOR = f'namespace="{NAMESPACE}",pod=~"{RELEASE}-.*"'

Manifest = dict[str, Any]


def run(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run a command, capturing text output; with check, fail the test with its stderr if it fails."""
    result = subprocess.run(args, capture_output=True, text=True, timeout=120)
    if check and result.returncode != 0:
        pytest.fail(f"{' '.join(args)} failed ({result.returncode}):\n{result.stderr}{result.stdout}")
    return result


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """helm with the release, namespace and chart of these tests."""
    return run(tool("helm"), *args, check=check)


def values_args(name: str) -> list[str]:
    """-f argument of one of the values files in tests/chart_values."""
    return ["-f", str(VALUES / f"{name}.yaml")]


@functools.cache
def rendered_text(name: str) -> str:
    """`helm template` output for one values file (cached: each file renders once per run)."""
    return helm("template", RELEASE, str(CHART), "--namespace", NAMESPACE, *values_args(name)).stdout


def render(name: str) -> list[Manifest]:
    """Every object rendered from one values file (fresh copies, safe to mutate)."""
    return [doc for doc in yaml.safe_load_all(rendered_text(name)) if doc]


def objects(name: str, kind: str) -> list[Manifest]:
    """Rendered objects of one kind."""
    return [doc for doc in render(name) if doc["kind"] == kind]


def one(name: str, kind: str) -> Manifest:
    """The single rendered object of a kind."""
    found = objects(name, kind)
    assert len(found) == 1, f"{name}: expected one {kind}, got {len(found)}"
    return found[0]


def server_container(name: str) -> Manifest:
    """The server container of the Deployment."""
    (container,) = [
        c for c in one(name, "Deployment")["spec"]["template"]["spec"]["containers"] if c["name"] == "server"
    ]
    return container


def env_of(container: Manifest) -> dict[str, str]:
    """A container's literal environment variables."""
    return {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}


def pod_specs(name: str) -> list[Manifest]:
    """Pod specs of the Deployment and of the helm test Pod."""
    return [one(name, "Deployment")["spec"]["template"]["spec"], one(name, "Pod")["spec"]]


def promql_of_scaledobject(scaled: Manifest) -> dict[str, str]:
    """Trigger name -> PromQL of a ScaledObject."""
    return {t["name"]: t["metadata"]["query"] for t in scaled["spec"]["triggers"]}


def adapter_rules() -> list[Manifest]:
    """The custom-metrics rules shipped for prometheus-adapter."""
    return yaml.safe_load((CHART / "prometheus-adapter-values.yaml").read_text())["rules"]["custom"]


def strict_schema(schema: Any) -> Any:
    """A CRD schema that also rejects unknown fields, as `kubectl apply --validate=strict` does."""
    if isinstance(schema, dict):
        schema = {key: strict_schema(value) for key, value in schema.items()}
        if "properties" in schema and "additionalProperties" not in schema:
            schema["additionalProperties"] = False
    elif isinstance(schema, list):
        schema = [strict_schema(item) for item in schema]
    return schema


@functools.cache
def crd_validator(path: Path, version: str) -> jsonschema.Draft7Validator:
    """Strict validator for one version of a CRD in tests/data."""
    crd = yaml.safe_load(path.read_text())
    (found,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    return jsonschema.Draft7Validator(strict_schema(found["schema"]["openAPIV3Schema"]))


def keda_validator() -> jsonschema.Draft7Validator:
    """Validator for ScaledObjects from KEDA's own CRD (tests/data, KEDA v2.20.2)."""
    return crd_validator(KEDA_CRD, "v1alpha1")


@pytest.mark.parametrize("name", VALID)
def test_lint_strict(name: str) -> None:
    """helm lint --strict passes for every supported values file."""
    result = helm("lint", "--strict", str(CHART), "--namespace", NAMESPACE, *values_args(name))
    assert "0 chart(s) failed" in result.stdout


@pytest.mark.parametrize("name", VALID)
def test_objects_match_kubernetes_and_keda_schemas(name: str) -> None:
    """Every rendered object validates strictly against Kubernetes 1.35; ScaledObjects against KEDA's CRD."""
    docs = render(name)
    assert {"Deployment", "Service", "ServiceAccount", "NetworkPolicy", "Pod"} <= {d["kind"] for d in docs}
    for doc in docs:
        where = f"{name}: {doc['kind']}/{doc['metadata']['name']}"
        assert doc["metadata"].get("namespace") == NAMESPACE, where
        assert doc["metadata"]["labels"]["app.kubernetes.io/instance"] == RELEASE, where
        if doc["kind"] == "ScaledObject":
            errors = [e.message for e in keda_validator().iter_errors(doc)]
            assert not errors, f"{where}: {errors}"
        elif doc["kind"] in KSERVE_CRDS:
            errors = [e.message for e in crd_validator(*KSERVE_CRDS[doc["kind"]]).iter_errors(doc)]
            assert not errors, f"{where}: {errors}"
        elif doc["kind"] not in CRD_KINDS:
            try:
                kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
            except kubernetes_validate.ValidationError as error:
                pytest.fail(f"{where}: {error.message} at {list(error.path)}")


def test_keda_schema_rejects_a_misspelled_field() -> None:
    """The strict KEDA schema catches what the API server would silently prune."""
    scaled = one("keda", "ScaledObject")
    scaled["spec"]["triggers"][0]["metrictype"] = scaled["spec"]["triggers"][0].pop("metricType")
    assert any("metrictype" in e.message for e in keda_validator().iter_errors(scaled))


@pytest.mark.parametrize(("name", "replicas"), [("defaults", 1), ("cpu-only", 3)] + [(n, None) for n in AUTOSCALED])
def test_replicas_only_without_autoscaler(name: str, replicas: int | None) -> None:
    """spec.replicas is set from replicaCount, and absent when an HPA or KEDA owns the count."""
    assert one(name, "Deployment")["spec"].get("replicas") == replicas
    autoscalers = objects(name, "HorizontalPodAutoscaler") + objects(name, "ScaledObject")
    assert len(autoscalers) == (0 if replicas else 1)


@pytest.mark.parametrize("name", VALID)
def test_grace_period_covers_prestop_and_drain(name: str) -> None:
    """preStop is a real `sh -c "sleep N"`, and the grace period outlasts it plus the server's drain."""
    spec = one(name, "Deployment")["spec"]["template"]["spec"]
    container = server_container(name)
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    assert command[:2] == ["/bin/sh", "-c"] and len(command) == 3, command
    sleep = int(re.fullmatch(r"sleep (\d+)", command[2]).group(1))
    drain = float(env_of(container)["IMGSERVE_DRAIN_TIMEOUT_S"])
    assert 0 < sleep < 30
    assert spec["terminationGracePeriodSeconds"] >= sleep + math.ceil(drain) + 5


def test_grace_period_follows_settings() -> None:
    """A fractional drain timeout rounds up: 5 s preStop + ceil(12.5) s drain + 10 s margin."""
    assert one("cpu-only", "Deployment")["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 28


@pytest.mark.parametrize("name", VALID)
def test_hardened_pods(name: str) -> None:
    """Every container runs non-root on a read-only root fs with no capabilities; /tmp and /dev/shm are emptyDirs."""
    for spec in pod_specs(name):
        assert spec["automountServiceAccountToken"] is False
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        for container in spec["containers"] + spec.get("initContainers", []):
            context = container["securityContext"]
            assert context["runAsNonRoot"] is True and context["runAsUser"] > 0, container["name"]
            assert context["readOnlyRootFilesystem"] is True, container["name"]
            assert context["allowPrivilegeEscalation"] is False, container["name"]
            assert context["capabilities"]["drop"] == ["ALL"], container["name"]
            assert context["seccompProfile"] == {"type": "RuntimeDefault"}, container["name"]
            assert "/tmp" in {m["mountPath"] for m in container["volumeMounts"]}, container["name"]
            assert {"cpu", "memory"} <= set(container["resources"]["limits"]), container["name"]
    deployment = one(name, "Deployment")["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in deployment["volumes"]}
    assert volumes["dshm"]["emptyDir"]["medium"] == "Memory"
    assert {m["mountPath"]: m["name"] for m in server_container(name)["volumeMounts"]}["/dev/shm"] == "dshm"


def test_gpu_install() -> None:
    """The default install asks for one GPU, lands on GPU nodes and serves the built-in model on cuda."""
    container = server_container("defaults")
    spec = one("defaults", "Deployment")["spec"]["template"]["spec"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    env = env_of(container)
    assert env["IMGSERVE_DEVICE"] == "cuda" and env["IMGSERVE_MODEL"] == "builtin:denoiser"
    assert env["IMGSERVE_PORT"] == str(container["ports"][0]["containerPort"]) == "8000"
    assert container["args"] == ["imgserve", "serve"]


def test_cpu_only_install() -> None:
    """gpu.enabled=false drops GPU limits and placement and renders settings exactly (no 2.097152e+07)."""
    container = server_container("cpu-only")
    spec = one("cpu-only", "Deployment")["spec"]["template"]["spec"]
    assert not any("gpu" in key for key in container["resources"]["limits"])
    assert "nodeSelector" not in spec and "tolerations" not in spec
    env = env_of(container)
    assert env["IMGSERVE_DEVICE"] == "cpu"
    assert env["IMGSERVE_MAX_BODY_BYTES"] == "20971520"
    assert env["IMGSERVE_MAX_BATCH_SIZE"] == "auto"


@pytest.mark.parametrize(
    ("name", "model", "volume"),
    [
        ("defaults", "builtin:denoiser", None),
        ("keda-dcgm", "/models/denoiser.safetensors", "persistentVolumeClaim"),
        ("cpu-only", "/models/model.safetensors", "emptyDir"),
    ],
)
def test_model_sources(name: str, model: str, volume: str | None) -> None:
    """Model from the image, from a read-only PVC, or copied by an init container into an emptyDir."""
    spec = one(name, "Deployment")["spec"]["template"]["spec"]
    container = server_container(name)
    assert env_of(container)["IMGSERVE_MODEL"] == model
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    if volume is None:
        assert "models" not in volumes and "initContainers" not in spec
        return
    assert volume in volumes["models"] and mounts["models"]["readOnly"] is True
    if volume == "persistentVolumeClaim":
        assert volumes["models"][volume] == {"claimName": "imgserve-models", "readOnly": True}
    else:
        (init,) = spec["initContainers"]
        assert init["image"] == container["image"]
        assert {m["mountPath"]: m.get("readOnly", False) for m in init["volumeMounts"]}["/models"] is False


@pytest.mark.parametrize(
    ("name", "volume"), [("defaults", {"emptyDir": {"sizeLimit": "2Gi"}}), ("keda-dcgm", {"persistentVolumeClaim"})]
)
def test_the_compile_cache_is_a_volume_of_its_own(name: str, volume: dict | set) -> None:
    """Compiled code is kept on a volume mounted for it, an emptyDir or an existing PVC, in a folder imgserve makes
    there; the kubelet leaves a reused volume's permissions alone (imgserve refuses a cache others can write)."""
    spec = one(name, "Deployment")["spec"]["template"]["spec"]
    container = server_container(name)
    (cache,) = [v for v in spec["volumes"] if v["name"] == "compile-cache"]
    if isinstance(volume, dict):
        assert {key: value for key, value in cache.items() if key != "name"} == volume
    else:
        assert cache["persistentVolumeClaim"] == {"claimName": "imgserve-compiled"}
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert mounts["compile-cache"] == "/var/cache/imgserve"
    assert env_of(container)["IMGSERVE_COMPILE_CACHE_DIR"] == "/var/cache/imgserve/compiled"
    assert spec["securityContext"]["fsGroupChangePolicy"] == "OnRootMismatch"


def test_a_compile_cache_directory_in_the_settings_wins() -> None:
    args = ["template", RELEASE, str(CHART), "--namespace", NAMESPACE, "--set", "settings.compile_cache_dir=/c/x"]
    deployment = next(d for d in yaml.safe_load_all(helm(*args).stdout) if d and d["kind"] == "Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert env_of(container)["IMGSERVE_COMPILE_CACHE_DIR"] == "/c/x"


def test_api_key_from_an_existing_secret() -> None:
    """auth.existingSecret is mounted as a directory (so a rotated Secret reaches the pod) and read as the key file;
    the helm test sends the key, and with protectMetrics so does the ServiceMonitor. Without it, no auth at all."""
    container = server_container("auth")
    env = env_of(container)
    assert (env["IMGSERVE_API_KEY_FILE"], env["IMGSERVE_PROTECT_METRICS"]) == (
        "/var/run/secrets/imgserve/token",
        "true",
    )
    volumes = {v["name"]: v for v in one("auth", "Deployment")["spec"]["template"]["spec"]["volumes"]}
    assert volumes["api-key"]["secret"] == {
        "secretName": "imgserve-api-keys",
        "items": [{"key": "token", "path": "token"}],
    }
    mount = {m["name"]: m for m in container["volumeMounts"]}["api-key"]
    assert mount == {"name": "api-key", "mountPath": "/var/run/secrets/imgserve", "readOnly": True}  # no subPath
    (test_container,) = one("auth", "Pod")["spec"]["containers"]
    assert env_of(test_container)["API_KEY_FILE"] == "/var/run/secrets/imgserve/token"
    assert mount in test_container["volumeMounts"]
    (endpoint,) = one("auth", "ServiceMonitor")["spec"]["endpoints"]
    assert endpoint["authorization"] == {"type": "Bearer", "credentials": {"name": "imgserve-api-keys", "key": "token"}}
    defaults = server_container("defaults")
    assert not {"IMGSERVE_API_KEY_FILE", "IMGSERVE_PROTECT_METRICS"} & env_of(defaults).keys()
    assert "api-key" not in {m["name"] for m in defaults["volumeMounts"]}


@pytest.mark.parametrize("name", ["defaults", "pod"])
def test_probes_sized_for_model_load(name: str) -> None:
    """startup and readiness on /health/ready, liveness on /health/live; start-up gets at least 5 minutes (podman
    ignores readiness, so the pod test's values are checked here)."""
    container = server_container(name)
    assert container["startupProbe"]["httpGet"]["path"] == "/health/ready"
    assert container["readinessProbe"]["httpGet"]["path"] == "/health/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health/live"
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300


def test_hpa_on_adapter_metrics() -> None:
    """autoscaling/v2 HPA on Pods metrics that the shipped adapter rules expose, with fast-up/slow-down behavior."""
    hpa = one("hpa", "HorizontalPodAutoscaler")
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": RELEASE}
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 6)
    metrics = {m["pods"]["metric"]["name"]: m["pods"]["target"] for m in hpa["spec"]["metrics"] if m["type"] == "Pods"}
    assert metrics["imgserve_queue_depth"] == {"type": "AverageValue", "averageValue": "8"}
    assert metrics["imgserve_gpu_utilization_percent"] == {"type": "AverageValue", "averageValue": "80"}
    assert set(metrics) <= {rule["name"]["as"] for rule in adapter_rules()}
    behavior = hpa["spec"]["behavior"]
    assert behavior["scaleDown"]["stabilizationWindowSeconds"] > behavior["scaleUp"]["stabilizationWindowSeconds"]


def test_keda_triggers() -> None:
    """Queue depth total as AverageValue, GPU average as Value, one-element queries on this release's pods."""
    scaled = one("keda", "ScaledObject")
    spec = scaled["spec"]
    assert (spec["minReplicaCount"], spec["maxReplicaCount"], spec["pollingInterval"]) == (1, 8, 15)
    assert spec["fallback"] == {"failureThreshold": 3, "replicas": 2}
    assert "idleReplicaCount" not in spec
    assert (
        spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == 300
    )
    triggers = {t["name"]: t for t in spec["triggers"]}
    assert set(triggers) == {"queue-depth", "gpu-utilization"}
    queue, gpu = triggers["queue-depth"], triggers["gpu-utilization"]
    assert (queue["type"], queue["metricType"], gpu["metricType"]) == ("prometheus", "AverageValue", "Value")
    assert queue["metadata"]["query"] == f"sum(imgserve_queue_depth{{{POD_SELECTOR}}})"
    assert gpu["metadata"]["query"] == f"100 * avg(imgserve_gpu_utilization_ratio{{{POD_SELECTOR}}})"
    assert (queue["metadata"]["threshold"], queue["metadata"]["activationThreshold"]) == ("8", "1")
    assert gpu["metadata"]["threshold"] == "80"


def test_keda_dcgm_joins_exported_pod() -> None:
    """With source=dcgm the GPU query moves exported_pod/exported_namespace onto pod/namespace and keeps our pods."""
    query = promql_of_scaledobject(one("keda-dcgm", "ScaledObject"))["gpu-utilization"]
    assert query.startswith("avg(label_replace(label_replace(DCGM_FI_DEV_GPU_UTIL")
    assert '"exported_pod"' in query and '"exported_namespace"' in query
    assert query.endswith(f"and on (namespace, pod) imgserve_build_info{{{POD_SELECTOR}}})")


def test_scale_to_zero_wakes_on_external_metric() -> None:
    """idleReplicaCount 0 comes with a wake trigger whose query exists at zero pods."""
    spec = one("scale-to-zero", "ScaledObject")["spec"]
    assert spec["idleReplicaCount"] == 0 and spec["minReplicaCount"] >= 1
    wake = {t["name"]: t for t in spec["triggers"]}["wake"]
    assert wake["metricType"] == "AverageValue"
    assert "nginx_ingress_controller_requests" in wake["metadata"]["query"]
    assert (wake["metadata"]["threshold"], wake["metadata"]["activationThreshold"]) == ("20", "0")


def test_promql_parses(tmp_path: Path) -> None:
    """Every autoscaling query (KEDA triggers, adapter rules with the adapter's substitutions) and the shipped
    alert rules parse with promtool."""
    queries = [q for n in AUTOSCALED if n != "hpa" for q in promql_of_scaledobject(one(n, "ScaledObject")).values()]
    for rule in adapter_rules():
        queries.append(rule["seriesQuery"])
        queries.append(rule["metricsQuery"].replace("<<.LabelMatchers>>", POD_SELECTOR).replace("<<.GroupBy>>", "pod"))
    records = [{"record": f"imgserve:check_{i}", "expr": q} for i, q in enumerate(queries)]
    autoscaling = tmp_path / "autoscaling.yaml"
    autoscaling.write_text(yaml.safe_dump({"groups": [{"name": "check", "rules": records}]}))
    alerts = tmp_path / "alerts.yaml"
    alerts.write_text(yaml.safe_dump(one("keda", "PrometheusRule")["spec"]))
    run(tool("promtool"), "check", "rules", str(autoscaling), str(alerts))


@pytest.mark.parametrize(("name", "present"), [("defaults", False), ("keda", False), ("hpa", True), ("cpu-only", True)])
def test_pdb_only_with_more_than_one_replica(name: str, present: bool) -> None:
    """A PodDisruptionBudget exists exactly when minReplicas (or replicaCount without autoscaling) is above 1."""
    pdbs = objects(name, "PodDisruptionBudget")
    assert bool(pdbs) == present
    if pdbs:
        deployment = one(name, "Deployment")
        assert pdbs[0]["spec"]["selector"] == deployment["spec"]["selector"]
        assert pdbs[0]["spec"]["maxUnavailable"] == 1


def test_monitoring_objects_select_the_server() -> None:
    """ServiceMonitor scrapes the Service's http port; rules and dashboard are the files shipped in the chart."""
    service, monitor = one("keda", "Service"), one("keda", "ServiceMonitor")
    labels = monitor["spec"]["selector"]["matchLabels"]
    assert labels.items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    (endpoint,) = monitor["spec"]["endpoints"]
    assert (endpoint["port"], endpoint["path"]) == (service["spec"]["ports"][0]["name"], "/metrics")
    rule = one("keda", "PrometheusRule")
    assert rule["spec"] == yaml.safe_load((CHART / "rules" / "imgserve-alerts.yaml").read_text())
    dashboard = one("keda", "ConfigMap")
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(dashboard["data"]["imgserve.json"]) == json.loads(
        (CHART / "dashboards" / "imgserve.json").read_text()
    )


def test_network_policy_admits_helm_test_when_restricted() -> None:
    """With allowedFrom set, the policy still lets the helm test Pod and the metrics peers in, on the http port (and
    gRPC's)."""
    policy = one("keda-dcgm", "NetworkPolicy")
    (rule,) = policy["spec"]["ingress"]
    assert rule["ports"] == [{"port": "http", "protocol": "TCP"}, {"port": "grpc", "protocol": "TCP"}]
    test_labels = one("keda-dcgm", "Pod")["metadata"]["labels"]
    selectors = [peer["podSelector"]["matchLabels"] for peer in rule["from"] if "podSelector" in peer]
    assert any(s.items() <= test_labels.items() for s in selectors)
    namespaces = {
        p["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"]
        for p in rule["from"]
        if "namespaceSelector" in p
    }
    assert namespaces == {"ingress-nginx", "monitoring"}


@pytest.mark.parametrize(
    ("name", "schema_error", "template_error"),
    [
        ("invalid-both-autoscalers", "/autoscaling/keda/enabled", "mutually exclusive"),
        ("invalid-scale-to-zero-without-wake", "/autoscaling/keda/wakeQuery", "needs autoscaling.keda.wakeQuery"),
        ("invalid-isvc-without-runtime", "/kserve/servingRuntime", "needs kserve.servingRuntime.enabled"),
        ("invalid-models-with-api", "/api", "models and api are exclusive"),
        ("invalid-compile-cache-without-claim", "/compileCache/claimName", "needs compileCache.claimName"),
    ],
)
def test_refused_values(name: str, schema_error: str, template_error: str) -> None:
    """Both autoscalers, scale to zero without a wake metric, an InferenceService without its runtime, or `models`
    beside `api`, fail in the schema and (schema skipped) in the templates."""
    base = ["template", RELEASE, str(CHART), "--namespace", NAMESPACE, *values_args(name)]
    by_schema = helm(*base, check=False)
    assert by_schema.returncode != 0 and schema_error in by_schema.stderr, by_schema.stderr
    by_template = helm(*base, "--skip-schema-validation", check=False)
    assert by_template.returncode != 0 and template_error in by_template.stderr, by_template.stderr


@pytest.mark.parametrize(
    ("name", "expected", "absent"),
    [
        (
            "keda-dcgm",
            ["get scaledobject imgserve", "WARNING: autoscaling is on but serviceMonitor", "dcgm-exporter"],
            [],
        ),
        ("hpa", ["get hpa imgserve --watch", "custom.metrics.k8s.io"], ["WARNING"]),
        ("defaults", ["Autoscaling is off", "POST /predict", "45s to terminate"], ["WARNING"]),
        (
            "models",
            [
                "classifier: /classifier/predict   /v2/models/classifier",
                "detector: /detector/predict",
                "/v2/repository/models/<name>/load",
                "loadModels: detector, classifier, denoiser",
                "127.0.0.1:8000/detector/predict",
                "Models: detector, classifier, embedder, denoiser",
            ],
            ["POST /predict ", "Model: "],
        ),
    ],
)
def test_notes(name: str, expected: list[str], absent: list[str]) -> None:
    """NOTES.txt shows the endpoints, how to watch the autoscaler, and warns when it has no metrics source."""
    out = helm("install", RELEASE, str(CHART), "--namespace", NAMESPACE, "--dry-run=client", *values_args(name)).stdout
    notes = out.split("NOTES:", 1)[1]
    assert all(text in notes for text in expected), notes
    assert not any(text in notes for text in absent), notes


CHECKOV_SKIPS = {"CKV_K8S_8", "CKV_K8S_9", "CKV_K8S_15", "CKV_K8S_43"}  # each annotated with its reason in the chart


def checkov(*args: str) -> dict[str, Any]:
    """checkov's results for one scan (offline: no Prisma Cloud download)."""
    result = run(tool("checkov"), *args, "-o", "json", "--skip-download", "--quiet", check=False)
    report = json.loads(result.stdout)
    return report["results"] if isinstance(report, dict) else report[0]["results"]


def assert_checkov_clean(results: dict[str, Any]) -> None:
    """No failed check, and every skip is one of the chart's explained ones."""
    failed = [(c["check_id"], c["resource"]) for c in results.get("failed_checks", [])]
    assert not failed, failed
    skipped = results.get("skipped_checks", [])
    assert {c["check_id"] for c in skipped} <= CHECKOV_SKIPS
    assert all(len(c["check_result"].get("suppress_comment", "")) > 20 for c in skipped)


def test_checkov_rendered_manifests(tmp_path: Path) -> None:
    """checkov passes on the manifests of every supported values file, rendered into the test namespace."""
    for name in VALID:
        (tmp_path / f"{name}.yaml").write_text(rendered_text(name))
    assert_checkov_clean(checkov("-d", str(tmp_path), "--framework", "kubernetes"))


def test_checkov_chart() -> None:
    """checkov's own helm scan of the chart passes too (charts/imgserve/.checkov.yaml explains its one skip)."""
    assert_checkov_clean(checkov("-d", str(CHART), "--framework", "helm"))


def test_helm_test_hook_posts_a_real_image(server: Server) -> None:
    """The helm test Pod runs the server image's Python; its script passes against a real imgserve on loopback."""
    pod = one("defaults", "Pod")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    (container,) = pod["spec"]["containers"]
    assert container["image"] == server_container("defaults")["image"]
    assert env_of(container)["PREDICT_URL"] == f"http://{RELEASE}:8000/predict"
    env = {**os.environ, "PREDICT_URL": f"{server.url}/predict"}
    result = subprocess.run(
        [sys.executable, *container["command"][1:], *container["args"]],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "predict ok" in result.stdout and "image/jpeg" in result.stdout


def test_values_documented() -> None:
    """Every leaf key of values.yaml has a `# --` comment block, its own or an enclosing key's (helm-docs style)."""
    lines = (CHART / "values.yaml").read_text().splitlines()
    enclosing: list[tuple[int, bool]] = []  # (indent, has its own `# --` block) of the keys above the current one
    undocumented = []
    for index, line in enumerate(lines):
        match = re.match(r"^( *)[A-Za-z][\w.-]*:(.*)$", line)
        if not match:
            continue
        leaf = bool(match.group(2).strip())
        indent = len(match.group(1))
        while enclosing and enclosing[-1][0] >= indent:
            enclosing.pop()
        block = []
        for above in reversed(lines[:index]):
            if not above.strip().startswith("#"):
                break
            block.append(above.strip())
        own = any(comment.startswith("# --") for comment in block)
        if leaf and not (own or any(documented for _, documented in enclosing)):
            undocumented.append(line.strip())
        enclosing.append((indent, own))
    assert not undocumented, undocumented


def test_settings_take_auto_front_ends_and_the_real_model_settings() -> None:
    base = ["template", RELEASE, str(CHART), "--namespace", NAMESPACE]
    settings = ["settings.api_servers=auto", "settings.preprocess=imagenet", "settings.task=segment"]
    rendered = helm(*base, *(arg for s in settings for arg in ("--set", s))).stdout
    assert all(f"IMGSERVE_{s.split('=')[0].split('.')[1].upper()}" in rendered for s in settings)
    for bad in ("settings.api_servers=0", "settings.task=caption"):
        refused = helm(*base, "--set", bad, check=False)
        assert refused.returncode != 0 and bad.split("=")[0].split(".")[1] in refused.stderr, refused.stderr


def test_kserve_runtime_and_inference_service() -> None:
    """The ServingRuntime speaks v2 and grpc-v2 on KServe's ports under the InferenceService's name; the example
    InferenceService picks it and passes the downloaded model; its container is a valid Kubernetes container."""
    runtime, service = one("kserve", "ServingRuntime"), one("kserve", "InferenceService")
    assert runtime["spec"]["protocolVersions"] == ["v2", "grpc-v2"]
    formats = runtime["spec"]["supportedModelFormats"]
    assert {f["name"] for f in formats} == {"imgserve", "pytorch", "safetensors"}
    assert [f["name"] for f in formats if f.get("autoSelect")] == ["imgserve"]
    (container,) = runtime["spec"]["containers"]
    assert container["name"] == "kserve-container"
    assert {"--port=8080", "--grpc-port=9000", "--model-name={{.Name}}"} <= set(container["args"])
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "runtime"},
        "spec": {"containers": [container], "volumes": runtime["spec"]["volumes"]},
    }
    kubernetes_validate.validate(pod, K8S_VERSION, strict=True)
    model = service["spec"]["predictor"]["model"]
    assert model["runtime"] == runtime["metadata"]["name"] and model["modelFormat"] == {"name": "imgserve"}
    assert model["protocolVersion"] == "v2" and model["storageUri"] == "gs://models/restorer"
    assert model["args"] == ["--model=/mnt/models/restorer.safetensors"]
    assert env_of(server_container("kserve"))["IMGSERVE_MODEL_NAME"] == "restorer"


def test_kserve_schemas_reject_misspelled_fields() -> None:
    """The trimmed KServe CRDs still catch a wrong field where the chart writes one."""
    runtime, service = one("kserve", "ServingRuntime"), one("kserve", "InferenceService")
    runtime["spec"]["protocolVersion"] = runtime["spec"].pop("protocolVersions")
    service["spec"]["predictor"]["model"]["modelformat"] = service["spec"]["predictor"]["model"].pop("modelFormat")
    for doc, field in ((runtime, "protocolVersion"), (service, "modelformat")):
        errors = [e.message for e in crd_validator(*KSERVE_CRDS[doc["kind"]]).iter_errors(doc)]
        assert any(field in message for message in errors), errors


@pytest.mark.parametrize(("name", "port"), [("defaults", 8001), ("grpc-off", 0)])
def test_grpc_port_on_the_service_only_when_on(name: str, port: int) -> None:
    container = server_container(name)
    assert env_of(container)["IMGSERVE_GRPC_PORT"] == str(port)
    service_ports = {p["name"]: p for p in one(name, "Service")["spec"]["ports"]}
    container_ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    policy_ports = [p["port"] for p in one(name, "NetworkPolicy")["spec"]["ingress"][0]["ports"]]
    if port:
        assert service_ports["grpc"]["appProtocol"] == "kubernetes.io/h2c"
        assert service_ports["grpc"]["targetPort"] == "grpc" and container_ports["grpc"] == port
        assert "grpc" in policy_ports
    else:
        assert "grpc" not in service_ports and "grpc" not in container_ports and "grpc" not in policy_ports
    assert not objects(name, "ServingRuntime") and not objects(name, "InferenceService")


def test_the_api_value_serves_a_users_own_api_and_the_schema_checks_its_form() -> None:
    """`api` becomes IMGSERVE_API in the Deployment and the KServe runtime; a value that is not module:Class is
    refused by the schema before anything is rendered."""
    api = "examples.fields:FieldsAPI"
    extra = ["--set", f"api={api}", "--set", "kserve.servingRuntime.enabled=true"]
    rendered = helm("template", RELEASE, str(CHART), "--namespace", NAMESPACE, *values_args("defaults"), *extra)
    docs = [doc for doc in yaml.safe_load_all(rendered.stdout) if doc]
    (deployment,) = [doc for doc in docs if doc["kind"] == "Deployment"]
    (container,) = [c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == "server"]
    assert env_of(container)["IMGSERVE_API"] == api
    (runtime,) = [doc for doc in docs if doc["kind"] == "ServingRuntime"]
    assert env_of(runtime["spec"]["containers"][0])["IMGSERVE_API"] == api
    assert "IMGSERVE_API" not in env_of(server_container("defaults"))
    refused = helm("template", RELEASE, str(CHART), *values_args("defaults"), "--set", "api=not a class", check=False)
    assert refused.returncode != 0 and "/api" in refused.stderr, refused.stderr


def test_with_an_api_the_built_in_models_settings_are_refused_and_no_model_is_named() -> None:
    """With `api` the Deployment names no built-in model (IMGSERVE_MODEL), and the built-in model's settings are
    refused by the schema, as `imgserve serve --api ... --preprocess ...` refuses them."""
    with_api = ["--set", "api=examples.fields:FieldsAPI"]
    rendered = helm("template", RELEASE, str(CHART), "--namespace", NAMESPACE, *values_args("defaults"), *with_api)
    (deployment,) = [doc for doc in yaml.safe_load_all(rendered.stdout) if doc and doc["kind"] == "Deployment"]
    (container,) = [c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == "server"]
    assert "IMGSERVE_MODEL" not in env_of(container) and "IMGSERVE_PRECISION" not in env_of(container)
    assert env_of(server_container("defaults"))["IMGSERVE_MODEL"] == "builtin:denoiser"
    for setting in ("settings.precision=fp16", "settings.preprocess=imagenet"):
        args = [*values_args("defaults"), *with_api, "--set", setting]
        refused = helm("template", RELEASE, str(CHART), *args, check=False)
        assert refused.returncode != 0 and "'/settings': 'not' failed" in refused.stderr, refused.stderr


# Several models: the `models` value rendered as a model repository


def template_with(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """`helm template` of the defaults with extra arguments (--set-json ...)."""
    return helm("template", RELEASE, str(CHART), "--namespace", NAMESPACE, *values_args("defaults"), *args, check=check)


def repository_files(docs: list[Manifest]) -> dict[str, Any]:
    """The repository the Deployment mounts, as the server reads it: relative path -> parsed config.yaml (the
    ConfigMap's keys placed at their items' paths)."""
    (deployment,) = [doc for doc in docs if doc["kind"] == "Deployment"]
    (volume,) = [v for v in deployment["spec"]["template"]["spec"]["volumes"] if v["name"] == "repository"]
    (config_map,) = [doc for doc in docs if doc["kind"] == "ConfigMap" and doc["metadata"]["name"] == "imgserve-models"]
    assert volume["configMap"]["name"] == config_map["metadata"]["name"]
    items = volume["configMap"]["items"]
    assert {item["key"] for item in items} == set(config_map["data"])
    return {item["path"]: yaml.safe_load(config_map["data"][item["key"]]) for item in items}


def test_models_render_a_model_repository() -> None:
    """One folder per model with its config.yaml: an API's `api`, a built-in model's `model` and settings, each
    model's batching and path; mounted read-only where IMGSERVE_MODEL_REPOSITORY points; model control and the
    models loaded at start in the environment; no one-model IMGSERVE_MODEL or IMGSERVE_API; /models still mounted."""
    docs = render("models")
    assert repository_files(docs) == {
        "detector/config.yaml": {
            "api": "examples.detector:DetectorAPI",
            "api_path": "/detector/predict",
            "max_batch_size": 4,
        },
        "classifier/config.yaml": {
            "model": "/models/resnet50.pt2",
            "preprocess": "imagenet",
            "labels": "/models/imagenet_classes.txt",
            "precision": "fp16",
            "max_batch_size": 32,
            "batch_timeout_ms": 2.5,
        },
        "embedder/config.yaml": {"api": "examples.embedding:EmbeddingAPI", "api_path": "/embedder/predict"},
        "denoiser/config.yaml": {"model": "builtin:denoiser"},
    }
    container = server_container("models")
    env = env_of(container)
    assert (env["IMGSERVE_MODEL_REPOSITORY"], env["IMGSERVE_MODEL_CONTROL"], env["IMGSERVE_LOAD_MODEL"]) == (
        "/etc/imgserve/repository",
        "explicit",
        "detector,classifier,denoiser",
    )
    assert not {"IMGSERVE_MODEL", "IMGSERVE_API", "IMGSERVE_MODEL_NAME"} & env.keys()
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    assert mounts["repository"] == {"name": "repository", "mountPath": "/etc/imgserve/repository", "readOnly": True}
    assert mounts["models"]["mountPath"] == "/models" and mounts["models"]["readOnly"] is True
    (test_pod,) = objects("models", "Pod")
    test_env = env_of(test_pod["spec"]["containers"][0])
    assert json.loads(test_env["READY_MODELS"]) == ["detector", "classifier", "denoiser"]
    assert json.loads(test_env["PREDICT_PATHS"]) == {
        "classifier": "/classifier/predict",
        "denoiser": "/denoiser/predict",
    }
    defaults = render("defaults")
    assert not [doc for doc in defaults if doc["kind"] == "ConfigMap"]
    assert not {"IMGSERVE_MODEL_REPOSITORY", "IMGSERVE_MODEL_CONTROL"} & env_of(server_container("defaults")).keys()


def test_a_change_of_models_rolls_the_pods() -> None:
    """The server reads its repository once: the pod template carries the ConfigMap's checksum, which changes with
    any model's settings (and is absent without models)."""

    def checksum(models: list[dict[str, Any]]) -> str | None:
        docs = yaml.safe_load_all(template_with("--set-json", f"models={json.dumps(models)}").stdout)
        (deployment,) = [doc for doc in docs if doc and doc["kind"] == "Deployment"]
        return deployment["spec"]["template"]["metadata"].get("annotations", {}).get("checksum/models")

    one = checksum([{"name": "a", "model": "builtin:denoiser"}])
    assert one and one == checksum([{"name": "a", "model": "builtin:denoiser"}])
    assert one != checksum([{"name": "a", "model": "builtin:denoiser", "max_batch_size": 2}])
    assert checksum([]) is None


MODELS_REFUSED = [
    # (--set-json arguments, where the schema points, what the templates say with the schema skipped: None if the
    # schema alone can say it)
    ([{"name": "../up", "model": "builtin:denoiser"}], "/models/0/name", "is not a model name"),
    ([{"name": "a", "model": "x.pt", "api": "m:C"}], "/models/0", "has both api and model"),
    ([{"name": "a"}], "/models/0", "needs api (module:Class) or model"),
    ([{"name": "a", "api": "m:C", "settings": {"precision": "fp16"}}], "/models/0", None),
    ([{"name": "a", "model": "x.pt", "settings": {"colour": "red"}}], "/models/0/settings", None),
    ([{"name": "a", "api": "not a class"}], "/models/0/api", None),
]


@pytest.mark.parametrize(("models", "schema_error", "template_error"), MODELS_REFUSED)
def test_the_schema_refuses_models_it_can_judge(
    models: list[dict[str, Any]], schema_error: str, template_error: str | None
) -> None:
    """A name that is no folder name, api and model together or neither, the built-in model's settings beside an
    API, an unknown setting, an API that is not module:Class: refused before anything renders."""
    args = ["--set-json", f"models={json.dumps(models)}"]
    refused = template_with(*args, check=False)
    assert refused.returncode != 0 and f"at '{schema_error}'" in refused.stderr, refused.stderr
    if template_error:
        skipped = template_with(*args, "--skip-schema-validation", check=False)
        assert skipped.returncode != 0 and template_error in skipped.stderr, skipped.stderr


@pytest.mark.parametrize(
    ("args", "schema_error", "template_error"),
    [
        (["--set-json", 'models=[{"name":"a","model":"x.pt"},{"name":"a","api":"m:C"}]'], None, 'named "a"'),
        (
            ["--set-json", 'models=[{"name":"a","model":"x.pt"}]', "--set", "modelControl=explicit"]
            + ["--set-json", 'loadModels=["b"]'],
            None,
            '"b" is not the name of a model',
        ),
        (
            ["--set-json", 'models=[{"name":"a","model":"x.pt"}]', "--set-json", 'loadModels=["a"]'],
            "/loadModels",
            "needs modelControl explicit",
        ),
        (
            ["--set-json", 'models=[{"name":"a","model":"x.pt"}]', "--set", "modelName=b"],
            "/modelName",
            "modelName are exclusive",
        ),
        (
            ["--set-json", 'models=[{"name":"a","model":"x.pt"}]', "--set", "kserve.servingRuntime.enabled=true"],
            "/kserve/servingRuntime/enabled",
            "one model per InferenceService",
        ),
    ],
    ids=["duplicate-names", "load-an-unknown-model", "load-without-explicit", "model-name", "kserve"],
)
def test_the_templates_refuse_what_the_schema_cannot_say(
    args: list[str], schema_error: str | None, template_error: str
) -> None:
    """Two models of one name and loading a model that is not there pass any JSON schema: the templates stop them
    in one line; the rest fail in the schema first and in the templates when it is skipped."""
    if schema_error:
        refused = template_with(*args, check=False)
        assert refused.returncode != 0 and f"at '{schema_error}'" in refused.stderr, refused.stderr
    skipped = template_with(*args, "--skip-schema-validation", check=False)
    assert skipped.returncode != 0 and template_error in skipped.stderr, skipped.stderr
    assert len(skipped.stderr.strip().splitlines()[0]) < 250


def test_the_rendered_repository_is_served_and_passes_its_helm_test(tmp_path: Path) -> None:
    """The chart's repository, written where the pod would mount it, is what `imgserve serve` reads: two built-in
    models answer at /<name>/predict and over v2, only loadModels' one is loaded, and the helm test Pod's script
    passes against the real server; it fails when a model it expects is not loaded."""
    models = [
        {"name": "restore", "model": "builtin:denoiser", "max_batch_size": 2},
        {"name": "sharpen", "model": "builtin:denoiser", "settings": {"output_format": "png"}},
    ]
    extra = ["--set-json", f"models={json.dumps(models)}", "--set", "modelControl=explicit"]
    docs = [
        doc for doc in yaml.safe_load_all(template_with(*extra, "--set-json", 'loadModels=["restore"]').stdout) if doc
    ]
    for path, config in repository_files(docs).items():
        (tmp_path / "repository" / path).parent.mkdir(parents=True)
        (tmp_path / "repository" / path).write_text(yaml.safe_dump(config))
    (deployment,) = [doc for doc in docs if doc["kind"] == "Deployment"]
    env = env_of(deployment["spec"]["template"]["spec"]["containers"][0])
    (test_pod,) = [doc for doc in docs if doc["kind"] == "Pod"]
    container = test_pod["spec"]["containers"][0]
    settings = {"model_control": env["IMGSERVE_MODEL_CONTROL"], "load_model": env["IMGSERVE_LOAD_MODEL"]}
    repository = str(tmp_path / "repository")
    with running_server(
        tmp_path, model_repository=repository, workers_per_device=1, api_servers=1, **settings
    ) as server:
        index = httpx.post(f"{server.url}/v2/repository/index", timeout=10).json()
        assert {m["name"]: m["state"] for m in index} == {"restore": "READY", "sharpen": "UNAVAILABLE"}

        def helm_test(ready: str) -> subprocess.CompletedProcess[str]:
            test_env = {**os.environ, **env_of(container), "SERVER_URL": server.url, "READY_MODELS": ready}
            script = [sys.executable, *container["command"][1:], *container["args"]]
            return subprocess.run(script, env=test_env, capture_output=True, text=True, timeout=120)

        passed = helm_test(env_of(container)["READY_MODELS"])
        assert passed.returncode == 0, passed.stderr
        assert "restore ready" in passed.stdout and "restore predict ok at /restore/predict" in passed.stdout
        failed = helm_test('["restore", "sharpen"]')
        assert failed.returncode != 0 and "HTTP Error 400" in failed.stderr, failed.stderr


def test_tracing_renders_opentelemetrys_own_variables_only_when_an_endpoint_is_set() -> None:
    """`tracing` becomes the OTEL_* variables the server reads (imgserve/tracing.py), with the pod and namespace as
    resource attributes; without an endpoint none is rendered (tracing off), and the schema refuses a bad ratio."""
    container = server_container("tracing")
    env = env_of(container)
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector.observability:4317"
    assert (env["OTEL_EXPORTER_OTLP_PROTOCOL"], env["OTEL_TRACES_SAMPLER"]) == ("grpc", "parentbased_traceidratio")
    assert (env["OTEL_TRACES_SAMPLER_ARG"], env["OTEL_SERVICE_NAME"]) == ("0.25", RELEASE)  # the full name
    pod = next(e for e in container["env"] if e["name"] == "OTEL_K8S_POD_NAME")
    assert pod["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert env["OTEL_RESOURCE_ATTRIBUTES"] == f"k8s.namespace.name={NAMESPACE},k8s.pod.name=$(OTEL_K8S_POD_NAME)"
    assert not [e for e in server_container("defaults")["env"] if e["name"].startswith("OTEL_")]
    refused = helm("template", RELEASE, str(CHART), *values_args("tracing"), "--set", "tracing.ratio=2", check=False)
    assert refused.returncode != 0 and "/tracing/ratio" in refused.stderr, refused.stderr
