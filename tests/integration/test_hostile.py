"""Hostile and broken clients against a real server over raw sockets: slow uploads, slow or huge headers, idle and
excess connections, early answers on keep-alive connections, disconnects mid-body, and error envelopes everywhere."""

from __future__ import annotations

import contextlib
import gzip
import itertools
import json
import select
import selectors
import socket
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import httpx
import pytest
from rawhttp import Answer, closed_by_server, connect, read_answer, request_head, send_quietly
from serving import Server, image_bytes, running_server

HEADER_TIMEOUT_S, BODY_TIMEOUT_S, MAX_CONNECTIONS, MAX_UPLOADS = 1.0, 2.0, 150, 100
PNG = {"Content-Type": "image/png"}
GOOD = image_bytes(24, 16)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with running_server(
        tmp_path_factory.mktemp("logs"),
        max_body_bytes=2_000_000,
        max_batch_size=8,
        batch_timeout_ms=5,
        header_timeout_s=HEADER_TIMEOUT_S,
        body_timeout_s=BODY_TIMEOUT_S,
        min_upload_rate=50_000,
        max_connections=MAX_CONNECTIONS,
        max_uploads=MAX_UPLOADS,
        api_servers=1,  # the connection and upload bounds are per front end; the kernel spreads connections over them
    ) as running:
        yield running


def good_request(server: Server, client: httpx.Client | None = None) -> int:
    return (client or httpx).post(f"{server.url}/predict", content=GOOD, headers=PNG, timeout=30).status_code


def trickle_until_answered(sockets: list[socket.socket], seconds: float) -> list[Answer]:
    """Send each socket a byte every 0.3 s until the server answers it; the answers, in order."""
    answers: dict[socket.socket, Answer] = {}
    end = time.monotonic() + seconds
    while len(answers) < len(sockets) and time.monotonic() < end:
        readable, _, _ = select.select([s for s in sockets if s not in answers], [], [], 0.3)
        for sock in readable:
            answers[sock] = read_answer(sock)
        for sock in sockets:
            if sock not in answers:
                send_quietly(sock, b"\0")
    assert len(answers) == len(sockets), f"{len(sockets) - len(answers)} uploads were never cut"
    return [answers[sock] for sock in sockets]


def test_trickling_uploads_do_not_lock_out_complete_requests(server: Server) -> None:
    """More sockets than the queue holds send headers and then a byte now and then: others still get 200."""
    queue_bound = httpx.get(f"{server.url}/info").json()["max_queue_depth"]
    tricklers = [connect(server) for _ in range(queue_bound + 16)]
    try:
        for sock in tricklers:
            sock.sendall(request_head(length=1_048_576) + b"\x89")
        time.sleep(0.5)
        assert [good_request(server) for _ in range(8)] == [200] * 8
        assert server.metric("imgserve_queue_depth") == 0  # uploads are not admitted work
        # Too slow: each is cut with a 408 once the grace period is over.
        answers = trickle_until_answered(tricklers, seconds=BODY_TIMEOUT_S + 10)
        assert {(a.status, a.code) for a in answers} == {(408, "upload_too_slow")}
    finally:
        for sock in tricklers:
            sock.close()
    assert good_request(server) == 200


def test_uploads_past_their_bound_get_503_and_leave_when_the_client_does(server: Server) -> None:
    uploads = [connect(server) for _ in range(MAX_UPLOADS + 10)]
    try:
        for sock in uploads:
            sock.sendall(request_head(length=1_000_000) + b"\x89")
        time.sleep(1.0)
        refused = [read_answer(sock) for sock in uploads if select.select([sock], [], [], 0)[0]]
        assert [(a.status, a.code) for a in refused] == [(503, "too_many_uploads")] * 10
    finally:
        for sock in uploads:
            sock.close()
    deadline = time.monotonic() + 10
    while good_request(server) != 200:
        assert time.monotonic() < deadline, "upload slots were not given back when their clients left"
        time.sleep(0.2)


