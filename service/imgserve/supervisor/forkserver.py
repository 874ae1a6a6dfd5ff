"""Where the main process starts its inference workers: a fork server (multiprocessing's) that has imported torch and
the worker's modules once, so a worker's start or restart imports nothing again, and the workers share those pages.

The one seam over multiprocessing's internals: the fork server's `_forkserver_pid` and `_stop()`, which the server
needs to end the fork server with itself; its `_preload_modules`, given back as they were; the process's
`_config["tempdir"]`, multiprocessing's temporary directory, where the fork server's socket goes; and
`reduction.recvfds`, which the fork server reads a request with, and which worker/preload.py checks the requester of
(tests/unit/test_forkserver.py pins them).

A process has one fork server. Where the calling program already runs its own (Python 3.14 starts one for
multiprocessing's default start method), the server does not start: adopting it would fork workers from a process
that checks no requester and imported nothing, and ending it would take the program's own processes.

The fork server starts as the server does, before the main process imports torch itself, so the two imports overlap.
It dies with the main process (worker/preload.py), and the workers with it (lifetime.py); one that died is started
again at the next worker start, as multiprocessing does. Every worker's OpenMP threads wait passively
(OMP_WAIT_POLICY, which OpenMP reads when the fork server imports torch) unless the environment sets a policy: the
front ends share the cores. Its socket lives in the server's private directory in /dev/shm (0700, a short path, as a
socket's must be), which goes with the server; it forks for the main process only.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
from collections.abc import Iterator
from multiprocessing import forkserver
from multiprocessing.context import ForkServerContext
from pathlib import Path

PRELOADED = ["imgserve.worker.preload"]
FOREIGN = (
    "this program already runs multiprocessing's fork server, and imgserve starts its workers from one of its own: "
    "call serve() before starting processes with the forkserver method, or in a process of its own"
)


class ForeignForkServer(RuntimeError):
    """This process runs a fork server that is not the server's (FOREIGN): the server does not start."""


@contextlib.contextmanager
def running(private: Path) -> Iterator[None]:
    """The fork server, started now (it imports while the caller goes on) with its socket in `private`, and ended
    when the block ends, with any worker still alive: a later server starts its own, in its own environment.
    ForeignForkServer where this process runs a fork server already."""
    if pid() is not None:
        raise ForeignForkServer(FOREIGN)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    config = mp.current_process()._config  # type: ignore[attr-defined]
    before = config.get("tempdir")
    config["tempdir"] = str(private)  # multiprocessing's temporary files: the server's, removed with it
    preload_before = list(forkserver._forkserver._preload_modules)  # type: ignore[attr-defined]
    forkserver.set_forkserver_preload(PRELOADED)
    try:
        forkserver.ensure_running()
        yield
    finally:
        _stop()
        config["tempdir"] = before
        forkserver.set_forkserver_preload(preload_before)


def context() -> ForkServerContext:
    """The context a worker is started in."""
    return mp.get_context("forkserver")


def pid() -> int | None:
    """The fork server's process id, once started."""
    started: int | None = forkserver._forkserver._forkserver_pid  # type: ignore[attr-defined]
    return started


def _stop() -> None:
    """End the fork server at once (its workers die with it) and forget it."""
    started = pid()
    if started is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(started, signal.SIGKILL)
    forkserver._forkserver._stop()  # type: ignore[attr-defined]  # closes its pipe, reaps it, removes its socket
