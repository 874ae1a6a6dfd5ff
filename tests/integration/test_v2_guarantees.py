"""/predict's guarantees on the Open Inference Protocol, HTTP, gRPC and gRPC's stream, with a slow toy model: a
request's images are admitted whole or refused whole (503 / UNAVAILABLE with the retry advice; on a stream, that
request's error message, and the stream goes on), and deadlines (Triton's `timeout` parameter, X-Request-Timeout,
the gRPC deadline) answer 504 / DEADLINE_EXCEEDED and drop the work before the model; a drain answers every admitted
call."""

from __future__ import annotations

import base64
import signal
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import grpc
import httpx
import pytest
import toy_models
from safetensors.torch import save_file
from serving import Server, grpc_stub, image_bytes, running_server, start_server, stop_server, wait_ready
from tritonclient.grpc import service_pb2

from imgserve.testing import free_port

MODEL = "Slow"
DELAY_S = 1.0
QUEUE = 4


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    import toy_models
    from safetensors.torch import save_file

    folder = tmp_path_factory.mktemp("slow")
    save_file(toy_models.Slow().state_dict(), str(folder / "Slow.safetensors"))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TOY_DELAY_S", str(DELAY_S))
        with running_server(
            folder,
            model=str(folder / "Slow.safetensors"),
            model_factory="toy_models:Slow",
            grpc_port=free_port(),
            max_batch_size=1,
            batch_timeout_ms=0,
            workers_per_device=1,
            max_queue_depth=QUEUE,
        ) as running:
            yield running


def v2_body(images: int, **parameters: object) -> dict:
    data = [base64.b64encode(image_bytes(8, 8, seed=i)).decode() for i in range(images)]
    return {
        "inputs": [{"name": "image", "datatype": "BYTES", "shape": [images, 1], "data": data}],
        "parameters": parameters,
    }


def grpc_request(images: int, request_id: str = "") -> service_pb2.ModelInferRequest:
    request = service_pb2.ModelInferRequest(model_name=MODEL, id=request_id)
    request.inputs.add(name="image", datatype="BYTES", shape=[images, 1])
    request.outputs.add(name="output_image")
    request.raw_input_contents.append(b"".join(len(p).to_bytes(4, "little") + p for p in [image_bytes(8, 8)] * images))
    return request


def infer(server: Server, images: int, headers: dict | None = None, **parameters: object) -> httpx.Response:
    return httpx.post(
        f"{server.url}/v2/models/{MODEL}/infer", json=v2_body(images, **parameters), headers=headers, timeout=60
    )


def wait_for_depth(server: Server, depth: int) -> None:
    deadline = time.monotonic() + 20
    while server.metric("imgserve_queue_depth") != depth:
        assert time.monotonic() < deadline, "the queue never reached the expected depth"
        time.sleep(0.05)


def settle(server: Server) -> None:
    wait_for_depth(server, 0)
    assert server.slots_freed()


def test_a_request_is_admitted_whole_or_refused_whole(server: Server, stub) -> None:
    settle(server)
    shed_before = server.metric("imgserve_rejected_total", reason="queue_full")
    with ThreadPoolExecutor(2) as pool:
        holding: Future = pool.submit(infer, server, 3)  # three of the four places
        wait_for_depth(server, 3)
        refused = infer(server, 2)
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert list(refused.json()) == ["error"] and "queue is full" in refused.json()["error"]
        with pytest.raises(grpc.RpcError) as caught:
            stub.ModelInfer(grpc_request(2), timeout=30)
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        assert ("retry-after", "1") in tuple(caught.value.trailing_metadata())
        assert server.metric("imgserve_queue_depth") == 3, "a refused request kept some of its places"
        fits = pool.submit(stub.ModelInfer, grpc_request(1), timeout=30)  # the one place left
        assert holding.result().status_code == 200 and holding.result().json()["outputs"][0]["shape"] == [3, 1]
        assert len(fits.result().raw_output_contents) == 1
    assert server.metric("imgserve_rejected_total", reason="queue_full") - shed_before == 2
    settle(server)


