"""One trace per request, across the front end and the worker, received by a real OTLP/HTTP receiver (otlp.py): the
span tree and its links for /predict, the Open Inference Protocol over HTTP and gRPC, the built-in model and a
user's API, refused requests; the request id echoed, logged and on every span; a hostile id or trace context
replaced, never echoed."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator

import grpc
import httpx
import numpy as np
import otlp
import pytest
import rawhttp
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from serving import Server, grpc_stub, image_bytes, running_server, wait_until
from tritonclient.grpc import service_pb2

from imgserve.testing import free_port

CALLER_TRACE = "0af7651916cd43dd8448eb211c80319c"
CALLER_SPAN = "b7ad6b7169203331"
FRONT_END_STEPS = {"admission", "read", "infer"}
ITEM_STEPS = {"decode_request", "hand-off", "encode_response"}
SKEW_NS = 1_000_000  # two processes' wall clocks, each read as monotonic + its own offset, may differ by this


def traceparent(trace_id: str = CALLER_TRACE) -> str:
    return f"00-{trace_id}-{CALLER_SPAN}-01"


@pytest.fixture(scope="module")
def receiver() -> Iterator[otlp.Receiver]:
    yield from otlp.receiving()


@pytest.fixture(scope="module")
def builtin(receiver: otlp.Receiver) -> Iterator[Server]:
    """The built-in model, traced, with gRPC and the access log."""
    with pytest.MonkeyPatch.context() as patch:
        for key, value in otlp.environment(receiver).items():
            patch.setenv(key, value)
        with running_server(grpc_port=free_port(), access_log="true") as server:
            yield server


# What a launcher such as opentelemetry-instrument does at every interpreter's start: a global tracer provider, here
# exporting each span as it ends to the same receiver, as another service.
GLOBAL_PROVIDER = """
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

provider = TracerProvider(resource=Resource.create({"service.name": "instrumented"}))
provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter()))
trace.set_tracer_provider(provider)
"""


@pytest.fixture(scope="module")
def instrumented(receiver: otlp.Receiver, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The built-in model, traced, in processes that each set a global tracer provider as they start."""
    site = tmp_path_factory.mktemp("instrumented")
    (site / "sitecustomize.py").write_text(GLOBAL_PROVIDER)
    with pytest.MonkeyPatch.context() as patch:
        for key, value in otlp.environment(receiver).items():
            patch.setenv(key, value)
        patch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])))
        with running_server() as server:
            yield server


@pytest.fixture(scope="module")
def slow(receiver: otlp.Receiver) -> Iterator[Server]:
    """A user's API whose batches take 2 s, on one worker, with room for two requests in the pod."""
    with pytest.MonkeyPatch.context() as patch:
        for key, value in otlp.environment(receiver, USER_API_DELAY_S="2").items():
            patch.setenv(key, value)
        settings = {"api": "user_apis:Slow", "workers_per_device": 1, "max_queue_depth": 2, "max_batch_size": 1}
        with running_server(**settings) as server:
            yield server


def whole_trace(receiver: otlp.Receiver, trace_id: str, names: set[str]) -> dict[str, list[otlp.Span]]:
    """The trace's spans by name, once every name in `names` has come."""

    def arrived(spans: list[otlp.Span]) -> dict[str, list[otlp.Span]] | None:
        found: dict[str, list[otlp.Span]] = {}
        for span in spans:
            if span.trace_id == trace_id:
                found.setdefault(span.name, []).append(span)
        return found if names <= set(found) else None

    return receiver.wait(arrived, f"the spans {sorted(names)} of trace {trace_id}")


def one(spans: dict[str, list[otlp.Span]], name: str) -> otlp.Span:
    (span,) = spans[name]
    return span


