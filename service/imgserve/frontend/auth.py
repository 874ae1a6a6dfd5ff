"""Authentication: API keys guard the inference routes (/predict, v2 HTTP infer, gRPC ModelInfer; and /metrics,
/info if asked); health and metadata routes stay open.

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

from imgserve.config import Settings
from imgserve.errors import ApiError
from imgserve.metrics import API_KEY_RELOAD_FAILURES, INFER_ROUTES, route
from starlette.types import ASGIApp, Receive, Scope, Send

MAX_KEY_FILE_BYTES = 64 * 1024
POLL_S = 1.0  # how often a front end re-reads the key file

log = logging.getLogger(__name__)


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


class KeySource:
    """The keys of one `api_key` / `api_key_file` pair in this process. The file is re-read every POLL_S by a daemon
    thread, never on the event loop; a read that yields no key keeps the keys in force, and a front end logs one
    warning and counts one API_KEY_RELOAD_FAILURES per state of the file. The main process watches the file quietly,
    so a front end forked later starts from the latest keys, then watches the file itself."""

    def __init__(self, api_key: str | None, api_key_file: str | None) -> None:
        self.fixed = parse_key_list(api_key) if api_key is not None else ()
        self.path = api_key_file or ""
        self.keys = self.fixed + (read_key_file(api_key_file) if api_key_file else ())
        self.broken: object = None  # the state of the file last warned about
        self.pid: int | None = None  # the process whose thread watches the file
        self.report = True  # log and count a broken file (the front ends; not the main process)
        self._lock = threading.Lock()

    def watch(self, report: bool = True) -> None:
        """Watch the key file from this process, from a daemon thread. A front end calls this as it starts, before it
        serves, and waits for the thread's first read (at most POLL_S, so a hung file system cannot hold it up)."""
        with self._lock:
            if self.pid == os.getpid():
                return
            self.pid, self.report = os.getpid(), report
            if self.path:
                first_read = threading.Event()
                threading.Thread(target=self._poll, args=(first_read,), name="imgserve-api-keys", daemon=True).start()
                first_read.wait(POLL_S)

    def reload(self) -> None:
        """Read the key file again; keep the keys in force if it yields none."""
        try:
            keys = self.fixed + read_key_file(self.path)
        except KeyProblem as problem:
            state = (_file_identity(self.path), str(problem))
            if state != self.broken and self.report:
                API_KEY_RELOAD_FAILURES.inc()
                log.warning("%s; keeping the %d keys in force", problem, len(self.keys))
            self.broken = state
            return
        self.keys, self.broken = keys, None

    def _poll(self, first_read: threading.Event) -> None:
        while True:
            self.reload()
            first_read.set()
            time.sleep(POLL_S)


_sources: dict[tuple[str | None, str | None], KeySource] = {}


def key_source(settings: Settings) -> KeySource | None:
    """This process's KeySource for the settings' keys (None: no key source is set, authentication is off).
    Raises KeyProblem when a source that is set yields no key; `imgserve serve` checks this at start."""
    if settings.api_key is None and not settings.api_key_file:
        return None
    name = (settings.api_key, settings.api_key_file)
    if name not in _sources:
        _sources[name] = KeySource(*name)
    return _sources[name]


class Keys:
    """The API keys in force, for one guard (HTTP middleware, gRPC servicer): `allow` is a cheap synchronous check,
    constant time per key; the key file is watched by a thread of the process that calls it."""

    def __init__(self, settings: Settings) -> None:
        self.source = key_source(settings)

    def watch(self) -> None:
        """Start watching the key file from this process (otherwise the first `allow` does)."""
        if self.source is not None:
            self.source.watch()

    def allow(self, given: bytes | None) -> bool:
        """Whether a request presenting `given` (None: no key) may pass."""
        source = self.source
        if source is None:
            return True
        if source.pid != os.getpid():
            source.watch()
        # every key is compared, so the time taken does not tell which one nearly matched
        return given is not None and sum(hmac.compare_digest(given, key) for key in source.keys) > 0


class ApiKeyMiddleware:
    """401 with `WWW-Authenticate: Bearer` for a guarded route without a valid key."""

    def __init__(self, app: ASGIApp, settings: Settings) -> None:
        self.app, self.keys = app, Keys(settings)
        self.keys.watch()  # built by the front end as it starts, before it serves
        self.guarded = INFER_ROUTES | ({"/metrics", "/info"} if settings.protect_metrics else set())

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
