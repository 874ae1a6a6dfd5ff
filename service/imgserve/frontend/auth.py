"""Authentication: API keys guard the inference routes (/predict, v2 HTTP infer, gRPC ModelInfer and its stream; and
/metrics, /info, /docs, /openapi.json and the v2 statistics if asked); health and metadata routes stay open.

A client sends `Authorization: Bearer <key>` or `X-API-Key: <key>`. Keys come from `api_key` (comma separated,
so an old and a new key work side by side while clients rotate) and `api_key_file` (one per line, e.g. a mounted
Kubernetes Secret). Every key is compared in constant time. Keys fail closed: a key source that is set but yields no
key stops the start (KeyProblem); a key file that later yields none keeps the keys in force. With no key source at
all, authentication is off.
"""

from __future__ import annotations

import hmac
import logging
import os
import stat
import threading
import time
from collections.abc import Iterable
from pathlib import Path

from starlette.types import ASGIApp, Receive, Scope, Send

from imgserve.config import Access
from imgserve.errors import ApiError
from imgserve.frontend.telemetry import DOCS_PATHS, INFER_ROUTES, V2_REPOSITORY, V2_STATS, route
from imgserve.metrics import API_KEY_RELOAD_FAILURES

MAX_KEY_FILE_BYTES = 64 * 1024
POLL_S = 1.0  # how often a front end re-reads the key file

log = logging.getLogger(__name__)


def guarded_routes(access: Access) -> set[str]:
    """The route labels (telemetry.route) that need a key when keys are configured: the inference routes and the
    model repository's (loads and unloads), and with protect_metrics what describes the server (/metrics, /info,
    /docs, /openapi.json, the v2 statistics)."""
    described = {"/metrics", "/info", V2_STATS, *DOCS_PATHS} if access.protect_metrics else set()
    return INFER_ROUTES | {V2_REPOSITORY} | described


class KeyProblem(ValueError):
    """A key source that is set but yields no key; its message names the flag and why, in one line."""


def parse_key_list(api_key: str) -> tuple[bytes, ...]:
    """The keys of `--api-key` (comma separated); KeyProblem when there is none."""
    keys = tuple(key.strip().encode() for key in api_key.split(",") if key.strip())
    if not keys:
        raise KeyProblem("--api-key holds no key (give one or more keys, comma separated, or leave it unset)")
    return keys


def read_key_file(path: str) -> tuple[bytes, ...]:
    """The keys of `--api-key-file` (one per line); KeyProblem when it holds none, cannot be read, is not a regular
    file or is larger than MAX_KEY_FILE_BYTES. A FIFO or device is never opened for reading: the path is checked to
    be a regular file, opened non-blocking and checked again on the open descriptor (fstat)."""
    flag = f"--api-key-file {path}"
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise KeyProblem(f"{flag} is not a regular file")
        with open(os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC), "rb") as file:
            facts = os.fstat(file.fileno())
            if not stat.S_ISREG(facts.st_mode):
                raise KeyProblem(f"{flag} is not a regular file")
            data = file.read(MAX_KEY_FILE_BYTES + 1) if facts.st_size <= MAX_KEY_FILE_BYTES else b""
    except OSError as exc:
        raise KeyProblem(f"cannot read {flag}: {exc.strerror or exc}") from exc
    if facts.st_size > MAX_KEY_FILE_BYTES or len(data) > MAX_KEY_FILE_BYTES:
        raise KeyProblem(f"{flag} is larger than 64 KiB")
    keys = tuple(key.strip() for key in data.splitlines() if key.strip())
    if not keys:
        raise KeyProblem(f"{flag} holds no key (one key per line)")
    return keys


def _file_identity(path: str) -> object:
    """What tells one state of the key file from another (a broken file is warned about once per state)."""
    try:
        facts = os.stat(path)
    except OSError as exc:
        return exc.errno
    return facts.st_dev, facts.st_ino, facts.st_mode, facts.st_size, facts.st_mtime_ns, facts.st_ctime_ns


