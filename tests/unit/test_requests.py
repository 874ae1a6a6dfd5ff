"""The workers' request socket (handoff/requests.py): each request reaches exactly one worker, whole, and a worker
killed while it waits leaves nothing behind that stops the others."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import time
from pathlib import Path
from queue import Empty
from typing import Any

import pytest

from imgserve.handoff import wire
from imgserve.handoff.items import InSlot
from imgserve.handoff.requests import RequestSocket

SPAWN = mp.get_context("spawn")  # a worker gets its arguments pickled, from the fork server as from spawn


def request(uid: str, slot: int = 0) -> wire.RequestMessage:
    """A request message as a worker receives it."""
    item = {"image": InSlot(0, (8, 8, 3), "|u1"), "threshold": 0.5}
    return wire.RequestMessage(0, uid, slot, 1, 0, 1.0, 2.0, item)


def packed(uid: str, slot: int = 0) -> bytes:
    """The same request as a front end sends it."""
    return wire.pack_request(request(uid, slot))


def receive_all(requests: Any, results: Any, idle_s: float, started: Any = None) -> None:
    """A worker: take requests (1 ms of work each) until none comes for `idle_s`, then report what it took."""
    if started is not None:
        started.wait(60)
    taken = []
    while True:
        try:
            taken.append(requests.get(timeout=idle_s))
        except Empty:
            break
        time.sleep(0.001)
    results.put((os.getpid(), taken))


def wait_forever(requests: Any, ready: Any) -> None:
    """A worker that is killed while it waits for a request."""
    ready.set()
    while True:
        with contextlib.suppress(Empty):
            requests.get(timeout=0.05)


def collect(results: Any, count: int) -> dict[int, list]:
    return dict(results.get(timeout=60) for _ in range(count))


def test_every_request_reaches_exactly_one_worker(tmp_path: Path) -> None:
    requests, results, started = RequestSocket(tmp_path), SPAWN.Queue(), SPAWN.Barrier(4)
    workers = [SPAWN.Process(target=receive_all, args=(requests, results, 2.0, started)) for _ in range(3)]
    for worker in workers:
        worker.start()
    started.wait(60)
    sent = [request(f"uid-{i}", i) for i in range(400)]
    for message in sent:
        requests.put(wire.pack_request(message))
    taken = collect(results, len(workers))
    for worker in workers:
        worker.join(timeout=30)
    everything = [message for messages in taken.values() for message in messages]
    assert sorted(everything, key=lambda m: m.uid) == sorted(sent, key=lambda m: m.uid)  # all of them, once each
    assert all(taken.values())  # shared among the workers, not one taking everything


def test_a_worker_killed_while_waiting_does_not_stop_the_others(tmp_path: Path) -> None:
    """kill -9 of a worker blocked in `get`: the survivor still takes every request (with a multiprocessing.Queue
    the killed worker would keep the reader lock, and the survivor would wait forever: see the control below)."""
    requests, results, ready = RequestSocket(tmp_path), SPAWN.Queue(), SPAWN.Event()
    doomed = SPAWN.Process(target=wait_forever, args=(requests, ready))
    doomed.start()
    assert ready.wait(60)
    time.sleep(0.3)  # well inside its get
    os.kill(doomed.pid, signal.SIGKILL)
    doomed.join(timeout=10)
    survivor = SPAWN.Process(target=receive_all, args=(requests, results, 2.0))
    survivor.start()
    for i in range(50):
        requests.put(packed(f"message-{i}"))
    (taken,) = collect(results, 1).values()
    survivor.join(timeout=30)
    assert taken == [request(f"message-{i}") for i in range(50)]


def test_control_a_multiprocessing_queue_is_stopped_by_a_killed_reader() -> None:
    """Why the socket: the same kill leaves a multiprocessing.Queue unreadable for everyone else."""
    requests, ready = SPAWN.Queue(), SPAWN.Event()
    doomed = SPAWN.Process(target=_wait_on_queue, args=(requests, ready))
    doomed.start()
    assert ready.wait(60)
    time.sleep(0.3)
    os.kill(doomed.pid, signal.SIGKILL)
    doomed.join(timeout=10)
    requests.put("message")
    with pytest.raises(Empty):
        requests.get(timeout=1.0)


def _wait_on_queue(requests: Any, ready: Any) -> None:
    ready.set()
    requests.get()


def test_get_waits_at_most_its_timeout(tmp_path: Path) -> None:
    requests = RequestSocket(tmp_path)
    with pytest.raises(Empty):
        requests.get_nowait()
    with pytest.raises(Empty):
        requests.get(timeout=0.2)
    requests.put(packed("one"))
    assert requests.get(timeout=5) == request("one")


def test_an_event_loop_send_never_blocks_it_says_when_the_queue_is_full(tmp_path: Path) -> None:
    """put_nowait (what a front end's event loop calls) sends while there is room and returns False, sending
    nothing, once no worker has read for long enough; a blocking put then waits for room."""
    requests = RequestSocket(tmp_path)
    sent = 0
    while sent < 100_000 and requests.put_nowait(packed(f"uid-{sent}", sent)):
        sent += 1
    assert 0 < sent < 100_000  # the kernel's queue filled up
    assert not requests.put_nowait(packed("one too many"))
    assert requests.get(timeout=1).uid == "uid-0"  # in order, and the refused one was not queued
    assert requests.put_nowait(packed("room again"))
    received = [requests.get(timeout=1).uid for _ in range(sent)]
    assert received[-1] == "room again" and "one too many" not in received


def test_a_datagram_that_is_not_a_request_is_dropped_and_the_next_request_taken(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Whatever lands on the socket (garbage, a request cut short by the receive size), `get` logs and drops it and
    returns the next real request."""
    requests = RequestSocket(tmp_path)
    huge = wire.pack_request(wire.RequestMessage(0, "huge", 0, 1, 0, 1.0, 2.0, "x" * 20_000))
    for data in (b"\x93garbage", huge, packed("real")):
        requests.put(data)
    with caplog.at_level("WARNING", logger="imgserve.handoff.requests"):
        assert requests.get(timeout=5) == request("real")
    assert caplog.text.count("dropped a datagram") == 2
