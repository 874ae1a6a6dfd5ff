"""Imported by the fork server the workers are started from (supervisor/forkserver.py), and by nothing else. In that
process, before it serves: it dies with the main process, its parent; it forks only for the main process; then it
imports the worker's modules, torch among them, once for every worker it will start, and freezes them out of the
garbage collector's reach.

The fork server forks whoever connects to its socket and runs what they send, and Python before 3.14 checks nothing
but the socket's file mode: a process of the server's own user could have its pickle run. So each connection's peer
(the kernel's SO_PEERCRED) must be the main process; any other is dropped unread, as multiprocessing drops an aborted
connection, and the fork server goes on. Should the main process die before this runs, the fork server ends on its
own: the main process held the only other end of its "alive" pipe.
"""

from __future__ import annotations

import errno
import gc
import os
import socket
import struct
from collections.abc import Callable
from multiprocessing import reduction
from typing import Any

from imgserve.lifetime import die_with_parent

PEER_CREDENTIALS = struct.Struct("3i")  # struct ucred: pid, uid, gid


def from_main_only(receive: Callable[..., Any], main_pid: int, fork_server_pid: int) -> Callable[..., Any]:
    """multiprocessing's `recvfds`, which the fork server reads each request with, for connections of `main_pid`
    only (in the fork server's own process; its children keep the original)."""

    def checked(sock: socket.socket, size: int) -> Any:
        if os.getpid() == fork_server_pid:
            peer, _, _ = PEER_CREDENTIALS.unpack(
                sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, PEER_CREDENTIALS.size)
            )
            if peer != main_pid:
                raise ConnectionAbortedError(errno.ECONNABORTED, f"a fork request from process {peer}")
        return receive(sock, size)

    return checked


MAIN_PID = os.getppid()
die_with_parent(MAIN_PID)
reduction.recvfds = from_main_only(reduction.recvfds, MAIN_PID, os.getpid())

import imgserve.worker.process  # noqa: E402, F401  # the worker's modules and torch, once the rules above hold

# A forked worker shares these objects until it writes to their pages, and a full garbage collection writes to every
# object it traverses: the fork server collects once and freezes what is left, so no worker's collector touches them.
gc.collect()
gc.freeze()
