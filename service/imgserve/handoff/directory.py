"""The server's own directory in /dev/shm: request slots, shared weights, metrics files and the hand-off sockets.

It is made by `tempfile.mkdtemp` (an unpredictable name, mode 0700: no other user can read it, plant a file in it or
reach its sockets), held by an exclusive `flock` on its lock file for as long as the server's main process lives, and
removed when the server stops. A server that was killed leaves its directory behind; the next server removes
those whose lock nobody holds: only directories of its own user, never a symlink, never a live server's (a lock is
seen across PID namespaces that share /dev/shm, where a PID is not).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import stat
import tempfile
import time
from pathlib import Path

SHM_ROOT = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
PREFIX = "imgserve-"
LOCK = ".lock"
UNLOCKED_GRACE_S = 60.0  # a directory with no lock file yet may be a server's that is being made right now


class ServerDirectory:
    """One server's private directory: made and locked by `create`, removed by `remove`."""

    def __init__(self, root: Path, lock_fd: int) -> None:
        self.root, self._lock_fd = root, lock_fd
        self.slots, self.weights, self.metrics = root / "slots", root / "weights", root / "metrics"

    @classmethod
    def create(cls, parent: Path | None = None) -> ServerDirectory:
        """A fresh, locked directory under `parent` (/dev/shm); stale ones of this user are removed first."""
        parent = parent or SHM_ROOT
        remove_stale(parent)
        root = Path(tempfile.mkdtemp(prefix=PREFIX, dir=parent))
        lock_fd = os.open(root / LOCK, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        fcntl.flock(lock_fd, fcntl.LOCK_EX)
        for directory in ("slots", "weights", "metrics"):
            (root / directory).mkdir(mode=0o700)
        return cls(root, lock_fd)

    def remove(self) -> None:
        """Free every file in it (at shutdown, in the main process, once the workers have stopped)."""
        shutil.rmtree(self.root, ignore_errors=True)
        with contextlib.suppress(OSError):
            os.close(self._lock_fd)


def remove_stale(parent: Path) -> None:
    """Remove the directories that servers of this user left behind: those whose lock no process holds."""
    for entry in os.scandir(parent):
        if entry.name.startswith(PREFIX) and _stale(Path(entry.path)):
            shutil.rmtree(entry.path, ignore_errors=True)  # rmtree never follows a symlink inside it


def _stale(path: Path) -> bool:
    try:
        facts = path.lstat()
    except OSError:
        return False
    if not stat.S_ISDIR(facts.st_mode) or facts.st_uid != os.getuid():  # lstat: a symlink is not a directory
        return False
    try:
        lock_fd = os.open(path / LOCK, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:  # being made, or left by a server killed while making it
        return time.time() - facts.st_mtime > UNLOCKED_GRACE_S
    except OSError:
        return False
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False  # a live server holds it
    finally:
        os.close(lock_fd)
    return True