def test_deadlines_answer_504_and_drop_the_work_before_the_model(server: Server, stub) -> None:
    settle(server)
    computed_before = server.metric("imgserve_batch_size_sum")
    deadline_before = server.metric("imgserve_rejected_total", reason="deadline")
    with ThreadPoolExecutor(4) as pool:
        busy = pool.submit(infer, server, 1)  # the worker is busy for DELAY_S with this one
        server.wait_until_computing()
        by_parameter = pool.submit(infer, server, 1, timeout=200_000)  # Triton's timeout, in microseconds
        by_header = pool.submit(infer, server, 1, {"X-Request-Timeout": "0.2"})
        with pytest.raises(grpc.RpcError) as caught:
            stub.ModelInfer(grpc_request(1), timeout=0.2)
        assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        for late in (by_parameter.result(), by_header.result()):
            assert late.status_code == 504 and list(late.json()) == ["error"]
        assert busy.result().status_code == 200
    settle(server)
    time.sleep(DELAY_S)  # had the worker taken an expired request, it would be computing it now
    assert server.metric("imgserve_batch_size_sum") - computed_before == 1, "an expired request was computed"
    assert server.metric("imgserve_rejected_total", reason="deadline") - deadline_before >= 3


def test_a_grpc_call_ended_by_grpc_is_counted_as_what_ended_it(server: Server, stub) -> None:
    """gRPC cancels the handler when the client's deadline passes or the client leaves, sometimes before imgserve's
    own timer fires: a deadline is still counted 504 (and a deadline rejection), a client that left 499, never 200."""
    settle(server)

    def infer_codes(code: str) -> float:
        return server.metric("imgserve_requests_total", route="grpc/ModelInfer", code=code)

    before = {code: infer_codes(code) for code in ("200", "499", "504")}
    deadline_before = server.metric("imgserve_rejected_total", reason="deadline")
    with ThreadPoolExecutor(1) as pool:
        busy = pool.submit(infer, server, 1)
        server.wait_until_computing()
        left = stub.ModelInfer.future(grpc_request(1), timeout=30)
        wait_for_depth(server, 2)
        late = [stub.ModelInfer.future(grpc_request(1), timeout=0.2) for _ in range(QUEUE - 2)]
        left.cancel()
        assert [call.exception().code() for call in late] == [grpc.StatusCode.DEADLINE_EXCEEDED] * len(late)
        assert busy.result().status_code == 200
    settle(server)
    assert infer_codes("504") - before["504"] == len(late)
    assert infer_codes("499") - before["499"] == 1
    assert infer_codes("200") == before["200"]
    assert server.metric("imgserve_rejected_total", reason="deadline") - deadline_before == len(late)


def test_a_grpc_server_side_deadline_is_deadline_exceeded(server: Server, stub) -> None:
    settle(server)
    request = grpc_request(1)
    request.parameters["timeout"].int64_param = 1  # one microsecond: gone before any worker can take it
    with pytest.raises(grpc.RpcError) as caught:
        stub.ModelInfer(request, timeout=30)
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    settle(server)


def streamed(stub, steps: list[service_pb2.ModelInferRequest | Callable[[], None]], timeout: float = 60) -> dict:
    """ModelStreamInfer with the call's `timeout`: each request of `steps` sent in turn (a callable step runs between
    them), then the client's side closed; every answer by its request's id, as (error message, answer)."""

    def requests() -> Iterator[service_pb2.ModelInferRequest]:
        for step in steps:
            if isinstance(step, service_pb2.ModelInferRequest):
                yield step
            else:
                step()

    answers = {}
    for answer in stub.ModelStreamInfer(requests(), timeout=timeout):
        answers[answer.infer_response.id] = (answer.error_message, answer.infer_response)
    return answers