def check_tree(spans: dict[str, list[otlp.Span]], server_name: str, request_id: str, model: str) -> otlp.Span:
    """The tree every traced inference of one item makes; returns its server span."""
    server = one(spans, server_name)
    assert server.kind == "SERVER" and server.process == "frontend" and server.service == "imgserve"
    assert server.attributes["imgserve.model"] == model
    steps = {name: one(spans, name) for name in FRONT_END_STEPS | ITEM_STEPS if name in spans}
    infer, hand_off = steps["infer"], steps["hand-off"]
    assert infer.parent_id == server.span_id
    for name in ITEM_STEPS:
        assert steps[name].parent_id == infer.span_id and steps[name].attributes["imgserve.item"] == 0
    queue, batch, predict = one(spans, "queue"), one(spans, "batch"), one(spans, "predict")
    assert {queue.process, batch.process, predict.process} == {"worker"}
    assert queue.parent_id == hand_off.span_id and batch.parent_id == hand_off.span_id
    assert predict.parent_id == batch.span_id
    assert queue.attributes["imgserve.batch.size"] >= 1 and queue.attributes["imgserve.batch.index"] >= 0
    assert batch.attributes["imgserve.batch.size"] >= 1 and batch.attributes["imgserve.model"] == model
    link = next(link for link in batch.links if link.span_id == hand_off.span_id)  # a batch links to every request
    assert link.attributes["imgserve.request_id"] == request_id
    assert [link.span_id for link in queue.links] == [batch.span_id]
    assert queue.start_ns <= queue.end_ns == batch.start_ns <= predict.start_ns <= predict.end_ns <= batch.end_ns
    assert hand_off.start_ns - SKEW_NS <= queue.start_ns and predict.end_ns <= hand_off.end_ns + SKEW_NS
    assert hand_off.end_ns <= steps["encode_response"].start_ns
    every = [span for named in spans.values() for span in named]
    assert {span.attributes.get("imgserve.request_id") for span in every} == {request_id}
    assert all(span.status != "ERROR" for span in every)
    return server


def test_predict_continues_the_callers_trace_into_the_worker(builtin: Server, receiver: otlp.Receiver) -> None:
    headers = {"content-type": "image/png", "traceparent": traceparent(), "x-request-id": "predict-1"}
    answer = httpx.post(f"{builtin.url}/predict", content=image_bytes(64, 48), headers=headers, timeout=30)
    assert answer.status_code == 200 and answer.headers["x-request-id"] == "predict-1"
    spans = whole_trace(receiver, CALLER_TRACE, {"POST /predict", "predict", "encode_response"})
    server = check_tree(spans, "POST /predict", "predict-1", "denoiser")
    assert server.parent_id == CALLER_SPAN  # the caller's span
    assert (server.attributes["http.route"], server.attributes["http.response.status_code"]) == ("/predict", 200)
    assert {"admission", "read"} <= set(spans) and one(spans, "admission").parent_id == server.span_id
    wait_until(lambda: 'POST /predict HTTP/1.1" 200 request_id=predict-1' in builtin.log(), 10, "the access log")


def test_without_a_traceparent_a_trace_starts_and_an_id_is_made_up(builtin: Server, receiver: otlp.Receiver) -> None:
    answer = httpx.post(f"{builtin.url}/predict", content=image_bytes(32, 32), headers={"content-type": "image/png"})
    made = answer.headers["x-request-id"]
    assert answer.status_code == 200 and len(made) == 32 and int(made, 16) >= 0

    def server_span(spans: list[otlp.Span]) -> otlp.Span | None:
        found = [s for s in spans if s.kind == "SERVER" and s.attributes.get("imgserve.request_id") == made]
        return found[0] if found else None

    server = receiver.wait(server_span, f"the server span of request {made}")
    assert server.parent_id == "" and server.trace_id != CALLER_TRACE
    spans = whole_trace(receiver, server.trace_id, {"predict", "encode_response"})
    check_tree(spans, "POST /predict", made, "denoiser")


def test_v2_http_and_grpc_inferences_are_traced_the_same_way(builtin: Server, receiver: otlp.Receiver) -> None:
    image = httpclient.InferInput("image", [1, 1], "BYTES")
    image.set_data_from_numpy(np.array([[image_bytes(40, 30)]], dtype=object), binary_data=True)
    http_trace, grpc_trace = "1" * 32, "2" * 32
    client = httpclient.InferenceServerClient(builtin.address)
    client.infer("denoiser", [image], headers={"traceparent": traceparent(http_trace), "x-request-id": "v2-http"})
    spans = whole_trace(receiver, http_trace, {"POST /v2/infer", "predict", "encode_response"})
    assert check_tree(spans, "POST /v2/infer", "v2-http", "denoiser").parent_id == CALLER_SPAN

    tensor = grpcclient.InferInput("image", [1, 1], "BYTES")
    tensor.set_data_from_numpy(np.array([[image_bytes(40, 30)]], dtype=object))
    with grpcclient.InferenceServerClient(f"127.0.0.1:{builtin.grpc_port}") as grpc_client:
        grpc_client.infer("denoiser", [tensor], request_id="v2-grpc", headers={"traceparent": traceparent(grpc_trace)})
    name = "inference.GRPCInferenceService/ModelInfer"
    spans = whole_trace(receiver, grpc_trace, {name, "predict", "encode_response"})
    server = check_tree(spans, name, "v2-grpc", "denoiser")
    assert server.parent_id == CALLER_SPAN and server.attributes["rpc.grpc.status_code"] == 0


