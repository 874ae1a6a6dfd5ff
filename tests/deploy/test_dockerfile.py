"""The Dockerfile, without a Docker engine: hadolint and checkov lint it, and its instructions are checked against
what the chart and the package expect (CUDA/torch match, layer order, user, init, port, build context)."""

from __future__ import annotations

import functools
import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml
from serving import REPO
from tools import tool

from imgserve.config import Settings

DOCKERFILE = REPO / "Dockerfile"
DOCKERIGNORE = REPO / ".dockerignore"
CHART_VALUES = REPO / "charts" / "imgserve" / "values.yaml"

Instruction = tuple[str, str]


@functools.cache
def instructions() -> list[Instruction]:
    """(INSTRUCTION, arguments) of the Dockerfile, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    found = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            found.append((keyword.upper(), " ".join(rest.split())))
    return found


def positions(keyword: str) -> list[int]:
    """Indexes of the instructions with one keyword."""
    return [i for i, (k, _) in enumerate(instructions()) if k == keyword]


def argument(keyword: str) -> str:
    """The arguments of the last instruction with one keyword."""
    return instructions()[positions(keyword)[-1]][1]


def chart_values() -> dict:
    """The chart's default values."""
    return yaml.safe_load(CHART_VALUES.read_text())


@pytest.mark.parametrize("dockerfile", [DOCKERFILE, REPO / "examples" / "Dockerfile"], ids=["imgserve", "a user's API"])
def test_hadolint_clean(dockerfile: Path) -> None:
    """hadolint reports nothing, for the image and for the documented image of a user's API FROM it (the one ignore
    in the file carries its reason)."""
    result = subprocess.run([tool("hadolint"), "-f", "json", str(dockerfile)], capture_output=True, text=True)
    assert json.loads(result.stdout or "[]") == [], result.stdout
    assert result.returncode == 0, result.stderr


