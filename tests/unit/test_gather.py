"""How a worker gathers a batch off the real request sockets (one per model): block when idle, never wait without
cause, take the models in turns, mark in shared memory which worker took which request; and how its loop answers each
request of a batch."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from imgserve.errors import ApiError
from imgserve.handoff import wire
from imgserve.handoff.answers import AnswerSockets
from imgserve.handoff.requests import ModelRequests, RequestSocket
from imgserve.handoff.state import SharedState
from imgserve.handoff.wire import RequestMessage
from imgserve.worker import process
from imgserve.worker.gather import IDLE_WAIT_S, Gatherer

WORKER = 3


class RecordingSocket(RequestSocket):
    """The real request socket, recording each read the gatherer makes: (method, timeout)."""

    def __init__(self, directory: Path, name: str) -> None:
        super().__init__(directory, name)
        self.reads: list[tuple[str, float | None]] = []

    def get(self, block: bool = True, timeout: float | None = None) -> RequestMessage:
        self.reads.append(("get", timeout) if block else ("get_nowait", None))
        return super().get(block, timeout)


class RecordingRequests(ModelRequests):
    """The real sockets of each model, recording the reads."""

    @staticmethod
    def socket(directory: Path, model: int) -> RequestSocket:
        return RecordingSocket(directory, f"requests-{model}")


@pytest.fixture
def setup(tmp_path: Path) -> tuple[Gatherer, SharedState, RecordingSocket]:
    """Worker 3's gatherer, its one model's socket, and the shared state with one slot per request of these tests."""
    state = SharedState(workers=WORKER + 1, request_slots=8)
    for slot in range(8):
        state.set_owner(slot, 100 + slot)  # what each request's front end did when it put it in its slot
    requests = RecordingRequests(tmp_path, 1)
    return Gatherer(requests, state, WORKER), state, requests[0]  # type: ignore[return-value]


def admit(state: SharedState, count: int) -> None:
    for _ in range(count):
        assert state.try_admit(limit=100)


def request(index: int, admitted: float) -> RequestMessage:
    """Request `index` as a front end queues it: in slot `index`, with ticket 100 + index."""
    return RequestMessage(0, f"u{index}", index, 100 + index, 0, admitted, admitted + 60, {"pixels": index})


def put(requests: RequestSocket, message: RequestMessage) -> None:
    requests.put(wire.pack_request(message))


def taken(state: SharedState) -> list[int]:
    """The slots whose request worker 3 has taken."""
    return [slot for slot in range(8) if state.taken_by(slot, 100 + slot) == WORKER]


def test_an_idle_worker_blocks_on_the_sockets_instead_of_polling(setup) -> None:
    gatherer, state, requests = setup
    started = time.monotonic()
    assert gatherer.batch(lambda model: 4, lambda model: 0.01) == []
    assert requests.reads == [], "nothing is read before a socket has a request"
    assert time.monotonic() - started >= IDLE_WAIT_S * 0.9, "it waited on the sockets"


def test_a_backlog_is_taken_at_once_up_to_the_batch_size(setup) -> None:
    gatherer, state, requests = setup
    long_ago = time.monotonic() - 10
    for i in range(6):
        put(requests, request(i, long_ago))
    admit(state, 6)
    batch = gatherer.batch(lambda model: 4, lambda model: 1.0)
    assert [message.uid for message in batch] == ["u0", "u1", "u2", "u3"]
    assert batch[0] == request(0, long_ago)
    assert requests.reads == [("get_nowait", None)] * 4, "the window had closed: nothing is waited for"
    assert taken(state) == [0, 1, 2, 3], "the two still queued are not marked"


def test_a_lone_request_does_not_wait_for_company(setup) -> None:
    gatherer, state, requests = setup
    put(requests, request(5, time.monotonic()))
    admit(state, 1)
    batch = gatherer.batch(lambda model: 8, lambda model: 30.0)
    assert [message.uid for message in batch] == ["u5"]
    assert requests.reads == [("get_nowait", None)], "no other request was admitted, so none was waited for"
    assert taken(state) == [5]


def test_a_batch_waits_within_its_window_for_requests_already_admitted(setup) -> None:
    gatherer, state, requests = setup
    put(requests, request(0, time.monotonic()))
    admit(state, 2)  # the second is still being read and decoded by the front end
    threading.Timer(0.2, put, args=(requests, request(1, time.monotonic()))).start()
    batch = gatherer.batch(lambda model: 8, lambda model: 30.0)
    assert [message.uid for message in batch] == ["u0", "u1"]
    method, timeout = requests.reads[1]
    assert method == "get" and timeout is not None and 0 < timeout <= 30.0
    assert taken(state) == [0, 1]


def test_a_request_whose_slot_moved_on_is_dropped_and_the_next_one_taken(setup) -> None:
    gatherer, state, requests = setup
    state.set_owner(1, 999)  # its front end gave request 101 up long ago and put request 999 in slot 1
    put(requests, request(1, time.monotonic()))
    put(requests, request(2, time.monotonic()))
    admit(state, 2)
    batch = gatherer.batch(lambda model: 8, lambda model: 0.05)
    assert [message.uid for message in batch] == ["u2"]
    assert state.taken_by(1, 101) is None and state.taken_by(1, 999) is None, "slot 1's new request is untouched"


def test_each_model_has_its_queue_and_the_worker_takes_the_models_in_turns(tmp_path: Path) -> None:
    """A backlog of one model and a lone request of another: the other's request gets the next batch, not one after
    the whole backlog; no batch mixes models."""
    state = SharedState(workers=WORKER + 1, request_slots=16, models=2)
    requests = ModelRequests(tmp_path, 2)
    gatherer = Gatherer(requests, state, WORKER)
    long_ago = time.monotonic() - 10
    for i in range(9):  # a socket queues 10 datagrams (net.unix.max_dgram_qlen); a front end's sender thread waits
        model = 1 if i == 8 else 0
        state.set_owner(i, 100 + i)
        put(requests[model], RequestMessage(0, f"u{i}", i, 100 + i, model, long_ago, long_ago + 60, {"pixels": i}))
        assert state.try_admit(limit=100, model=model)
    batches = [gatherer.batch(lambda model: 4, lambda model: 1.0) for _ in range(5)]
    made = [[message.uid for message in batch] for batch in batches]
    assert made == [["u0", "u1", "u2", "u3"], ["u8"], ["u4", "u5", "u6", "u7"], [], []]


def test_a_stale_ticket_in_a_reused_slot_is_not_taken_for_the_new_request() -> None:
    state = SharedState(workers=2, request_slots=4)
    state.set_owner(2, 7)
    assert state.mark_taken(2, ticket=7, worker=1)
    assert state.taken_by(2, ticket=7) == 1
    assert state.taken_by(2, ticket=9) is None, "slot 2 now holds request 9, still queued"
    assert state.taken_by(3, ticket=7) is None


class FailsOnTwoAndThree:
    """A worker whose batch fails outside the API's hooks when it holds request 2 or 3."""

    ran = None  # what its last batch noted for its spans: nothing

    def batch_size(self, model: int) -> int:
        return 2

    def batch_timeout_s(self, model: int) -> float:
        return 0.01

    def answer(self, requests: list[RequestMessage]) -> list[Any]:
        if any(message.item["pixels"] in (2, 3) for message in requests):
            raise RuntimeError("the worker broke")
        return [message.item for message in requests]

    def release_memory(self) -> None:
        pass


def test_the_loop_answers_each_request_and_a_batch_that_failed_outside_the_hooks_with_500s(setup, tmp_path) -> None:
    """One answer per request to its front end: the worker's, or a 500 for each request of a batch that failed
    outside the API's hooks; the loop goes on to the next batch."""
    gatherer, state, requests = setup
    answers = AnswerSockets(tmp_path, front_ends=1)
    receiver = answers.receiver(0)
    long_ago = time.monotonic() - 10
    for i in range(5):
        put(requests, request(i, long_ago))
    admit(state, 5)
    worker: Any = FailsOnTwoAndThree()
    control = process.Control(worker, None)
    threading.Thread(target=process.serve, args=(worker, gatherer, answers, control), daemon=True).start()
    got: list[tuple[str, Any]] = []
    deadline = time.monotonic() + 10
    while len(got) < 5 and time.monotonic() < deadline:
        got += list(receiver.receive_ready())
        time.sleep(0.01)
    outputs = [(uid, output["pixels"] if isinstance(output, dict) else output.status) for uid, output in got]
    assert outputs == [("u0", 0), ("u1", 1), ("u2", 500), ("u3", 500), ("u4", 4)]
    assert all(isinstance(output, ApiError) for uid, output in got if uid in ("u2", "u3"))
