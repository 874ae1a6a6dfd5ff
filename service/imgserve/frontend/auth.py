"""Authentication: API keys guard the inference routes (/predict, v2 HTTP infer, gRPC ModelInfer; and /metrics,
/info if asked); health and metadata routes stay open.

A client sends `Authorization: Bearer <key>` or `X-API-Key: <key>`. Keys come from `api_key` (comma separated,
so an old and a new key work side by side while clients rotate) and `api_key_file` (one per line, e.g. a mounted
Kubernetes Secret; re-read when the file changes). Every key is compared in constant time.
"""

from __future__ import annotations

import contextlib
import hmac
import os
import time
from collections.abc import Iterable

from imgserve.config import Settings
from imgserve.errors import ApiError
from imgserve.metrics import INFER_ROUTES, route
from starlette.types import ASGIApp, Receive, Scope, Send

FILE_CHECK_S = 5.0  # how often the key file's modification time is looked at


def read_keys(settings: Settings) -> list[bytes]:
    """Every key the settings name (empty: authentication is off)."""
    keys = (settings.api_key or "").split(",")
    if settings.api_key_file:
        with open(settings.api_key_file, encoding="utf-8") as lines:
            keys += lines.read().splitlines()
    return [key.strip().encode() for key in keys if key.strip()]


class Keys:
    """The API keys in force: checked in constant time, re-read when the key file changes (a rotated Secret)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.keys = read_keys(settings)
        self._file_mtime, self._file_checked = self._mtime(), time.monotonic()

    def allow(self, given: bytes | None) -> bool:
        """Whether a request presenting `given` (None: no key) may pass."""
        keys = self._current_keys()
        if not keys:
            return True
        # every key is compared, so the time taken does not tell which one nearly matched
        return given is not None and sum(hmac.compare_digest(given, key) for key in keys) > 0

    def _current_keys(self) -> list[bytes]:
        """The keys, re-read at most every FILE_CHECK_S when the key file changed."""
        now = time.monotonic()
        if self.settings.api_key_file and now - self._file_checked > FILE_CHECK_S:
            self._file_checked, mtime = now, self._mtime()
            if mtime != self._file_mtime:
                self._file_mtime = mtime
                with contextlib.suppress(OSError):  # a Secret being swapped: keep the keys we have
                    self.keys = read_keys(self.settings)
        return self.keys

    def _mtime(self) -> float | None:
        try:
            return os.stat(self.settings.api_key_file).st_mtime if self.settings.api_key_file else None
        except OSError:
            return None


class ApiKeyMiddleware:
    """401 with `WWW-Authenticate: Bearer` for a guarded route without a valid key."""

    def __init__(self, app: ASGIApp, settings: Settings) -> None:
        self.app, self.keys = app, Keys(settings)
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
