"""The image, built from the Dockerfile and run with podman: the README's curl, uid 10001 under tini, /dev/shm, the
HEALTHCHECK, and `podman stop` during a burst (every request answered, exit 0 within the grace period)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import re
import shlex
import subprocess
import time
from collections.abc import Iterator

import httpx
import pytest
from containers import NEEDS_THE_IMAGE, image, podman, processes, removed_after, require_podman
from PIL import Image
from serving import REPO, image_bytes, wait_until

from imgserve.testing import LOOPBACK, free_port

pytestmark = NEEDS_THE_IMAGE
SHM_BYTES = 256 * 1024 * 1024  # not podman's default 64 MiB
GRACE_S = 30  # podman stop's grace period (the chart's terminationGracePeriodSeconds plays this part)
DRAIN_S = 20


@contextlib.contextmanager
def running_container(name: str, *options: str, image_name: str | None = None) -> Iterator[str]:
    """The image run on the host network, serving on a free loopback port (gRPC off: its default port may be another
    server's on the shared network); yields its URL once it is ready."""
    require_podman()
    port = free_port()
    with removed_after(name):
        podman(
            "run", "--detach", f"--name={name}", "--network=host", f"--shm-size={SHM_BYTES // 2**20}m",
            f"--env=IMGSERVE_HOST={LOOPBACK}", f"--env=IMGSERVE_PORT={port}", "--env=IMGSERVE_GRPC_PORT=0",
            *options, image_name or image(),
        )  # fmt: skip
        url = f"http://{LOOPBACK}:{port}"
        wait_until(lambda: ready(name, url), 180, f"container {name} ready")
        yield url


def ready(name: str, url: str) -> bool:
    """Is the server in the container ready? Fails the test with its log if the container stopped."""
    status = podman("inspect", "--format={{.State.Status}}", name).stdout.strip()
    if status != "running":
        logs = podman("logs", name, check=False)
        pytest.fail(f"container {name} is {status}:\n{(logs.stdout + logs.stderr)[-4000:]}")
    with contextlib.suppress(httpx.HTTPError):
        return httpx.get(f"{url}/health/ready", timeout=2).status_code == 200
    return False


@pytest.fixture(scope="module")
def container() -> Iterator[tuple[str, str]]:
    name = f"imgserve-test-{os.getpid()}"
    with running_container(name) as url:
        yield name, url


def test_readme_curl_answers_a_jpeg(container: tuple[str, str], tmp_path) -> None:
    _, url = container
    readme = (REPO / "README.md").read_text()
    command = re.search(r"^curl -F file=@(\S+) localhost:8000/predict -o (\S+)$", readme, re.MULTILINE)
    assert command, "the README's first curl example changed"
    photo, output = command.groups()
    (tmp_path / photo).write_bytes(image_bytes(160, 120, fmt="JPEG"))
    args = shlex.split(command.group(0).replace("localhost:8000", url.removeprefix("http://")))
    result = subprocess.run([*args, "-sS", "-w", "%{http_code}"], cwd=tmp_path, capture_output=True, text=True)
    assert (result.returncode, result.stdout) == (0, "200"), result.stderr
    with Image.open(tmp_path / output) as answer:
        assert (answer.format, answer.size) == ("JPEG", (160, 120))


def test_runs_as_uid_10001_under_tini(container: tuple[str, str]) -> None:
    name, _ = container
    found = processes(name)
    assert found[1][1].startswith("/usr/bin/tini -- imgserve serve"), found[1]
    assert {uid for uid, _ in found.values()} == {10001}, found
    assert sum("imgserve serve" in command for _, command in found.values()) >= 3, found  # tini, server, front end


def test_dev_shm_follows_shm_size(container: tuple[str, str]) -> None:
    name, _ = container
    script = "import os; s = os.statvfs('/dev/shm'); print(s.f_blocks * s.f_frsize)"
    assert int(podman("exec", name, "python", "-c", script).stdout) == SHM_BYTES


def test_image_healthcheck_passes(container: tuple[str, str]) -> None:
    name, _ = container
    [config] = json.loads(podman("image", "inspect", image()).stdout)
    assert "/health/live" in " ".join(config["Healthcheck"]["Test"]), config["Healthcheck"]
    result = podman("healthcheck", "run", name, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_podman_stop_answers_every_request_in_flight_and_exits_zero() -> None:
    name = f"imgserve-stop-{os.getpid()}"
    with running_container(name, f"--env=IMGSERVE_DRAIN_TIMEOUT_S={DRAIN_S}") as url:
        body = image_bytes(512, 384)

        def post() -> int | str:
            try:
                response = httpx.post(
                    f"{url}/predict", content=body, headers={"Content-Type": "image/png"}, timeout=GRACE_S + 10
                )
            except httpx.HTTPError as exc:
                return f"{type(exc).__name__}: {exc}"
            return response.status_code

        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            burst = [pool.submit(post) for _ in range(16)]
            wait_until(lambda: queue_depth(url) >= 4, 30, "the burst admitted", interval_s=0.05)
            started = time.monotonic()
            podman("stop", f"--time={GRACE_S}", name, timeout=GRACE_S + 30)
            stopped_s = time.monotonic() - started
            answers = [future.result() for future in burst]
        print(f"podman stop took {stopped_s:.1f} s with a burst of {len(burst)} in flight")
        assert set(answers) <= {200, 503} and 200 in answers, answers
        assert podman("inspect", "--format={{.State.ExitCode}}", name).stdout.strip() == "0"
        assert stopped_s < GRACE_S
        logs = podman("logs", name)
        assert "Traceback" not in logs.stdout + logs.stderr


def queue_depth(url: str) -> float:
    """imgserve_queue_depth read from /metrics (0 if unreadable)."""
    with contextlib.suppress(httpx.HTTPError):
        match = re.search(r"^imgserve_queue_depth (\S+)$", httpx.get(f"{url}/metrics", timeout=5).text, re.MULTILINE)
        return float(match.group(1)) if match else 0.0
    return 0.0


def test_a_users_api_in_an_image_built_from_imgserves_answers_with_its_own_rules(tmp_path) -> None:
    """examples/Dockerfile, built in examples/ as the docs show: FROM the imgserve image, COPY of fields.py,
    IMGSERVE_API naming its class; it answers the example's JSON, and its own 422 on a bad field."""
    require_podman()
    tag = "localhost/imgserve-fields:test"
    podman(
        "build", "--format=docker", "--network=host", f"--build-arg=IMGSERVE_IMAGE={image()}",
        f"--tag={tag}", str(REPO / "examples"), timeout=300,
    )  # fmt: skip
    name = f"imgserve-fields-{os.getpid()}"
    with running_container(name, image_name=tag) as url:
        photo = {"file": ("photo.jpg", image_bytes(64, 48, fmt="JPEG"), "image/jpeg")}
        answer = httpx.post(f"{url}/predict", files=photo, data={"threshold": "0.5", "box": "0,0,32,24"}, timeout=60)
        assert answer.status_code == 200, answer.text
        assert set(answer.json()) >= {"threshold", "box", "bright_fraction", "mean_rgb"}
        refused = httpx.post(f"{url}/predict", files=photo, data={"threshold": "2"}, timeout=60)
        assert refused.status_code == 422 and "threshold" in refused.json()["error"]["message"]
        assert httpx.get(f"{url}/info", timeout=10).json()["model"] == "fields.FieldsAPI"
