"""The fork server the workers start from (supervisor/forkserver.py), through the multiprocessing internals its seam
pins: a process started from it is its child, with torch already imported and OpenMP told to wait passively; its
socket is in the directory it was given, and a request there from any process but ours is dropped while the fork
server goes on (worker/preload.py); and the block's end takes the fork server and its children (which die with it,
lifetime.py) with it, and gives multiprocessing its temporary directory back."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import subprocess
import sys
import time
from multiprocessing import forkserver as mp_forkserver
from multiprocessing.connection import Connection

import psutil

from imgserve.lifetime import die_with_parent
from imgserve.supervisor import forkserver


def report(main_pid: int, writer: Connection) -> None:
    """In a child of the fork server, as a worker: the rule of lifetime.py, what it started with, then wait to be
    taken down."""
    die_with_parent(main_pid)
    facts = {
        "parent": os.getppid(),
        "preloaded": "torch" in sys.modules and "imgserve.worker.process" in sys.modules,
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
    }
    writer.send_bytes(json.dumps(facts).encode())
    time.sleep(120)


NEIGHBOUR = """
import socket, sys
with socket.socket(socket.AF_UNIX) as sock:
    sock.connect(sys.argv[1])
    try:
        sock.sendall(b"not a fork request")
    except (BrokenPipeError, ConnectionResetError):  # dropped, unread, before it was all sent
        pass
"""


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_a_child_of_the_fork_server_starts_imported_and_goes_with_the_block(tmp_path) -> None:
    tempdir_before = mp.current_process()._config.get("tempdir")
    preload_before = list(mp_forkserver._forkserver._preload_modules)
    with forkserver.running(tmp_path):
        server = forkserver.pid()
        assert server is not None and psutil.Process(server).ppid() == os.getpid()
        reader, writer = forkserver.context().Pipe(duplex=False)
        child = forkserver.context().Process(target=report, args=(os.getpid(), writer), daemon=True)
        child.start()
        writer.close()
        assert reader.poll(120), "the child said nothing"
        facts = json.loads(reader.recv_bytes())
        assert facts == {"parent": server, "preloaded": True, "omp_wait_policy": os.environ["OMP_WAIT_POLICY"]}
        [listener] = tmp_path.iterdir()
        assert listener.name.startswith("listener-")
        subprocess.run([sys.executable, "-c", NEIGHBOUR, str(listener)], check=True, timeout=30)
        second = forkserver.context().Process(target=time.sleep, args=(0,))
        second.start()
        second.join(30)
        assert second.exitcode == 0 and not gone(server), "a neighbour's request stopped the fork server"
    deadline = time.monotonic() + 10
    while not (gone(server) and gone(child.pid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert gone(server) and gone(child.pid), "the fork server or its child outlived the block"
    assert list(tmp_path.iterdir()) == [] and forkserver.pid() is None
    assert mp.current_process()._config.get("tempdir") == tempdir_before
    assert mp_forkserver._forkserver._preload_modules == preload_before


PROGRAM_WITH_ITS_OWN = """
import multiprocessing as mp, os, time
from multiprocessing import forkserver

child = mp.get_context("forkserver").Process(target=time.sleep, args=(0,))
child.start()
child.join()
own = forkserver._forkserver._forkserver_pid
import imgserve
from imgserve.testing import free_port

code = imgserve.serve(port=free_port())
os.kill(own, 0)  # its fork server lives on
print(code, forkserver._forkserver._forkserver_pid == own)
"""


def test_a_program_that_runs_its_own_fork_server_is_told_in_one_line_and_keeps_it(tmp_path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", PROGRAM_WITH_ITS_OWN], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["2", "True"]
    assert done.stderr.strip() == f"imgserve: {forkserver.FOREIGN}"
