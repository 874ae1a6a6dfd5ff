"""A plain LitServe API answers the same under imgserve as under LitServe: each API is served side by side by
LitServe itself (`ls.LitServer(api).run()`) and by `imgserve serve --api module:Class`, and the same requests get
the same status, content type and body from both.

The APIs are LitServe's own examples, shipped inside the litserve package (litserve.test_examples.simple_example),
the LitServe APIs of examples/litserve_api.py (a JSON one as LitServe's docs write it, and a multipart image upload
answered with a Starlette Response), and tests/support/parity_apis.py (a pydantic-typed request and HTTPExceptions
raised in hooks)."""

from __future__ import annotations

import contextlib
import io
import os
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from PIL import Image
from serving import (
    REPO,
    SOURCE,
    SUPPORT,
    image_bytes,
    running_server,
    start_server,
    stop_server,
    wait_ready,
    wait_until,
)

from imgserve.testing import free_port, start, stop
from imgserve.testing import wait_ready as wait_for

LITSERVE = """
import importlib, sys
import litserve as ls
apis = []
for spec in sys.argv[1].split(","):
    module, _, name = spec.partition(":")
    api = getattr(importlib.import_module(module), name)
    apis.append(api() if isinstance(api, type) else api)
server = ls.LitServer(apis if len(apis) > 1 else apis[0], accelerator="cpu", devices=1, workers_per_device=1)
server.run(host="127.0.0.1", port=int(sys.argv[2]), num_api_servers=1, generate_client_file=False)
"""
SIMPLE = "litserve.test_examples.simple_example"
JSON_TYPE = "application/json"


@contextlib.contextmanager
def side_by_side(spec: str, log_dir: Path, ours: str | None = None, **settings: Any) -> Iterator[tuple[str, str]]:
    """LitServe serving the API `spec` (module:Class or module:instance; several, comma separated, as
    LitServer([a, b])) and imgserve serving `ours` (the same APIs unless given) with `settings`: their URLs."""
    port = free_port()
    env = {key: value for key, value in os.environ.items() if not key.startswith("IMGSERVE_")}
    env["PYTHONPATH"] = os.pathsep.join([str(SUPPORT), str(REPO), env.get("PYTHONPATH", "")])
    with contextlib.ExitStack() as stack:
        theirs = start([sys.executable, "-c", LITSERVE, spec, str(port)], port, log_dir / f"litserve-{port}.log", env)
        stack.callback(stop, theirs)
        apis = ours or spec
        served = start_server({"api": apis, "api_servers": 1, "workers_per_device": 1, **settings}, log_dir)
        stack.callback(stop_server, served)
        wait_for(theirs, 120, ready_path="/health")
        wait_ready(served, 120)
        yield theirs.url, served.url


def answer(url: str, path: str = "/predict", **request: Any) -> tuple[int, str, Any]:
    """POST `path`: the status, the media type and the body (parsed when JSON)."""
    response = httpx.post(f"{url}{path}", timeout=30, **request)
    media = response.headers.get("content-type", "").split(";")[0]
    return response.status_code, media, response.json() if media == JSON_TYPE else response.content


def same_answers(urls: tuple[str, str], requests: list[dict[str, Any]]) -> list[tuple[int, str, Any]]:
    """Each request sent to both servers: the answers, checked equal; LitServe's are returned."""
    theirs, ours = ([answer(url, **request) for request in requests] for url in urls)
    for request, their, our in zip(requests, theirs, ours, strict=True):
        assert our == their, f"{request}: LitServe answered {their}, imgserve {our}"
    return theirs


def same_failures(urls: tuple[str, str], requests: list[dict[str, Any]]) -> None:
    """Requests on which a hook raises what is not an HTTPException: 500 {"detail": ...} from both (LitServe's
    detail is "Internal server error", imgserve's names the hook and the exception)."""
    for request in requests:
        for url in urls:
            status, media, body = answer(url, **request)
            assert (status, media, list(body)) == (500, JSON_TYPE, ["detail"]), f"{url}: {request}"


def test_litserves_simple_example(tmp_path: Path) -> None:
    with side_by_side(f"{SIMPLE}:SimpleLitAPI", tmp_path) as urls:
        answers = same_answers(urls, [{"json": {"input": value}} for value in (4.0, 3, -2.5)])
        same_failures(urls, [{"json": {"wrong": 1}}, {"json": {"input": [1, 2]}}])  # in decode_request, in predict
    assert [body for *_, body in answers] == [{"output": 16.0}, {"output": 9}, {"output": 6.25}]


def test_litserves_batched_example_under_concurrent_requests(tmp_path: Path) -> None:
    """SimpleBatchedAPI with max_batch_size 4: batched by LitServe's default batch (numpy arrays stacked) and
    unbatch, sixteen concurrent requests each get their own answer."""
    requests = [{"json": {"input": float(value)}} for value in range(16)]
    with side_by_side("parity_apis:batched", tmp_path) as urls, ThreadPoolExecutor(16) as pool:
        for url in urls:
            answers = list(pool.map(lambda request, url=url: answer(url, **request), requests))
            assert answers == [(200, JSON_TYPE, {"output": float(value) ** 2}) for value in range(16)], url


