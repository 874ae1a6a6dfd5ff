"""podman for the container and pod tests: this machine's podman settings, a Debian base image made with mmdebstrap
(no registry; cached under a hash of what makes it), the image built from the Dockerfile with the host's own pip
settings and CPU torch, and the reason to skip where podman cannot run a container at all.
Workarounds measured on this kind of machine: ../shared/anchors/containers.md (runc, explicit ulimits, docker format).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import hashlib
import importlib.metadata
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from serving import REPO

BASE_SUITE = "bookworm"  # its python3 is 3.11, the Python of the CPU torch wheel the host keeps
BASE_PACKAGES = "passwd"  # useradd, which the Dockerfile runs; the rest it installs with apt itself
IMAGE = "localhost/imgserve:test"
HOST_CA = "/host-ca.crt"  # where the host's CA bundle is mounted during the build
# crun cannot run under cgroups v1 hybrid; the default ulimits are refused; no systemd to log events to.
CONTAINERS_CONF = """\
[containers]
default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
"""
# The first test that needs the image builds it: about 5 minutes cold on 2 busy cores, over pytest's usual limit.
NEEDS_THE_IMAGE = pytest.mark.timeout(900)
PIP_SETTINGS = ("index-url", "extra-index-url", "find-links", "cert")
SCOPE_RANK = {":env:": 3, "site": 2, "user": 1, "global": 0}  # pip's own precedence, highest wins


@functools.cache
def podman_env(shm_size: str | None = None) -> dict[str, str]:
    """The environment for podman: the configuration above in a file of its own, with a default /dev/shm size for
    `kube play` (which turns a pod's emptyDir at /dev/shm into a root-owned disk volume, so the test drops it)."""
    directory = tempfile.mkdtemp(prefix="imgserve-podman-")
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    conf = Path(directory) / "containers.conf"
    shm = f'shm_size = "{shm_size}"\n' if shm_size else ""
    conf.write_text(CONTAINERS_CONF.replace("[containers]\n", f"[containers]\n{shm}"))
    return {**os.environ, "CONTAINERS_CONF": str(conf)}


def podman(
    *args: str, timeout: float = 120, check: bool = True, shm_size: str | None = None
) -> subprocess.CompletedProcess[str]:
    """Run podman with this machine's settings; with check, fail the test with its output if it fails."""
    env = podman_env(shm_size)
    result = subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout, env=env)
    if check and result.returncode != 0:
        output = result.stderr[-3000:] + result.stdout[-2000:]
        pytest.fail(f"podman {' '.join(args)} failed ({result.returncode}):\n{output}")
    return result


@functools.cache
def unavailable() -> str | None:
    """Why podman cannot run a container on this machine, or None when it can."""
    missing = [tool for tool in ("podman", "mmdebstrap") if shutil.which(tool) is None]  # runc: podman finds it
    if missing:
        return f"{', '.join(missing)} not installed (`make tools` installs them with apt, as root)"
    result = podman("run", "--rm", "--network", "host", base_image(), "true", check=False)
    if result.returncode != 0:
        return f"podman cannot run a container here: {result.stderr.strip()[-300:]}"
    return None


def require_podman() -> None:
    """Skip the test, printing why, where podman cannot run a container at all."""
    reason = unavailable()
    if reason:
        print(f"SKIPPED: {reason}", file=sys.stderr)
        pytest.skip(reason)


@functools.cache
def base_image() -> str:
    """A minimal Debian image made from Debian packages (mmdebstrap), reused while what makes it is the same."""
    recipe = ["--variant=minbase", f"--include={BASE_PACKAGES}", BASE_SUITE]
    tag = f"localhost/imgserve-base:{BASE_SUITE}-{hashlib.sha256(' '.join(recipe).encode()).hexdigest()[:12]}"
    if podman("image", "exists", tag, check=False).returncode != 0:
        with tempfile.TemporaryDirectory() as directory:
            rootfs = Path(directory) / "rootfs.tar"
            subprocess.run(
                ["mmdebstrap", "--quiet", *recipe, str(rootfs)], check=True, capture_output=True, timeout=300
            )
            podman("import", str(rootfs), tag, timeout=120)
    return tag


