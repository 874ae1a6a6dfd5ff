"""HTTP over raw sockets, for the tests that play a hostile or broken client."""

from __future__ import annotations

import json
import socket
import time
from dataclasses import dataclass

from serving import Server


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes

    @property
    def code(self) -> str:
        """The error envelope's code (fails the test if the body is not the envelope)."""
        assert self.headers["content-type"] == "application/json", self.headers
        return json.loads(self.body)["error"]["code"]


def connect(server: Server, timeout: float = 10) -> socket.socket:
    host, port = server.url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=timeout)


def request_head(path: str = "/predict", length: int | None = None, extra: str = "", method: str = "POST") -> bytes:
    head = f"{method} {path} HTTP/1.1\r\nHost: test\r\nContent-Type: image/png\r\n{extra}"
    if length is not None:
        head += f"Content-Length: {length}\r\n"
    return (head + "\r\n").encode()


def read_answer(sock: socket.socket, timeout: float = 10) -> Answer:
    """One HTTP response (Content-Length framed) from the socket."""
    sock.settimeout(timeout)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed before an answer (got {data!r})"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {name.lower(): value.strip() for name, _, value in (line.partition(":") for line in lines)}
    length = int(headers.get("content-length", 0))
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, "connection closed in the middle of the answer"
        body += chunk
    return Answer(int(status_line.split()[1]), headers, body[:length])


def closed_by_server(sock: socket.socket, timeout: float) -> bool:
    """Does the server close the connection (EOF or reset) within `timeout`? Bytes it sends meanwhile are dropped."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        sock.settimeout(max(0.01, end - time.monotonic()))
        try:
            if not sock.recv(65536):
                return True
        except TimeoutError:
            return False
        except ConnectionError:
            return True
    return False


def send_quietly(sock: socket.socket, data: bytes) -> bool:
    """Send; False once the server has closed the connection."""
    try:
        sock.sendall(data)
        return True
    except OSError:
        return False