def test_over_v2_http_the_bodys_id_is_the_request_id(builtin: Server, receiver: otlp.Receiver) -> None:
    """The body's `id` wins over X-Request-ID: echoed, logged, and on every span, `admission` (which ends before the
    body is read) included."""
    body = {
        "id": "v2-body-1",
        "inputs": [{"name": "pixels", "shape": [1, 8, 8, 3], "datatype": "UINT8", "data": [0] * 192}],
    }
    headers = {"traceparent": traceparent("3" * 32), "x-request-id": "from-the-header"}
    answer = httpx.post(f"{builtin.url}/v2/models/denoiser/infer", json=body, headers=headers, timeout=30)
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-request-id"] == "v2-body-1" and answer.json()["id"] == "v2-body-1"
    spans = whole_trace(receiver, "3" * 32, {"POST /v2/infer", "admission", "predict", "encode_response"})
    check_tree(spans, "POST /v2/infer", "v2-body-1", "denoiser")
    logged = 'POST /v2/models/denoiser/infer HTTP/1.1" 200 request_id=v2-body-1'
    wait_until(lambda: logged in builtin.log(), 10, "the access log")
    unsafe = {**body, "id": "<script>"}  # answered in the body as sent, but not echoed or logged: the header's id is
    answer = httpx.post(f"{builtin.url}/v2/models/denoiser/infer", json=unsafe, headers=headers, timeout=30)
    assert answer.json()["id"] == "<script>" and answer.headers["x-request-id"] == "from-the-header"


def test_grpc_echoes_the_request_id_it_made_up(builtin: Server) -> None:
    request = service_pb2.ModelInferRequest(model_name="denoiser")
    request.inputs.add(name="image", datatype="BYTES", shape=[1, 1])
    request.raw_input_contents.append(len(png := image_bytes(16, 16)).to_bytes(4, "little") + png)
    with grpc_stub(builtin) as stub:
        _, call = stub.ModelInfer.with_call(request, timeout=30)
        made = dict(call.trailing_metadata())["x-request-id"]
        assert len(made) == 32
        _, call = stub.ModelInfer.with_call(request, metadata=(("x-request-id", "from-metadata"),), timeout=30)
        assert dict(call.trailing_metadata())["x-request-id"] == "from-metadata"


def test_hostile_ids_and_trace_contexts_are_replaced_not_echoed(builtin: Server, receiver: otlp.Receiver) -> None:
    body = image_bytes(16, 16)
    hostile = [
        "X-Request-ID: caf\xe9\r\n",  # not ASCII
        "X-Request-ID: " + "a" * 200 + "\r\n",  # too long
        "X-Request-ID: <script>alert(1)</script>\r\n",
        f"traceparent: 00-{'3' * 32}-{CALLER_SPAN}-01{'x' * 4000}\r\n",  # a context that is not one
    ]
    for extra in hostile:
        with rawhttp.connect(builtin) as sock:
            sock.sendall(rawhttp.request_head(length=len(body), extra=extra).replace(b"\xc3\xa9", b"\xe9") + body)
            answer = rawhttp.read_answer(sock)
        assert answer.status == 200, extra
        made = answer.headers["x-request-id"]
        assert len(made) == 32 and made.isalnum() and made not in extra

        def server_span(spans: list[otlp.Span], made: str = made) -> otlp.Span | None:
            found = [s for s in spans if s.kind == "SERVER" and s.attributes.get("imgserve.request_id") == made]
            return found[0] if found else None

        assert receiver.wait(server_span, f"the span of {made}").trace_id != "3" * 32


