"""Other local processes against a real server: another user cannot reach the hand-off sockets at all, and what the
server's own user sends them (pickles, garbage, oversized datagrams) is dropped: nothing runs, nothing dies, the
server keeps answering. The attack is tests/data/neighbour_attack.py, run under the system's Python."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
import psutil
import pytest
from serving import SOURCE, TESTS, Server, image_bytes, running_server

from imgserve.testing import free_port

ATTACK = TESTS / "data" / "neighbour_attack.py"
NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
PNG = {"Content-Type": "image/png"}
SYSTEM_PYTHON = "/usr/bin/python3" if Path("/usr/bin/python3").exists() else sys.executable


def attack(marker: Path, as_another_user: bool) -> dict[str, list[str]]:
    """Run the attack; {socket name: what its sends did}."""
    command = [SYSTEM_PYTHON, "-"]  # the script comes on stdin: another user may not read this checkout
    if as_another_user:
        command = NOBODY + command
    done = subprocess.run(
        [*command, str(marker)], input=ATTACK.read_text(), capture_output=True, text=True, timeout=60, check=True
    )
    return json.loads(done.stdout)


@pytest.mark.parametrize("as_another_user", [True, False], ids=["another user", "the server's own user"])
def test_what_a_neighbour_sends_the_sockets_runs_nothing_and_stops_nothing(tmp_path: Path, as_another_user) -> None:
    if as_another_user and (os.getuid() != 0 or not shutil.which("setpriv")):
        pytest.skip("becoming another user needs root and setpriv")
    marker = tmp_path / "marker"
    os.chmod(tmp_path, 0o777)  # an unpickled payload could write its marker here, whoever runs it
    with running_server(tmp_path) as server:
        before = server.descendants()
        results = attack(marker, as_another_user)
        assert len(results) >= 2, f"the attack found too few of the server's sockets: {results}"
        if as_another_user:
            reached = [name for name, outcomes in results.items() if "sent" in outcomes]
            assert not reached, f"another user could send to {reached}"
        else:
            assert all("sent" in outcomes for outcomes in results.values()), results
        for _ in range(6):
            answer = httpx.post(f"{server.url}/predict", content=image_bytes(32, 32), headers=PNG, timeout=30)
            assert answer.status_code == 200, answer.text
        assert httpx.get(f"{server.url}/health/ready", timeout=5).status_code == 200
        assert server.descendants() == before, "a process of the server died"
    assert not marker.exists(), "a pickle from a neighbour ran in the server"
    assert "Traceback" not in server.log()


def _entries_of(server: Server) -> list[Path]:
    """What the server made in the shared temporary roots: its private directory, and anything named by its pid."""
    roots = [Path(tempfile.gettempdir()), Path("/dev/shm")]
    named = [entry for root in roots if root.is_dir() for entry in root.glob(f"imgserve*{server.process.pid}*")]
    opened = [Path(f.path).parent for f in psutil.Process(server.process.pid).open_files() if "imgserve-" in f.path]
    return sorted({*named, *(path for path in opened if path.parent in roots)})


def test_the_server_makes_only_private_directories_and_removes_them_at_exit(tmp_path: Path) -> None:
    with running_server(tmp_path) as server:
        made = _entries_of(server)
        assert made, "the server's private directory was not found"
        for path in made:
            facts = path.lstat()
            assert stat.S_ISDIR(facts.st_mode) and facts.st_uid == os.getuid(), path
            assert stat.S_IMODE(facts.st_mode) == 0o700, f"{path} is {oct(facts.st_mode)}"
    left = [path for path in made if os.path.lexists(path)]
    assert not left, f"left behind: {left}"


def test_a_metrics_directory_others_can_write_stops_the_start_in_one_line(tmp_path: Path) -> None:
    shared = tmp_path / "metrics"
    shared.mkdir()
    shared.chmod(0o777)
    env = {key: value for key, value in os.environ.items() if not key.startswith("IMGSERVE_")}
    env |= {"PROMETHEUS_MULTIPROC_DIR": str(shared), "PYTHONPATH": str(SOURCE)}
    done = subprocess.run(
        [sys.executable, "-m", "imgserve", "serve", "--port", str(free_port())],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "PROMETHEUS_MULTIPROC_DIR" in done.stderr and "Traceback" not in done.stderr
