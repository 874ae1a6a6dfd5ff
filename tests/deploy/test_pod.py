"""The chart's pods run: the Deployment rendered with tests/chart_values/pod.yaml runs under `podman kube play` with
the image the container test builds, the values reach the server (/info), its limits and uid apply, and the chart's
`helm test` Pod passes against it. What podman ignores (readiness probe, grace period, runAsNonRoot) is checked by
rendering in tests/deploy/test_chart.py, which renders this values file too.

Adapted only where podman 4.3 needs it: host network without port mappings; no Service DNS (the helm test Pod is
pointed at the loopback port); no annotations (podman caps their length); the Secret volume's `optional: false`
spelled out (podman dereferences it unset) and its data given unencoded (podman mounts it undecoded); podman's own
/dev/shm of the chart's size instead of the emptyDir (which podman makes a root-owned disk volume the server cannot
write). The server also binds loopback instead of 0.0.0.0: on the host network that keeps it off the machine's
interfaces.
"""

from __future__ import annotations

import contextlib
import copy
import json
import secrets
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from containers import IMAGE, NEEDS_THE_IMAGE, image, podman, processes, require_podman
from serving import REPO, TESTS, wait_until
from tools import tool

from imgserve.testing import LOOPBACK, free_port

pytestmark = NEEDS_THE_IMAGE
CHART = REPO / "charts" / "imgserve"
VALUES = TESTS / "chart_values" / "pod.yaml"
Manifest = dict[str, Any]


def render(port: int) -> list[Manifest]:
    """The chart rendered with the pod test's values, serving on `port`."""
    rendered = subprocess.run(
        [tool("helm"), "template", "imgserve", str(CHART), "-f", str(VALUES), f"--set=containerPort={port}"]
        + [f"--set=grpcPort={free_port()}"],  # the host network is shared: no fixed port
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    return [doc for doc in yaml.safe_load_all(rendered) if doc]


def for_podman(manifest: Manifest, env: dict[str, str]) -> str | None:
    """A Deployment or Pod adapted: host network, no port mappings, `optional: false` on Secret volumes, these env
    values replaced, no annotations (podman refuses values over 63 characters, like checkov's reasons), and the
    emptyDir at /dev/shm dropped for podman's own /dev/shm of its size (returned, in bytes)."""
    manifest["metadata"].pop("annotations", None)
    pod_spec = manifest["spec"]["template"]["spec"] if manifest["kind"] == "Deployment" else manifest["spec"]
    pod_spec["hostNetwork"] = True
    shm = {m["name"] for c in pod_spec["containers"] for m in c.get("volumeMounts", []) if m["mountPath"] == "/dev/shm"}
    for container in pod_spec["containers"]:
        container.pop("ports", None)
        container["volumeMounts"] = [m for m in container.get("volumeMounts", []) if m["name"] not in shm]
        for variable in container.get("env", []):
            variable["value"] = env.get(variable["name"], variable.get("value"))
    for volume in pod_spec.get("volumes", []):
        if "secret" in volume:
            volume["secret"]["optional"] = False
    sizes = [v["emptyDir"]["sizeLimit"] for v in pod_spec.get("volumes", []) if v["name"] in shm]
    pod_spec["volumes"] = [v for v in pod_spec.get("volumes", []) if v["name"] not in shm]
    return str(quantity_bytes(sizes[0])) if sizes else None


def quantity_bytes(quantity: str) -> int:
    """A Kubernetes memory quantity in Mi or Gi, in bytes."""
    for suffix, factor in (("Gi", 2**30), ("Mi", 2**20)):
        if quantity.endswith(suffix):
            return int(quantity.removesuffix(suffix)) * factor
    raise ValueError(f"not a Mi or Gi quantity: {quantity}")


def api_key_secret(name: str, key: str, value: str) -> Manifest:
    """The Secret the values name in auth.existingSecret (the chart expects it to exist). Its data is NOT base64
    encoded as Kubernetes wants: podman 4.3 mounts a Secret's data without decoding it (measured: the file held the
    base64 text), so the key is given as the file must read."""
    return {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name}, "type": "Opaque", "data": {key: value}}


@contextlib.contextmanager
def played(path: Path, documents: list[Manifest], shm_size: str | None = None) -> Iterator[list[str]]:
    """`podman kube play` the documents; yields the ids of the containers it started; `kube down` afterwards."""
    path.write_text(yaml.safe_dump_all(documents))
    secret_names = [doc["metadata"]["name"] for doc in documents if doc["kind"] == "Secret"]
    try:
        output = podman("kube", "play", str(path), timeout=180, shm_size=shm_size).stdout
        yield output.split("Container:")[1].split()
    finally:
        podman("kube", "down", str(path), check=False)
        for name in secret_names:
            podman("secret", "rm", name, check=False)


