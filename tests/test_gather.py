"""How a worker gathers a batch, against LitServe's real Manager queues: block when idle, never wait without cause."""

from __future__ import annotations

import multiprocessing as mp
import threading
import time
from collections.abc import Iterator

import litserve as ls
import pytest
from litserve.loops.base import _SENTINEL_VALUE, _StopLoopError
from litserve.transport.process_transport import MPQueueTransport
from litserve.utils import LitAPIStatus

from service.gather import IDLE_WAIT_S, GatheringLoop
from service.state import SharedState


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


@pytest.fixture
def setup(manager):
    """The loop as a worker runs it (restart_workers on, so it announces START), its queues and shared state."""
    state = SharedState(workers=1)
    loop = GatheringLoop(state)
    loop._restart_workers = True  # what litserve's inference_worker sets when the server restarts workers
    requests, answers = RecordingQueue(manager.Queue()), manager.Queue()
    return loop, state, requests, MPQueueTransport(manager, [answers]), answers


def admit(state: SharedState, count: int) -> None:
    for _ in range(count):
        assert state.try_admit(limit=100)


def request(uid: str, queued_at: float) -> tuple:
    return (0, uid, queued_at, {"pixels": uid})


def started(answers: object) -> list[str]:
    """The uids the loop announced as started, in order."""
    uids = []
    while not answers.empty():
        uid, (_, status, *_) = answers.get()
        assert status == LitAPIStatus.START
        uids.append(uid)
    return uids


def test_an_idle_worker_blocks_on_the_queue_instead_of_polling(setup) -> None:
    loop, state, requests, transport, _ = setup
    assert loop.get_batch_requests(Echo(max_batch_size=4, batch_timeout=0.01), requests, transport) == ([], [])
    # LitServe's BatchedLoop polls with get(timeout=0.001) for the whole batch window, over and over.
    assert requests.reads == [("get", IDLE_WAIT_S)]


def test_a_backlog_is_taken_at_once_up_to_the_batch_size(setup) -> None:
    loop, state, requests, transport, answers = setup
    long_ago = time.monotonic() - 10
    for i in range(6):
        requests.put(request(f"u{i}", long_ago))
    admit(state, 6)
    batch, timed_out = loop.get_batch_requests(Echo(max_batch_size=4, batch_timeout=1.0), requests, transport)
    assert [uid for _, uid, _ in batch] == ["u0", "u1", "u2", "u3"]
    assert batch[0] == (0, "u0", {"pixels": "u0"}) and timed_out == []
    assert requests.reads[1:] == [("get_nowait", None)] * 3, "the window had closed: nothing is waited for"
    assert started(answers) == ["u0", "u1", "u2", "u3"]


def test_a_lone_request_does_not_wait_for_company(setup) -> None:
    loop, state, requests, transport, answers = setup
    requests.put(request("alone", time.monotonic()))
    admit(state, 1)
    batch, _ = loop.get_batch_requests(Echo(max_batch_size=8, batch_timeout=30.0), requests, transport)
    assert [uid for _, uid, _ in batch] == ["alone"]
    assert requests.reads == [("get", IDLE_WAIT_S)], "no other request was admitted, so none was waited for"
    assert started(answers) == ["alone"]


def test_a_batch_waits_within_its_window_for_requests_already_admitted(setup) -> None:
    loop, state, requests, transport, answers = setup
    requests.put(request("first", time.monotonic()))
    admit(state, 2)  # the second is still being read and decoded by the front end
    threading.Timer(0.2, requests.put, args=(request("second", time.monotonic()),)).start()
    batch, _ = loop.get_batch_requests(Echo(max_batch_size=8, batch_timeout=30.0), requests, transport)
    assert [uid for _, uid, _ in batch] == ["first", "second"]
    method, timeout = requests.reads[1]
    assert method == "get" and 0 < timeout <= 30.0
    assert started(answers) == ["first", "second"]


def test_the_stop_sentinel_ends_the_loop(setup) -> None:
    loop, state, requests, transport, _ = setup
    requests.put(_SENTINEL_VALUE)
    with pytest.raises(_StopLoopError):
        loop.get_batch_requests(Echo(max_batch_size=4, batch_timeout=0.01), requests, transport)