EMBEDDINGS = [{"json": {"input": [float(i), 1.0, 0.0, -1.0]}} for i in range(16)]


def concurrent_answers(url: str, requests: list[dict[str, Any]]) -> list[tuple[int, str, Any]]:
    with ThreadPoolExecutor(len(requests)) as pool:
        return list(pool.map(lambda request: answer(url, **request), requests))


def test_the_batch_size_flags_batch_a_plain_litapi_as_litserve_does_with_it_in_the_constructor(tmp_path: Path) -> None:
    """`--max-batch-size 4 --batch-timeout-ms 10` on a LitAPI whose `batch` stacks and whose `predict` takes only
    the stacked batch: imgserve calls batch -> predict -> unbatch, as LitServe does for the same API constructed with
    max_batch_size=4 (a 500 for every request when predict got single items)."""
    batching = {"max_batch_size": 4, "batch_timeout_ms": 10}
    with side_by_side("parity_apis:batched_embedding", tmp_path, "parity_apis:StackedEmbedding", **batching) as urls:
        theirs, ours = (concurrent_answers(url, EMBEDDINGS) for url in urls)
    assert ours == theirs == [(200, JSON_TYPE, {"embedding": 1.0 * i + 2.0 - 4.0}) for i in range(16)]


def test_imgserve_serve_batches_a_plain_litapi_constructed_with_its_batch_size(tmp_path: Path) -> None:
    """In Python, `imgserve.serve(StackedEmbedding(max_batch_size=4, batch_timeout=0.01))`: every request answered,
    in batches of more than one."""
    port = free_port()
    script = (
        "import imgserve, parity_apis; "
        f"imgserve.serve(parity_apis.StackedEmbedding(max_batch_size=4, batch_timeout=0.01), host='127.0.0.1', "
        f"port={port}, grpc_port=0, api_servers=1, workers_per_device=1)"
    )
    env = {key: value for key, value in os.environ.items() if not key.startswith(("IMGSERVE_", "PROMETHEUS"))}
    env["PYTHONPATH"] = os.pathsep.join([str(SUPPORT), str(SOURCE), str(REPO)])
    server = start([sys.executable, "-c", script], port, tmp_path / "serve.log", env)
    try:
        wait_for(server, 120)
        answers = concurrent_answers(server.url, EMBEDDINGS)
        batches = httpx.get(f"{server.url}/metrics").text
    finally:
        stop(server)
    assert answers == [(200, JSON_TYPE, {"embedding": 1.0 * i + 2.0 - 4.0}) for i in range(16)]
    count = next(
        float(line.split()[1]) for line in batches.splitlines() if line.startswith("imgserve_batch_size_count")
    )
    assert count < 16, "the requests were batched"


def test_a_plain_litapis_form_is_read_with_the_limits_of_every_route(tmp_path: Path) -> None:
    """A LitAPI that reads request["file"]: a form of 100 files and a multipart body that is never closed are 400s
    from the reading every route shares (LitServe itself reads 1,000 files and answers the unclosed body 500)."""
    upload = image_bytes(32, 24, "JPEG")
    files = [("file", (f"photo{i}.jpg", upload, "image/jpeg")) for i in range(100)]
    boundary = "b0undary"
    unclosed = f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="a.jpg"\r\n\r\n'.encode()
    with running_server(tmp_path, api="examples.litserve_api:GrayscaleLitAPI") as server:
        many = httpx.post(f"{server.url}/predict", files=files, timeout=30)
        cut = httpx.post(
            f"{server.url}/predict",
            content=unclosed + upload,
            headers={"content-type": f"multipart/form-data; boundary={boundary}"},
            timeout=30,
        )
        assert (many.status_code, cut.status_code) == (400, 400), (many.text, cut.text)
        assert "Too many files" in many.json()["detail"] and "not closed" in cut.json()["detail"]
        assert httpx.post(f"{server.url}/predict", files={"file": ("a.jpg", upload)}).status_code == 200
        assert server.metric("imgserve_requests_total", route="/predict", code="500") == 0


def test_two_litapis_on_two_paths_answer_as_under_litserve(tmp_path: Path) -> None:
    """`LitServer([squares, doubles])`, each LitAPI at its own api_path, against `imgserve serve --api ... --api ...`:
    the same answers on both paths, errors included."""
    requests = [
        {"path": "/squares", "json": {"input": 3.0}},
        {"path": "/doubles", "json": {"input": 3}},
        {"path": "/doubles", "json": {"input": "three"}},  # FastAPI's 422 and its detail list
        {"path": "/doubles", "json": {"input": -3}},  # HTTPException(400) in predict
    ]
    with side_by_side("parity_apis:squares,parity_apis:doubles", tmp_path) as urls:
        answers = same_answers(urls, requests)
        assert answer(urls[1], "/predict", json={"input": 3.0})[0] == 404  # neither is at /predict
    assert [status for status, *_ in answers] == [200, 200, 422, 400]
    assert answers[:2] == [(200, JSON_TYPE, {"output": 9.0}), (200, JSON_TYPE, {"output": 6.0})]