def test_the_deadline_counts_from_the_first_byte(server: Server) -> None:
    """A 1 s deadline and an upload (fast enough for the rate limit) that takes 2 s: 504 during the upload."""
    body = b"\0" * 200_000
    with connect(server) as sock:
        sock.sendall(request_head(length=len(body), extra="X-Request-Timeout: 1\r\n"))
        for start in range(0, len(body), 10_000):
            if not send_quietly(sock, body[start : start + 10_000]):
                break
            time.sleep(0.1)
        answer = read_answer(sock)
        assert (answer.status, answer.code) == (504, "deadline")


def test_a_stalled_body_is_cut_and_the_client_told(server: Server) -> None:
    with connect(server) as sock:
        sock.sendall(request_head(length=10_000) + b"\x89PNG")
        started = time.monotonic()
        answer = read_answer(sock, timeout=BODY_TIMEOUT_S * 5)
        assert answer.status == 408 and answer.code in ("body_timeout", "upload_too_slow")
        assert answer.headers["connection"] == "close"
        assert time.monotonic() - started < BODY_TIMEOUT_S * 4
        assert closed_by_server(sock, 5)


def test_an_endless_chunked_body_is_cut(server: Server) -> None:
    """1 KiB/s of chunks for ever: cut as too slow, not held until the deadline or the size limit."""
    with connect(server) as sock:
        sock.sendall(request_head(extra="Transfer-Encoding: chunked\r\n"))
        end = time.monotonic() + 15
        while time.monotonic() < end and send_quietly(sock, b"100\r\n" + b"\0" * 256 + b"\r\n"):
            time.sleep(0.25)
        answer = read_answer(sock)
        assert (answer.status, answer.code) == (408, "upload_too_slow")


def test_headers_sent_byte_by_byte_time_out(server: Server) -> None:
    with connect(server) as sock:
        for byte in request_head(length=10)[:20]:
            if not send_quietly(sock, bytes([byte])):
                break
            time.sleep(HEADER_TIMEOUT_S / 4)
        answer = read_answer(sock)
        assert (answer.status, answer.code) == (408, "header_timeout")
        assert closed_by_server(sock, 5)


def test_an_idle_connection_is_closed(server: Server) -> None:
    with connect(server) as sock:
        assert closed_by_server(sock, HEADER_TIMEOUT_S * 5)


@pytest.mark.parametrize(
    ("extra", "code"),
    [
        ("X-Big: " + "a" * 1_000_000 + "\r\n", "headers_too_large"),
        ("".join(f"X-H{i}: {i}\r\n" for i in range(1000)), "too_many_headers"),
    ],
    ids=["1 MB value", "1000 fields"],
)
def test_huge_headers_get_431_and_the_connection_closed(server: Server, extra: str, code: str) -> None:
    with connect(server) as sock:
        send_quietly(sock, request_head(length=len(GOOD), extra=extra) + GOOD)
        answer = read_answer(sock)
        assert (answer.status, answer.code) == (431, code)
        assert closed_by_server(sock, 5)
    assert good_request(server) == 200


def test_a_header_that_never_ends_is_cut_early(server: Server) -> None:
    """Streaming a header value: 431 once the limit is passed, and the server's memory does not follow the stream."""
    rss_before = sum(p.memory_info().rss for p in server.tree())
    with connect(server) as sock:
        sock.sendall(b"GET /health/live HTTP/1.1\r\nX-Endless: ")
        sent = 0  # what the kernel's socket buffers take, not what the server read
        while sent < 100_000_000 and not select.select([sock], [], [], 0)[0] and send_quietly(sock, b"a" * 8192):
            sent += 8192
        assert sent < 50_000_000
        assert read_answer(sock).code == "headers_too_large"
    assert sum(p.memory_info().rss for p in server.tree()) - rss_before < 32 * 2**20


