"""The server's own directories: one in /dev/shm (request slots, shared weights, metrics files, the hand-off
sockets), one in the temporary directory (what the server's processes write as temporary files).

Each is made by `tempfile.mkdtemp` (an unpredictable name, mode 0700: no other user can read it, plant a file in it or
reach its sockets), held by an exclusive `flock` on its lock file for as long as the server's main process lives, and
removed when the server stops. While the server runs, TMPDIR names the second (`temporary_files`), so that what its
processes and libraries leave there (torch extracts each load of an AOTInductor package, a shared object with the
weights inside, into a folder of its own, and a stopped worker never removes it) goes with the server instead of
filling /tmp one worker start after another. A server that was killed leaves its directories behind; the next server
removes those whose lock nobody holds: only directories of its own user, never a symlink, never a live server's (a
lock is seen across PID namespaces that share /dev/shm, where a PID is not).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import stat
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

SHM_ROOT = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
PREFIX = "imgserve-"
SCRATCH_PREFIX = "imgserve-scratch-"  # in the temporary directory, where a user's own imgserve-* folders may lie
LOCK = ".lock"
UNLOCKED_GRACE_S = 60.0  # a directory with no lock file yet may be a server's that is being made right now


class ServerDirectory:
    """One server's private directories: made and locked by `create`, removed by `remove`."""

    def __init__(self, root: Path, scratch: Path, lock_fds: list[int]) -> None:
        self.root, self.scratch, self._lock_fds = root, scratch, lock_fds
        self.slots, self.weights, self.metrics = root / "slots", root / "weights", root / "metrics"

    @classmethod
    def create(cls, parent: Path | None = None, scratch_parent: Path | None = None) -> ServerDirectory:
        """Fresh, locked directories under `parent` (/dev/shm) and `scratch_parent` (the temporary directory); stale
        ones of this user are removed first."""
        root, lock_fd = _locked_directory(parent or SHM_ROOT, PREFIX)
        for directory in ("slots", "weights", "metrics"):
            (root / directory).mkdir(mode=0o700)
        scratch, scratch_lock_fd = _locked_directory(scratch_parent or Path(tempfile.gettempdir()), SCRATCH_PREFIX)
        return cls(root, scratch, [lock_fd, scratch_lock_fd])

    @contextlib.contextmanager
    def temporary_files(self) -> Iterator[None]:
        """TMPDIR (and Python's tempfile) naming the scratch directory until the block ends: the children started in
        it inherit it. The caller's own settings are back afterwards."""
        before, cached = os.environ.get("TMPDIR"), tempfile.tempdir
        os.environ["TMPDIR"], tempfile.tempdir = str(self.scratch), None
        try:
            yield
        finally:
            if before is None:
                os.environ.pop("TMPDIR", None)
            else:
                os.environ["TMPDIR"] = before
            tempfile.tempdir = cached

    def remove(self) -> None:
        """Free every file in them (at shutdown, in the main process, once the workers have stopped)."""
        for path in (self.root, self.scratch):
            shutil.rmtree(path, ignore_errors=True)
        for lock_fd in self._lock_fds:
            with contextlib.suppress(OSError):
                os.close(lock_fd)


def _locked_directory(parent: Path, prefix: str) -> tuple[Path, int]:
    """A fresh directory `prefix`<random> under `parent` and its held lock, once the stale ones there are gone."""
    remove_stale(parent, prefix)
    root = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    lock_fd = os.open(root / LOCK, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    fcntl.flock(lock_fd, fcntl.LOCK_EX)
    return root, lock_fd


def remove_stale(parent: Path, prefix: str = PREFIX) -> None:
    """Remove the directories named `prefix`... that servers of this user left behind: those whose lock no process
    holds."""
    for entry in os.scandir(parent):
        if entry.name.startswith(prefix) and _stale(Path(entry.path)):
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