def pip_settings() -> dict[str, str]:
    """The host's pip settings that decide where packages come from (`pip config list`, environment included)."""
    listing = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    found: dict[str, tuple[int, str]] = {}
    for line in listing.splitlines():
        key, _, value = line.partition("=")
        scope, _, name = key.rpartition(".")
        rank = SCOPE_RANK.get(scope.split(".")[0] if scope != ":env:" else scope, -1)
        if name in PIP_SETTINGS and rank >= found.get(name, (-1, ""))[0]:
            found[name] = (rank, value.strip("'\""))
    return {name: value for name, (_, value) in found.items()}


def _local_path(location: str) -> Path | None:
    """The folder of a file:// URL or an absolute path, if it exists here; None for a remote index."""
    path = Path(urlsplit(location).path) if location.startswith("file://") else Path(location)
    return path if path.is_absolute() and path.exists() else None


def build_options() -> list[str]:
    """--build-arg and -v options that give the build the host's pip sources: remote ones as they are, local ones
    mounted at the same path (an index folder with its parent, where its pages link to), the CA bundle at HOST_CA.
    torch is the host's own build (its local version, e.g. +cpu, pins the CPU wheel)."""
    settings = pip_settings()
    options = [
        f"--build-arg=TORCH_VERSION={importlib.metadata.version('torch')}",
        f"--build-arg=TORCH_INDEX_URL={settings.get('index-url', 'https://pypi.org/simple')}",
    ]
    mounts: set[Path] = set()
    for name in ("index-url", "extra-index-url", "find-links"):
        if name in settings:
            options.append(f"--build-arg=PIP_{name.upper().replace('-', '_')}={settings[name]}")
            for location in settings[name].split():
                path = _local_path(location)
                if path is not None:
                    mounts.add(path if name == "find-links" else path.parent)
    if "cert" in settings and Path(settings["cert"]).exists():
        options += [f"--build-arg=PIP_CERT={HOST_CA}", f"--volume={settings['cert']}:{HOST_CA}:ro"]
    options += [f"--volume={path}:{path}:ro" for path in sorted(mounts)]
    return options


@functools.cache
def image() -> str:
    """The server image built from the repository's Dockerfile on the Debian base with CPU torch (podman's layer cache
    makes an unchanged rebuild quick)."""
    podman(
        "build",
        "--format=docker",  # the OCI format would drop SHELL and HEALTHCHECK
        "--network=host",
        f"--build-arg=BASE_IMAGE={base_image()}",
        *build_options(),
        f"--tag={IMAGE}",
        str(REPO),
        timeout=900,
    )
    return IMAGE


def processes(name: str) -> dict[int, tuple[int, str]]:
    """Every process in a container but the one asking: pid -> (uid, command line), read from its /proc."""
    script = (
        "import os\n"
        "for pid in set(filter(str.isdigit, os.listdir('/proc'))) - {str(os.getpid())}:\n"
        "    try:\n"
        "        uid = [l.split()[1] for l in open(f'/proc/{pid}/status') if l.startswith('Uid:')][0]\n"
        "        print(pid, uid, ' '.join(open(f'/proc/{pid}/cmdline').read().replace(chr(0), ' ').split()))\n"
        "    except OSError:\n"
        "        pass\n"
    )
    found = {}
    for line in podman("exec", name, "python", "-c", script).stdout.splitlines():
        pid, uid, command = [*line.split(" ", 2), ""][:3]
        found[int(pid)] = (int(uid), command)
    return found


@contextlib.contextmanager
def removed_after(name: str) -> Iterator[str]:
    """Remove the container `name` when the block ends, whatever happened."""
    try:
        yield name
    finally:
        podman("rm", "--force", "--time=0", name, check=False)