def inspect(container: str) -> Manifest:
    """podman inspect of one container."""
    [found] = json.loads(podman("inspect", container).stdout)
    return found


@dataclass
class Pod:
    """The chart's Deployment running under podman, and what the tests need to reach and check it."""

    url: str
    key: str
    values: Manifest
    documents: list[Manifest]  # everything the chart rendered, unadapted
    server: str  # the server container's id
    directory: Path

    def rendered(self, kind: str, hook: bool = False) -> Manifest:
        """The one rendered object of `kind` (the `helm test` hook's with hook=True)."""
        [found] = [
            doc
            for doc in self.documents
            if doc["kind"] == kind and ("helm.sh/hook" in doc["metadata"].get("annotations", {})) == hook
        ]
        return copy.deepcopy(found)


@pytest.fixture(scope="module")
def pod(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pod]:
    """The Deployment, adapted for podman, played with the Secret it names; until the module's tests are done."""
    require_podman()
    assert image() == IMAGE
    port, key = free_port(), secrets.token_hex(16)
    values = yaml.safe_load(VALUES.read_text())
    url = f"http://{LOOPBACK}:{port}"
    pod = Pod(url, key, values, render(port), "", tmp_path_factory.mktemp("pod"))
    deployment = pod.rendered("Deployment")
    assert [c["image"] for c in deployment["spec"]["template"]["spec"]["containers"]] == [IMAGE]
    shm_size = for_podman(deployment, {"IMGSERVE_HOST": LOOPBACK})
    secret = api_key_secret(values["auth"]["existingSecret"], values["auth"]["secretKey"], key)
    with played(pod.directory / "deployment.yaml", [secret, deployment], shm_size) as [pod.server]:
        wait_until(lambda: _ready(pod.server, url), 180, "the pod's server ready")
        yield pod


def _ready(container: str, url: str) -> bool:
    """Is the pod's server ready? Fails the test with its log if the container stopped."""
    state = inspect(container)["State"]
    if state["Status"] != "running":
        logs = podman("logs", container, check=False)
        pytest.fail(f"the server container is {state['Status']}:\n{(logs.stdout + logs.stderr)[-4000:]}")
    with contextlib.suppress(httpx.HTTPError):
        return httpx.get(f"{url}/health/ready", timeout=2).status_code == 200
    return False


def test_values_reach_the_server(pod: Pod) -> None:
    """/info (which protectMetrics guards with the key from the Secret) shows the model, workers and queue bound."""
    settings = pod.values["settings"]
    assert httpx.get(f"{pod.url}/info", timeout=10).status_code == 401
    answer = httpx.get(f"{pod.url}/info", headers={"Authorization": f"Bearer {pod.key}"}, timeout=10)
    assert answer.status_code == 200, answer.text
    info = answer.json()
    assert info["model"] == "builtin:denoiser"
    assert info["device"] == "cpu"
    assert info["workers"] == settings["workers_per_device"]
    assert info["max_queue_depth"] == settings["max_queue_depth"]
    assert info["max_batch_size"] == settings["max_batch_size"]


def test_limits_and_user_apply(pod: Pod) -> None:
    """The memory and CPU limits and the container's runAsUser, as rendered, hold for the running server."""
    [container] = pod.rendered("Deployment")["spec"]["template"]["spec"]["containers"]
    limits = container["resources"]["limits"]
    host = inspect(pod.server)["HostConfig"]
    assert host["Memory"] == quantity_bytes(limits["memory"])
    assert host["CpuQuota"] / host["CpuPeriod"] == float(limits["cpu"])
    uids = {uid for uid, _ in processes(pod.server).values()}
    assert uids == {container["securityContext"]["runAsUser"]}, uids
    script = "import os; s = os.statvfs('/dev/shm'); print(s.f_blocks * s.f_frsize)"
    [shm] = [v["emptyDir"]["sizeLimit"] for v in pod.rendered("Deployment")["spec"]["template"]["spec"]["volumes"]
             if v["name"] == "dshm"]  # fmt: skip
    assert int(podman("exec", pod.server, "python", "-c", script).stdout) == quantity_bytes(shm)


def test_helm_test_pod_passes_against_the_pod(pod: Pod) -> None:
    """The chart's `helm test` Pod, its command unchanged, posts a real image to the server and checks the JPEG
    (with the API key from the same Secret, which the server's play left in podman's secret store)."""
    test_pod = pod.rendered("Pod", hook=True)
    for_podman(test_pod, {"PREDICT_URL": f"{pod.url}/predict"})
    with played(pod.directory / "helm-test.yaml", [test_pod]) as [container]:
        state = wait_until(
            lambda: (found := inspect(container)["State"])["Status"] == "exited" and found, 120, "the helm test"
        )
        logs = podman("logs", container)
        assert state["ExitCode"] == 0, logs.stdout + logs.stderr
        assert "predict ok" in logs.stdout + logs.stderr
