"""How a worker gathers a batch, against LitServe's real Manager queues: block when idle, never wait without cause,
and mark in shared memory which worker took which request."""

from __future__ import annotations

import multiprocessing as mp
import threading
import time
from collections.abc import Iterator

import litserve as ls
import pytest
from litserve.transport.process_transport import MPQueueTransport

from imgserve.handoff.state import SharedState
from imgserve.worker.gather import IDLE_WAIT_S, GatheringLoop, QueueGone


class Echo(ls.LitAPI):
    def setup(self, device: str) -> None:
        pass

    def predict(self, x: object) -> object:
        return x


class RecordingQueue:
    """A real Manager queue that records each read the loop makes: (method, timeout)."""

    def __init__(self, queue: object) -> None:
        self.queue, self.reads = queue, []

    def put(self, item: object) -> None:
        self.queue.put(item)

    def get(self, timeout: float) -> object:
        self.reads.append(("get", timeout))
        return self.queue.get(timeout=timeout)

    def get_nowait(self) -> object:
        self.reads.append(("get_nowait", None))
        return self.queue.get_nowait()


@pytest.fixture(scope="module")
def manager() -> Iterator[object]:
    with mp.get_context("spawn").Manager() as running:
        yield running


WORKER = 3


@pytest.fixture
def setup(manager, monkeypatch):
    """The loop as worker 3 runs it, its queues, and the shared state with one slot per request of these tests."""
    monkeypatch.setenv("LITSERVE_WORKER_ID", str(WORKER))  # what litserve's inference_worker sets
    state = SharedState(workers=WORKER + 1, request_slots=8)
    for slot in range(8):
        state.set_owner(slot, 100 + slot)  # what each request's front end did when it put it in its slot
    requests, answers = RecordingQueue(manager.Queue()), manager.Queue()
    return GatheringLoop(state), state, requests, MPQueueTransport(manager, [answers]), answers


def admit(state: SharedState, count: int) -> None:
    for _ in range(count):
        assert state.try_admit(limit=100)


def request(index: int, queued_at: float) -> tuple:
    """Request `index` as a front end queues it: in slot `index`, with ticket 100 + index."""
    return (0, f"u{index}", queued_at, {"pixels": index, "slot": (index, 100 + index)})


def taken(state: SharedState) -> list[int]:
    """The slots whose request worker 3 has taken."""
    return [slot for slot in range(8) if state.taken_by(slot, 100 + slot) == WORKER]


def test_an_idle_worker_blocks_on_the_queue_instead_of_polling(setup) -> None:
    loop, state, requests, transport, answers = setup
    assert loop.gather_batch(Echo(max_batch_size=4, batch_timeout=0.01), requests) == []
    # LitServe's BatchedLoop polls with get(timeout=0.001) for the whole batch window, over and over.
    assert requests.reads == [("get", IDLE_WAIT_S)]
    assert answers.empty()


def test_a_backlog_is_taken_at_once_up_to_the_batch_size(setup) -> None:
    loop, state, requests, transport, answers = setup
    long_ago = time.monotonic() - 10
    for i in range(6):
        requests.put(request(i, long_ago))
    admit(state, 6)
    batch = loop.gather_batch(Echo(max_batch_size=4, batch_timeout=1.0), requests)
    assert [uid for _, uid, _ in batch] == ["u0", "u1", "u2", "u3"]
    assert batch[0] == (0, "u0", {"pixels": 0, "slot": (0, 100)})
    assert requests.reads[1:] == [("get_nowait", None)] * 3, "the window had closed: nothing is waited for"
    assert taken(state) == [0, 1, 2, 3], "the two still queued are not marked"
    assert answers.empty(), "no START message per request through the queue process"


def test_a_lone_request_does_not_wait_for_company(setup) -> None:
    loop, state, requests, transport, answers = setup
    requests.put(request(5, time.monotonic()))
    admit(state, 1)
    batch = loop.gather_batch(Echo(max_batch_size=8, batch_timeout=30.0), requests)
    assert [uid for _, uid, _ in batch] == ["u5"]
    assert requests.reads == [("get", IDLE_WAIT_S)], "no other request was admitted, so none was waited for"
    assert taken(state) == [5]


