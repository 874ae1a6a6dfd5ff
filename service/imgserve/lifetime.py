"""A child process of the server never outlives the main process: the rule every front end and worker follows.

The kernel kills the child the moment its parent dies (Linux `PR_SET_PDEATHSIG`), however the parent died: kill -9,
the OOM killer, a crash. A front end's parent is the main process; a worker's is the fork server the main process
started (supervisor/forkserver.py), which ends once the main process and its front ends are gone. Each forks its
children from its main thread, which lives as long as the process, so the signal means the process is gone. A parent
that died before the child asked is caught by the check that follows.
"""

from __future__ import annotations

import ctypes
import os
import signal
from pathlib import Path

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(main_pid: int) -> None:
    """In a child, at its start: be killed when its parent dies; exit now if it has, that is when its parent is
    neither `main_pid` (the server's main process) nor a child of it."""
    libc = ctypes.CDLL(None, use_errno=True)  # the C library the interpreter runs on
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    parent = os.getppid()
    if main_pid not in (parent, _parent_of(parent)):
        os._exit(1)


def _parent_of(pid: int) -> int:
    """The parent of process `pid` (0 when it is gone): the field after the parenthesised command in /proc/pid/stat."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])
    except (OSError, IndexError, ValueError):
        return 0
