"""A child process of the server never outlives the main process: the rule every front end and worker follows.

The kernel kills the child the moment its parent dies (Linux `PR_SET_PDEATHSIG`), however the parent died: kill -9,
the OOM killer, a crash. The main process starts its children from its main thread, which lives as long as the
process, so the signal means the process is gone. A parent that died before the child asked is caught by the
check that follows.
"""

from __future__ import annotations

import ctypes
import os
import signal

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(parent_pid: int) -> None:
    """In a child, at its start: be killed when `parent_pid` (the server's main process) dies; exit now if it has."""
    libc = ctypes.CDLL(None, use_errno=True)  # the C library the interpreter runs on
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent_pid:
        os._exit(1)