def test_connections_past_the_bound_get_503(server: Server) -> None:
    sockets = []
    try:
        for _ in range(MAX_CONNECTIONS + 10):
            sockets.append(connect(server))
        time.sleep(0.3)
        for sock in sockets:
            send_quietly(sock, b"GET /health/live HTTP/1.1\r\nHost: t\r\n\r\n")
        answers = [read_answer(sock) for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()
    statuses = [a.status for a in answers]
    assert 0 < statuses.count(503) <= 20 and statuses.count(200) >= MAX_CONNECTIONS - 10
    assert {a.code for a in answers if a.status == 503} == {"too_many_connections"}
    assert good_request(server) == 200


@pytest.mark.parametrize(
    ("content", "headers", "status"),
    [
        (image_bytes(200, 150, "JPEG")[:300], PNG, 400),
        (b"\xff" * 2_500_000, PNG, 413),
        (GOOD, {**PNG, "X-Request-Timeout": "1_0"}, 422),
    ],
    ids=["corrupt image", "body over the limit", "bad timeout"],
)
def test_keep_alive_client_keeps_working_after_an_error(server: Server, content, headers, status) -> None:
    with httpx.Client(timeout=30) as client:
        for _ in range(3):
            response = client.post(f"{server.url}/predict", content=content, headers=headers)
            assert response.status_code == status and response.json()["error"]["code"]
            assert good_request(server, client) == 200


def test_an_early_answer_closes_the_connection_and_is_read_whole(server: Server) -> None:
    """Answered before the body is in (413 declared): Connection: close, and a client still sending reads it."""
    with connect(server) as sock:
        sock.sendall(request_head(length=2_500_000))
        answer = read_answer(sock)
        assert (answer.status, answer.code, answer.headers["connection"]) == (413, "body_too_large", "close")
        send_quietly(sock, b"\0" * 500_000)
        assert closed_by_server(sock, 5)


def test_disconnect_mid_body_is_no_error(server: Server) -> None:
    errors_before = server.metric("imgserve_requests_total", code="500")
    for _ in range(5):
        with connect(server) as sock:
            sock.sendall(request_head(length=100_000) + b"\x89PNG" * 100)
            time.sleep(0.1)
    time.sleep(0.5)
    assert "Exception in ASGI application" not in server.log()
    assert server.metric("imgserve_requests_total", code="500") == errors_before
    assert server.metric("imgserve_requests_total", route="/predict", code="499") >= 5


@pytest.mark.parametrize(
    ("method", "path", "status", "code"),
    [
        ("GET", "/nothing-here", 404, "not_found"),
        ("GET", "/redoc", 404, "not_found"),  # /docs and /openapi.json are served (test_openapi.py: --no-docs)
        ("POST", "/openapi.json", 405, "method_not_allowed"),
        ("GET", "/predict", 405, "method_not_allowed"),
        ("DELETE", "/health/ready", 405, "method_not_allowed"),
    ],
)
def test_unknown_routes_and_methods_answer_the_envelope(server: Server, method, path, status, code) -> None:
    response = httpx.request(method, f"{server.url}{path}")
    assert (response.status_code, response.json()["error"]["code"]) == (status, code)
    if status == 405:
        assert response.headers["allow"]


def test_invalid_http_gets_a_json_400(server: Server) -> None:
    with connect(server) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost test\r\n\r\n")
        answer = read_answer(sock)
        assert (answer.status, answer.code) == (400, "bad_request")


def test_unclosed_multipart_is_bad_multipart(server: Server) -> None:
    body = b'--XyZ\r\nContent-Disposition: form-data; name="file"; filename="a.png"\r\n\r\n' + GOOD[:200]
    headers = {"Content-Type": "multipart/form-data; boundary=XyZ"}
    response = httpx.post(f"{server.url}/predict", content=body, headers=headers)
    assert (response.status_code, response.json()["error"]["code"]) == (400, "bad_multipart")


def test_thousands_of_unknown_parameters_are_listed_briefly(server: Server) -> None:
    params = {f"p{i}": "1" for i in range(1200)}  # as many as the header limit lets through
    response = httpx.post(f"{server.url}/predict", content=GOOD, headers=PNG, params=params)
    assert (response.status_code, response.json()["error"]["code"]) == (422, "bad_parameters")
    message = response.json()["error"]["message"]
    assert len(message) < 1000 and "1195 more" in message


def test_many_concurrent_hostile_clients_leave_the_server_healthy(server: Server) -> None:
    def idle() -> None:
        with connect(server) as sock:
            closed_by_server(sock, HEADER_TIMEOUT_S * 5)

    with ThreadPoolExecutor(32) as pool:
        idlers = [pool.submit(idle) for _ in range(64)]
        assert [good_request(server) for _ in range(5)] == [200] * 5
        for future in idlers:
            future.result()
    assert httpx.get(f"{server.url}/health/ready").status_code == 200
    assert server.metric("imgserve_requests_total", route="/predict", code="500") == 0


def test_good_requests_keep_their_connection(server: Server) -> None:
    with connect(server) as sock:
        for _ in range(3):
            sock.sendall(request_head(length=len(GOOD)) + GOOD)
            answer = read_answer(sock)
            assert answer.status == 200 and "connection" not in answer.headers


@contextlib.contextmanager
def full_pod(tmp_path, toy_model, monkeypatch, hold_s: float = 8.0) -> Iterator[tuple[Server, Future]]:
    """A server whose queue of one is held full for `hold_s` by one request (its answer: the future)."""
    monkeypatch.setenv("TOY_DELAY_S", str(hold_s))
    settings = dict(max_batch_size=1, max_queue_depth=1, workers_per_device=1, batch_timeout_ms=0)
    with running_server(tmp_path, **settings, **toy_model("Slow")) as server, ThreadPoolExecutor(1) as pool:
        held = pool.submit(good_request, server)
        deadline = time.monotonic() + 10
        while server.metric("imgserve_queue_depth") < 1:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        yield server, held


@pytest.mark.parametrize(("path", "route"), [("/predict", "/predict"), ("/v2/models/Slow/infer", "/v2/infer")])
def test_a_full_pod_sheds_at_the_headers_and_keeps_the_connection(
    tmp_path, toy_model, monkeypatch, path: str, route: str
) -> None:
    """503 from the connection layer: the body skipped, the connection kept for the retry (closed when the body is
    chunked, as its length is unknown); a client back before its Retry-After gets its next 503 when it is up. The
    same for the Open Inference Protocol's infer route, in its own envelope."""

    def queue_full(answer: Answer) -> bool:
        return answer.code == "queue_full" if route == "/predict" else v2_error(answer) == "the queue is full"

    with full_pod(tmp_path, toy_model, monkeypatch) as (server, held):
        with connect(server) as sock:
            answered_at = []
            for _ in range(3):  # resent at once: the second 503 waits for the Retry-After of 1 s, the third twice that
                sock.sendall(request_head(path, length=len(GOOD)) + GOOD)
                answer = read_answer(sock)
                answered_at.append(time.monotonic())
                assert (answer.status, answer.headers["retry-after"]) == (503, "1") and queue_full(answer)
                assert "connection" not in answer.headers
            gaps = [later - earlier for earlier, later in itertools.pairwise(answered_at)]
            assert 0.8 < gaps[0] < 2.5 and 1.8 < gaps[1] < 3.5, gaps  # plus up to one Retry-After of jitter each
            sock.sendall(request_head(path, extra="Transfer-Encoding: chunked\r\n") + b"10\r\n" + b"\0" * 16 + b"\r\n")
            answer = read_answer(sock)
            assert (answer.status, answer.headers["connection"]) == (503, "close") and queue_full(answer)
        with connect(server) as sock:  # a client waiting for 100 Continue sends no body after a 503: close
            sock.sendall(request_head(path, length=len(GOOD), extra="Expect: 100-continue\r\n"))
            answer = read_answer(sock)
            assert (answer.status, answer.headers["connection"]) == (503, "close") and queue_full(answer)
        assert held.result() == 200
        assert server.metric("imgserve_requests_total", route=route, code="503") == 5
        assert server.metric("imgserve_rejected_total", reason="queue_full") == 5


def test_a_client_resending_at_once_waits_longer_each_time_up_to_four_retry_afters(
    tmp_path, toy_model, monkeypatch
) -> None:
    """Each early return in a row doubles the hold (1, 2, 4 x Retry-After, then no more), and a client that then
    waits its Retry-After is answered at once."""
    with full_pod(tmp_path, toy_model, monkeypatch, hold_s=20.0) as (server, held):
        with connect(server) as sock:

            def refused() -> float:
                sock.sendall(request_head(length=len(GOOD)) + GOOD)
                assert read_answer(sock).status == 503
                return time.monotonic()

            answered_at = [refused() for _ in range(5)]
            gaps = [later - earlier for earlier, later in itertools.pairwise(answered_at)]
            for gap, wait in zip(gaps, (1, 2, 4, 4), strict=True):
                assert wait - 0.2 < gap < wait + 1.5, gaps  # plus up to one Retry-After of jitter
            time.sleep(1.05)  # polite: back once its Retry-After is up
            started = time.monotonic()
            assert refused() - started < 0.5
        assert held.result() == 200


def test_clients_refused_together_and_resending_at_once_come_back_spread_out(tmp_path, toy_model, monkeypatch) -> None:
    """A retry storm's herd: 24 connections refused at once, each resending at once, get their held 503s spread
    over Retry-After .. 2 x Retry-After, not all at the same moment."""
    with full_pod(tmp_path, toy_model, monkeypatch) as (server, held):
        sockets = [connect(server) for _ in range(24)]
        try:
            for sock in sockets:  # refused together
                sock.sendall(request_head("/predict", length=len(GOOD)) + GOOD)
            for sock in sockets:
                assert read_answer(sock).status == 503
            resent_at = time.monotonic()
            for sock in sockets:  # and back at once
                sock.sendall(request_head("/predict", length=len(GOOD)) + GOOD)
            waited = []
            with selectors.DefaultSelector() as selector:  # when each answer arrives, whatever the order
                for sock in sockets:
                    selector.register(sock, selectors.EVENT_READ)
                while len(waited) < len(sockets) and time.monotonic() < resent_at + 10:
                    for key, _ in selector.select(timeout=1):
                        waited.append(time.monotonic() - resent_at)
                        selector.unregister(key.fileobj)
                        assert read_answer(key.fileobj).status == 503
        finally:
            for sock in sockets:
                sock.close()
        assert held.result() == 200
    assert min(waited) > 0.8 and max(waited) < 2 + 0.5, waited
    assert max(waited) - min(waited) > 0.3, waited  # spread (24 draws of up to 1 s: ~0.9 s apart)


V2_INFER = "/v2/models/denoiser/infer"


def v2_error(answer: Answer) -> str:
    """The Open Inference Protocol's error message (fails the test if the body is not its envelope)."""
    assert answer.headers["content-type"] == "application/json", answer.headers
    body = json.loads(answer.body)
    assert list(body) == ["error"] and isinstance(body["error"], str), body
    return body["error"]


def test_a_stalled_v2_body_is_cut_with_the_protocols_error(server: Server) -> None:
    with connect(server) as sock:
        sock.sendall(request_head(V2_INFER, length=10_000) + b'{"inputs": [')
        answer = read_answer(sock, timeout=BODY_TIMEOUT_S * 5)
        assert answer.status == 408 and ("no upload bytes" in v2_error(answer) or "slower" in v2_error(answer))
        assert closed_by_server(sock, 5)


def test_a_v2_body_over_the_limit_is_413_before_it_is_read(server: Server) -> None:
    with connect(server) as sock:
        sock.sendall(request_head(V2_INFER, length=50_000_000))
        answer = read_answer(sock)
        assert answer.status == 413 and "over the limit" in v2_error(answer)


def test_a_gzip_bomb_is_413_and_costs_no_more_than_the_limit(server: Server) -> None:
    bomb = gzip.compress(b"\0" * 200_000_000, compresslevel=9)  # 200 MB inflated, about 200 KB sent
    rss_before = sum(p.memory_info().rss for p in server.tree())
    response = httpx.post(f"{server.url}{V2_INFER}", content=bomb, headers={"Content-Encoding": "gzip"}, timeout=60)
    assert response.status_code == 413 and list(response.json()) == ["error"]
    assert sum(p.memory_info().rss for p in server.tree()) - rss_before < 64 * 2**20
    assert good_request(server) == 200