class Keys:
    """The API keys in force in this process: `allow` is a cheap synchronous check, constant time per key.

    Built once in the main process (`load`: KeyProblem when a key source that is set yields no key) and inherited by
    every front end, which watches the key file from a daemon thread (`watch`), never on the event loop: every
    POLL_S it is re-read; a read that yields no key keeps the keys in force and is logged and counted once per state
    of the file. The last keys any front end read are kept in the server's private directory (`last_good`), so a
    front end started later, finding the file broken, starts from them rather than from the keys read at start."""

    def __init__(self, fixed: tuple[bytes, ...], path: str, last_good: Path | None) -> None:
        self.fixed, self.path, self.last_good = fixed, path, last_good
        self.keys = fixed + (read_key_file(path) if path else ())
        self.on = bool(self.keys)  # no key source at all: authentication is off
        self.broken: object = None  # the state of the file last warned about
        self._watcher: int | None = None  # the process whose thread watches the file
        self._remember(self.keys)

    @classmethod
    def load(cls, access: Access, last_good: Path | None = None) -> Keys:
        """The settings' keys; KeyProblem when a key source that is set yields none (`imgserve serve` exits 2)."""
        fixed = parse_key_list(access.api_key) if access.api_key is not None else ()
        return cls(fixed, access.api_key_file or "", last_good)

    def allow(self, given: bytes | None) -> bool:
        """Whether a request presenting `given` (None: no key) may pass."""
        if not self.on:
            return True
        if self._watcher != os.getpid():
            self.watch()
        # every key is compared, so the time taken does not tell which one nearly matched
        return given is not None and sum(hmac.compare_digest(given, key) for key in self.keys) > 0

    def watch(self) -> None:
        """Watch the key file from this process: a front end calls this as it starts, before it serves, and waits
        for the thread's first read (at most POLL_S, so a hung file system cannot hold it up)."""
        if self._watcher == os.getpid() or not self.path:
            return
        self._watcher = os.getpid()
        first_read = threading.Event()
        threading.Thread(target=self._poll, args=(first_read,), name="imgserve-api-keys", daemon=True).start()
        first_read.wait(POLL_S)

    def reload(self, first: bool = False) -> None:
        """Read the key file again; keep the keys in force if it yields none. The `first` read of a front end takes
        a broken file silently, with the last keys read (the front ends that saw it break have said so)."""
        try:
            keys = self.fixed + read_key_file(self.path)
        except KeyProblem as problem:
            state = (_file_identity(self.path), str(problem))
            if first:
                self.keys = self._last_good() or self.keys
            elif state != self.broken:
                API_KEY_RELOAD_FAILURES.inc()
                log.warning("%s; keeping the %d keys in force", problem, len(self.keys))
            self.broken = state
            return
        if keys != self.keys:
            self._remember(keys)  # before they are in force: a front end started next starts from them
        self.keys, self.broken = keys, None

    def _poll(self, first_read: threading.Event) -> None:
        self.reload(first=True)
        first_read.set()
        while True:
            time.sleep(POLL_S)
            self.reload()

    def _remember(self, keys: tuple[bytes, ...]) -> None:
        if self.last_good is None or not self.path:
            return
        spare = self.last_good.with_name(f"{self.last_good.name}.{os.getpid()}")
        spare.write_bytes(b"\n".join(keys) + b"\n")
        os.replace(spare, self.last_good)

    def _last_good(self) -> tuple[bytes, ...]:
        if self.last_good is None:
            return ()
        try:
            return read_key_file(str(self.last_good))
        except KeyProblem:
            return ()


class ApiKeyMiddleware:
    """401 with `WWW-Authenticate: Bearer` for a guarded route without a valid key."""

    def __init__(self, app: ASGIApp, access: Access, keys: Keys) -> None:
        self.app, self.keys = app, keys
        self.keys.watch()  # built by the front end as it starts, before it serves
        self.guarded = guarded_routes(access)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or route(scope["path"]) not in self.guarded or self._allowed(scope):
            return await self.app(scope, receive, send)
        error = ApiError(401, "unauthorized", "send a valid API key: Authorization: Bearer <key> or X-API-Key")
        response = error.response(scope["path"])
        response.headers["WWW-Authenticate"] = "Bearer"
        await response(scope, receive, send)

    def _allowed(self, scope: Scope) -> bool:
        return self.keys.allow(presented_key(scope["headers"]))


def presented_key(headers: Iterable[tuple[bytes, bytes]]) -> bytes | None:
    """The key in `Authorization: Bearer <key>` or `X-API-Key: <key>` (gRPC metadata has the same names)."""
    for name, value in headers:
        if name == b"authorization":
            scheme, _, token = value.partition(b" ")
            if scheme.lower() == b"bearer":
                return token.strip()
        elif name == b"x-api-key":
            return value.strip()
    return None