def test_litserves_torch_example(tmp_path: Path) -> None:
    with side_by_side(f"{SIMPLE}:SimpleTorchAPI", tmp_path) as urls:
        answers = same_answers(urls, [{"json": {"input": value}} for value in (0.0, 3.0, -1.5)])
    assert [body for *_, body in answers] == [{"output": 1.0}, {"output": 7.0}, {"output": -2.0}]


def test_the_litserve_example_as_litserves_docs_write_it(tmp_path: Path) -> None:
    with side_by_side("examples.litserve_api:InferencePipeline", tmp_path) as urls:
        answers = same_answers(urls, [{"json": {"input": value}} for value in (4.0, 2, 0.5)])
    assert answers[0] == (200, JSON_TYPE, {"output": 80.0})


def test_an_image_upload_answered_with_a_starlette_response(tmp_path: Path) -> None:
    """The multipart file is read with request["file"].file.read(); the PNG the Response carries is the same bytes
    from both servers; an HTTPException in decode_request answers alike, a missing field 500 from both."""
    upload = image_bytes(96, 64, "JPEG", seed=3)
    requests = [
        {"files": {"file": ("photo.jpg", upload, "image/jpeg")}},
        {"files": {"file": ("notes.txt", b"not an image", "text/plain")}},  # HTTPException(400) in decode_request
    ]
    with side_by_side("examples.litserve_api:GrayscaleLitAPI", tmp_path) as urls:
        answers = same_answers(urls, requests)
        same_failures(urls, [{"files": {"other": ("photo.jpg", upload, "image/jpeg")}}])  # request["file"]: KeyError
    status, media, body = answers[0]
    assert (status, media) == (200, "image/png")
    gray = np.asarray(Image.open(io.BytesIO(body)))
    assert gray.shape == (64, 96) and gray.dtype == np.uint8
    assert answers[1] == (400, JSON_TYPE, {"detail": "file is not an image"})


def test_a_pydantic_request_and_http_exceptions_in_hooks(tmp_path: Path) -> None:
    requests = [
        {"json": {"input": 3}},
        {"json": {"input": "three"}},  # not a number: FastAPI's 422 and its detail list
        {"json": {}},  # missing
        {"json": {"input": -5000}},  # under the model's bound
        {"content": b"{not json", "headers": {"content-type": JSON_TYPE}},
        {"json": {"input": 300}},  # HTTPException(413) in decode_request
        {"json": {"input": -3}},  # HTTPException(400) in predict
    ]
    with side_by_side("parity_apis:ValidatedLitAPI", tmp_path) as urls:
        answers = same_answers(urls, requests)
    assert answers[0] == (200, JSON_TYPE, {"output": 6.0})
    assert [status for status, *_ in answers[1:5]] == [422] * 4
    assert answers[5:] == [
        (413, JSON_TYPE, {"detail": "input is over 100"}),
        (400, JSON_TYPE, {"detail": "input must not be negative"}),
    ]


def test_the_api_knows_its_device(tmp_path: Path) -> None:
    """Both servers set up the API on the CPU and its hook says so (the same error from both would not)."""
    with side_by_side("parity_apis:DeviceLitAPI", tmp_path) as urls:
        assert same_answers(urls, [{"json": {}}]) == [(200, JSON_TYPE, {"device": "cpu"})]


def test_a_plain_litapi_is_ready_with_grpc_on(tmp_path: Path) -> None:
    server = start_server({"api": "examples.litserve_api:InferencePipeline", "grpc_port": free_port()}, tmp_path)
    try:
        wait_until(lambda: ready_reason(server.url) not in ("starting", "model loading"), 120, "workers set up")
        wait_until(lambda: ready_reason(server.url) == "ready", 10, "ready once the workers are")
    finally:
        stop_server(server)


def ready_reason(url: str) -> str:
    """What /health/ready says: "ready", why not, or "starting" before it answers."""
    try:
        body = httpx.get(f"{url}/health/ready", timeout=5).json()
    except httpx.HTTPError:
        return "starting"
    return body.get("reason", body["status"])


def test_string_annotations_of_a_module_with_future_annotations_are_resolved(tmp_path: Path) -> None:
    """`from __future__ import annotations` makes the request's type a string; imgserve resolves it, so the body is
    validated as the pydantic class (LitServe itself takes the string for a query parameter)."""
    with running_server(tmp_path, api="future_apis:FutureAnnotatedLitAPI") as server:
        assert httpx.post(f"{server.url}/predict", json={"input": 4}).json() == {"output": 8.0}
        refused = httpx.post(f"{server.url}/predict", json={"input": "four"})
        assert refused.status_code == 422 and refused.json()["detail"][0]["loc"] == ["body", "input"]