def test_a_stream_refuses_what_does_not_fit_on_the_stream_and_goes_on(server: Server, stub) -> None:
    """One stream: three images take three of the four places; two more are refused whole (an error message with
    the retry advice, the request's id); the one that fits, sent after, is answered on the same stream."""
    settle(server)
    refused_before = server.metric("imgserve_requests_total", route="grpc/ModelInfer", code="503")
    steps = [
        grpc_request(3, "three"),
        lambda: wait_for_depth(server, 3),
        grpc_request(2, "two"),
        grpc_request(1, "one"),
    ]
    answers = streamed(stub, steps)
    assert set(answers) == {"three", "two", "one"}
    error, _ = answers["two"]
    assert "queue is full" in error and "retry after 1 s" in error
    assert [(answers[name][0], len(answers[name][1].raw_output_contents)) for name in ("three", "one")] == [("", 1)] * 2
    assert answers["three"][1].outputs[0].shape == [3, 1]
    assert server.metric("imgserve_requests_total", route="grpc/ModelInfer", code="503") - refused_before == 1
    settle(server)


def test_a_streams_deadlines_answer_on_the_stream_and_drop_the_work(server: Server, stub) -> None:
    """A stream's request with Triton's `timeout` that runs out in the queue is answered with its error and never
    computed, while the stream's other request is answered; a stream whose own deadline passes with a request
    queued ends that request (its error, or the call's DEADLINE_EXCEEDED), counted 504 either way."""
    settle(server)
    computed_before = server.metric("imgserve_batch_size_sum")
    late_before = server.metric("imgserve_requests_total", route="grpc/ModelInfer", code="504")
    with ThreadPoolExecutor(1) as pool:
        busy = pool.submit(infer, server, 1)
        server.wait_until_computing()
        late = grpc_request(1, "late")
        late.parameters["timeout"].int64_param = 200_000  # microseconds
        answers = streamed(stub, [late, grpc_request(1, "waits")])
        assert "deadline" in answers["late"][0] and answers["waits"][0] == ""
        assert busy.result().status_code == 200
        busy = pool.submit(infer, server, 1)
        server.wait_until_computing()
        try:  # imgserve's timer (the call's deadline is the request's) or gRPC's, whichever fires first
            error = streamed(stub, [grpc_request(1, "queued")], timeout=0.3)["queued"][0]
        except grpc.RpcError as ended:
            error = str(ended.code())
        assert "deadline" in error.lower(), error
        assert busy.result().status_code == 200
    settle(server)
    time.sleep(DELAY_S)  # had the worker taken an expired request, it would be computing it now
    assert server.metric("imgserve_batch_size_sum") - computed_before == 3, "an expired request was computed"
    assert server.metric("imgserve_requests_total", route="grpc/ModelInfer", code="504") - late_before == 2


def test_sigterm_answers_in_flight_grpc_calls_and_refuses_new_ones(tmp_path, monkeypatch) -> None:
    """Draining: every admitted gRPC call gets its answer, a new one UNAVAILABLE, then the server exits 0."""
    save_file(toy_models.Slow().state_dict(), str(tmp_path / "Slow.safetensors"))
    monkeypatch.setenv("TOY_DELAY_S", "0.7")
    settings = dict(model=str(tmp_path / "Slow.safetensors"), model_factory="toy_models:Slow", max_batch_size=1)
    server = start_server(
        {**settings, "batch_timeout_ms": 0, "drain_timeout_s": 20, "grpc_port": free_port()}, tmp_path
    )
    try:
        wait_ready(server)
        with grpc_stub(server) as stub:
            in_flight = [stub.ModelInfer.future(grpc_request(1), timeout=30) for _ in range(3)]
            wait_for_depth(server, 3)
            server.process.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 10
            while stub.ServerReady(service_pb2.ServerReadyRequest(), timeout=5).ready:
                assert time.monotonic() < deadline, "the server never started draining"
                time.sleep(0.05)
            with pytest.raises(grpc.RpcError) as caught:
                stub.ModelInfer(grpc_request(1), timeout=10)
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
            assert [len(call.result().raw_output_contents) for call in in_flight] == [1, 1, 1]
        assert server.process.wait(timeout=30) == 0
    finally:
        stop_server(server)