def test_a_user_api_is_traced_and_a_shed_request_is_a_trace_of_its_own(slow: Server, receiver: otlp.Receiver) -> None:
    """The first request holds the only worker for 2 s; the second waits in the queue with a 1 s deadline (504 at the
    front end, then dropped unrun by the worker); the third, within that second, finds the pod full (503 before any
    ASGI work)."""
    answers: dict[str, httpx.Response] = {}

    def send(name: str, trace_id: str, timeout_s: str = "30") -> None:
        headers = {"content-type": "image/png", "traceparent": traceparent(trace_id), "x-request-id": name}
        headers["x-request-timeout"] = timeout_s
        answers[name] = httpx.post(f"{slow.url}/predict", content=image_bytes(16, 16), headers=headers, timeout=30)

    first = threading.Thread(target=send, args=("slow-1", "4" * 32))
    first.start()
    slow.wait_until_computing()
    late = threading.Thread(target=send, args=("late-1", "5" * 32, "1"))
    late.start()
    wait_until(lambda: slow.metric("imgserve_queue_depth") >= 2, 10, "the second request queued")
    send("shed-1", "6" * 32)
    first.join()
    late.join()
    assert [answers[name].status_code for name in ("slow-1", "late-1", "shed-1")] == [200, 504, 503]
    assert all(answers[name].headers["x-request-id"] == name for name in answers)

    # The server span ends last, and may come in a later export: wait for it too.
    slow_spans = whole_trace(receiver, "4" * 32, {"POST /predict", "predict", "encode_response"})
    check_tree(slow_spans, "POST /predict", "slow-1", "Slow")

    late_spans = whole_trace(receiver, "5" * 32, {"POST /predict", "hand-off", "queue"})
    server, hand_off, queue = (one(late_spans, name) for name in ("POST /predict", "hand-off", "queue"))
    assert (server.status, server.attributes["http.response.status_code"]) == ("ERROR", 504)
    assert server.attributes["imgserve.refusal"] == "deadline"
    assert hand_off.status == "ERROR" and hand_off.attributes["imgserve.refusal"] == "deadline"
    assert queue.status == "ERROR" and queue.attributes["imgserve.refusal"] == "deadline"  # dropped unrun
    assert "batch" not in late_spans and "encode_response" not in late_spans

    shed = whole_trace(receiver, "6" * 32, {"POST /predict"})
    assert list(shed) == ["POST /predict"]  # nothing past the connection layer
    span = one(shed, "POST /predict")
    assert span.parent_id == CALLER_SPAN and span.status == "ERROR"
    assert span.attributes["imgserve.refusal"] == "queue_full" and span.attributes["http.response.status_code"] == 503
    assert span.attributes["imgserve.request_id"] == "shed-1"


def test_grpc_errors_end_their_trace_with_the_grpc_status(builtin: Server, receiver: otlp.Receiver) -> None:
    request = service_pb2.ModelInferRequest(model_name="no-such-model", id="missing-1")
    trace_id = "7" * 32
    with grpc_stub(builtin) as stub, pytest.raises(grpc.RpcError):
        stub.ModelInfer(request, metadata=(("traceparent", traceparent(trace_id)),), timeout=30)
    name = "inference.GRPCInferenceService/ModelInfer"
    server = one(whole_trace(receiver, trace_id, {name}), name)
    assert server.status == "ERROR" and server.attributes["rpc.grpc.status_code"] == grpc.StatusCode.NOT_FOUND.value[0]
    assert server.attributes["imgserve.request_id"] == "missing-1"


def test_a_global_tracer_provider_adds_no_second_server_span(instrumented: Server, receiver: otlp.Receiver) -> None:
    """FastAPI traces every request itself wherever a global provider is set (fastapi >= 0.142), unless imgserve
    turns that off: the trace would hold a second server span, of another service."""
    trace_id = "1af7651916cd43dd8448eb211c80319c"
    headers = {"content-type": "image/png", "traceparent": traceparent(trace_id), "x-request-id": "instrumented-1"}
    answer = httpx.post(f"{instrumented.url}/predict", content=image_bytes(32, 32), headers=headers, timeout=30)
    assert answer.status_code == 200
    whole_trace(receiver, trace_id, {"POST /predict", "predict", "encode_response"})
    time.sleep(1.0)  # a span exported as it ended came long before the batched ones; this is for a slow machine
    spans = whole_trace(receiver, trace_id, set())
    services = {(span.service, span.kind, name) for name, named in spans.items() for span in named}
    assert {service for service, _, _ in services} == {"imgserve"}, sorted(services)
    check_tree(spans, "POST /predict", "instrumented-1", "denoiser")