def test_hadolint_is_really_checking(tmp_path: Path) -> None:
    """The same invocation flags a known-bad Dockerfile, so a clean report means something."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu:latest\nRUN apt-get install -y curl\n")
    result = subprocess.run([tool("hadolint"), "-f", "json", str(bad)], capture_output=True, text=True)
    codes = {finding["code"] for finding in json.loads(result.stdout)}
    assert {"DL3007", "DL3008", "DL3015"} <= codes, codes  # latest tag, unpinned apt, recommends


def test_checkov_clean() -> None:
    """checkov's Dockerfile checks (USER, HEALTHCHECK, no latest, ...) all pass."""
    result = subprocess.run(
        [tool("checkov"), "-f", str(DOCKERFILE), "--framework", "dockerfile", "-o", "json", "--skip-download"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    summary = json.loads(result.stdout)["summary"]
    assert summary["failed"] == 0 and summary["passed"] > 0, result.stdout


def test_cuda_base_matches_torch_index() -> None:
    """A CUDA runtime (cuDNN) base, and torch pinned from the PyTorch index built for that same CUDA release."""
    assert argument("FROM") == "${BASE_IMAGE}"
    args = build_args()
    match = re.fullmatch(r"nvidia/cuda:(\d+)\.(\d+)\.\d+-cudnn-runtime-ubuntu\d+\.\d+", args["BASE_IMAGE"])
    assert match, args["BASE_IMAGE"]
    assert args["TORCH_INDEX_URL"] == f"https://download.pytorch.org/whl/cu{match.group(1)}{match.group(2)}"
    assert re.fullmatch(r"\d+\.\d+\.\d+", args["TORCH_VERSION"])
    torch = '"torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"'
    assert any(torch in a for k, a in instructions() if k == "RUN")


def build_args() -> dict[str, str | None]:
    """ARG name -> its default (None where it has none)."""
    found: dict[str, str | None] = {}
    for keyword, rest in instructions():
        if keyword == "ARG":
            name, has_default, default = rest.partition("=")
            found[name] = default if has_default else None
    return found


def test_pip_settings_pass_through_as_build_arguments() -> None:
    """pip reads PIP_* from the environment, where build arguments are during RUN (and are not kept in the image):
    declared in the stage, after FROM, with no default, so a build that passes none runs pip as before. The base
    is an argument before FROM."""
    stage = positions("FROM")[-1]
    declared = {rest.partition("=")[0]: i for i, (keyword, rest) in enumerate(instructions()) if keyword == "ARG"}
    assert declared["BASE_IMAGE"] < stage
    for name in ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS", "PIP_CERT"):
        assert declared.get(name, -1) > stage and build_args()[name] is None, name


def test_dependencies_before_code() -> None:
    """pyproject.toml is copied and its dependencies installed before the code is copied (layer caching)."""
    copies = {a: i for i, (k, a) in enumerate(instructions()) if k == "COPY"}
    deps = next(i for i, (k, a) in enumerate(instructions()) if k == "RUN" and "pip install -r" in a)
    code = next(i for a, i in copies.items() if a.startswith("service "))
    assert copies["pyproject.toml ./"] < deps < code
    install = next(a for k, a in instructions()[code:] if k == "RUN")
    assert "pip install --no-deps ." in install


def test_runs_as_the_charts_non_root_user() -> None:
    """USER is numeric, non-root, set after every RUN, and the uid the chart's securityContext asks for."""
    user = argument("USER")
    uid, _, gid = user.partition(":")
    assert uid.isdigit() and int(uid) > 0
    assert positions("USER")[-1] > positions("RUN")[-1]
    context = chart_values()["securityContext"]
    assert (int(uid), int(gid)) == (context["runAsUser"], context["runAsGroup"])


def test_init_forwards_sigterm_to_the_server_only() -> None:
    """tini is PID 1 without -g (imgserve coordinates its workers); CMD is what the chart runs."""
    entrypoint = json.loads(argument("ENTRYPOINT"))
    assert entrypoint == ["/usr/bin/tini", "--"]
    assert "-g" not in entrypoint
    assert json.loads(argument("CMD")) == ["imgserve", "serve"]
    assert any("tini" in a for k, a in instructions() if k == "RUN")


def test_port_and_healthcheck() -> None:
    """EXPOSE is the chart's containerPort and grpcPort (the server's defaults); HEALTHCHECK asks /health/live on
    loopback."""
    values = chart_values()
    assert argument("EXPOSE").split() == [str(values["containerPort"]), str(values["grpcPort"])]
    assert values["grpcPort"] == Settings().grpc_port
    check = argument("HEALTHCHECK")
    assert "/health/live" in check and "http://127.0.0.1:" in check
    assert re.search(r"--start-period=\d+s", check)


def pattern_regex(pattern: str) -> re.Pattern[str]:
    """A .dockerignore pattern as a regex: `**/` spans directories, `*` and `?` stay inside one."""
    out = re.escape(pattern.strip("/")).replace(r"\*\*/", "(.*/)?").replace(r"\*", "[^/]*").replace(r"\?", "[^/]")
    return re.compile(out)


def ignored(path: str, rules: list[str]) -> bool:
    """Whether .dockerignore rules keep a path out of the build context, as Docker decides it: the last matching rule
    wins, and a rule that matches a parent directory covers what is inside it."""
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    excluded = False
    for rule in rules:
        regex = pattern_regex(rule.removeprefix("!"))
        if any(regex.fullmatch(prefix) for prefix in prefixes):
            excluded = not rule.startswith("!")
    return excluded


def test_build_context() -> None:
    """The context holds the package with the built-in model's weights, and none of .git, .venv, tests or charts."""
    rules = [r.strip() for r in DOCKERIGNORE.read_text().splitlines() if r.strip() and not r.startswith("#")]
    weights = [p.relative_to(REPO).as_posix() for p in (REPO / "service").rglob("*.safetensors")]
    assert weights, "the built-in model's weights are missing from service/"
    for kept in ["pyproject.toml", "README.md", "service/imgserve/cli.py", *weights]:
        assert not ignored(kept, rules), kept
    for dropped in [".git/HEAD", ".venv/bin/python", "tests/deploy/test_chart.py", "charts/imgserve/values.yaml",
                    "service/imgserve/__pycache__/cli.cpython-311.pyc", ".tools/bin/helm"]:  # fmt: skip
        assert ignored(dropped, rules), dropped
    copied = {a.split()[0] for k, a in instructions() if k == "COPY"}
    assert all(not ignored(source, rules) for source in copied), copied