def test_a_batch_waits_within_its_window_for_requests_already_admitted(setup) -> None:
    loop, state, requests, transport, answers = setup
    requests.put(request(0, time.monotonic()))
    admit(state, 2)  # the second is still being read and decoded by the front end
    threading.Timer(0.2, requests.put, args=(request(1, time.monotonic()),)).start()
    batch = loop.gather_batch(Echo(max_batch_size=8, batch_timeout=30.0), requests)
    assert [uid for _, uid, _ in batch] == ["u0", "u1"]
    method, timeout = requests.reads[1]
    assert method == "get" and 0 < timeout <= 30.0
    assert taken(state) == [0, 1]


def test_a_request_whose_slot_moved_on_is_dropped_and_the_next_one_taken(setup) -> None:
    loop, state, requests, transport, answers = setup
    state.set_owner(1, 999)  # its front end gave request 101 up long ago and put request 999 in slot 1
    requests.put(request(1, time.monotonic()))
    requests.put(request(2, time.monotonic()))
    admit(state, 2)
    batch = loop.gather_batch(Echo(max_batch_size=8, batch_timeout=0.05), requests)
    assert [uid for _, uid, _ in batch] == ["u2"]
    assert state.taken_by(1, 101) is None and state.taken_by(1, 999) is None, "slot 1's new request is untouched"
    assert answers.empty()


def test_a_stale_ticket_in_a_reused_slot_is_not_taken_for_the_new_request() -> None:
    state = SharedState(workers=2, request_slots=4)
    state.set_owner(2, 7)
    assert state.mark_taken(2, ticket=7, worker=1)
    assert state.taken_by(2, ticket=7) == 1
    assert state.taken_by(2, ticket=9) is None, "slot 2 now holds request 9, still queued"
    assert state.taken_by(3, ticket=7) is None


@pytest.fixture
def doomed_queue() -> Iterator[tuple[object, object]]:
    """A request queue whose Manager process the test may stop (the queue is then gone, as when the server stops):
    (its manager, the queue as the loop reads it)."""
    running = mp.get_context("spawn").Manager()
    try:
        yield running, RecordingQueue(running.Queue())
    finally:
        running.shutdown()


def test_a_queue_that_is_gone_ends_the_loop(setup, doomed_queue) -> None:
    """Once the request queue's process is gone, reading it ends the worker's loop (no stop message is needed)."""
    loop, state, _, transport, answers = setup
    doomed, requests = doomed_queue
    doomed.shutdown()
    with pytest.raises(QueueGone):
        loop.gather_batch(Echo(max_batch_size=4, batch_timeout=0.01), requests)
    loop.run_batched_loop(Echo(max_batch_size=4, batch_timeout=0.01), requests, transport, callback_runner=None)
    assert answers.empty()


class FailsOnTwoAndThree(Echo):
    def predict(self, x: object) -> object:
        if any(payload["pixels"] in (2, 3) for payload in x):
            raise RuntimeError("the model broke")
        return x


def test_the_loop_answers_each_request_of_a_batch_and_fails_a_whole_batch_whose_predict_raised(
    setup, doomed_queue
) -> None:
    """imgserve's own loop (LitServe's adds six hooks per batch): one answer per request, OK with predict's answer,
    or ERROR for every request of a batch whose predict raised; the loop goes on to the next batch either way, and
    ends when its queue is gone."""
    loop, state, _, transport, answers = setup
    doomed, requests = doomed_queue
    long_ago = time.monotonic() - 10
    for i in range(5):
        requests.put(request(i, long_ago))
    admit(state, 5)
    api = FailsOnTwoAndThree(max_batch_size=2, batch_timeout=0.01)
    runs = threading.Thread(target=loop.run_batched_loop, args=(api, requests, transport, None))
    runs.start()
    got = [answers.get(timeout=10) for _ in range(5)]
    doomed.shutdown()
    runs.join(timeout=10)
    assert not runs.is_alive(), "the loop ended once its queue was gone"
    ok, error = ls.utils.LitAPIStatus.OK, ls.utils.LitAPIStatus.ERROR
    assert [(uid, output if status == error else output["pixels"], status) for uid, (output, status, *_) in got] == [
        ("u0", 0, ok),
        ("u1", 1, ok),
        ("u2", None, error),
        ("u3", None, error),
        ("u4", 4, ok),  # taken after the failed batch: the loop went on
    ]
    assert answers.empty()
