"""An OTLP/HTTP trace sink on 127.0.0.1 for the runs that measure what tracing costs: it answers every export 200
and counts what came (requests and bytes), without decoding it, so the server's exporter works as it would against a
collector and the sink costs the machine little. (The tests' receiver, which decodes the spans: tests/support/otlp.py.)
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass
class Received:
    exports: int = 0
    bytes: int = 0


@contextlib.contextmanager
def otlp_sink() -> Iterator[tuple[str, Received]]:
    """(the endpoint for OTEL_EXPORTER_OTLP_ENDPOINT, what it received so far) until the block ends."""
    received, lock = Received(), threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # the exporter keeps its connection

        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            size = len(self.rfile.read(int(self.headers.get("Content-Length", 0))))
            with lock:
                received.exports += 1
                received.bytes += size
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", received
    finally:
        server.shutdown()
        server.server_close()
