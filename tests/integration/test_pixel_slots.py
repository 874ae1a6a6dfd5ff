"""Pixels through shared-memory slots: what crosses the hand-off's sockets is small, slots are freed on every path, and
/dev/shm and memory are back at their baseline after a flood, a kill -9 of a worker and a SIGTERM."""

from __future__ import annotations

import asyncio
import os
import signal
import stat
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from serving import image_bytes, start_server, stop_server, wait_ready

from imgserve.api import ImageAPI, Request
from imgserve.config import Batching, Settings
from imgserve.errors import ApiError
from imgserve.handoff import items, wire
from imgserve.handoff import slots as pixel_slots
from imgserve.handoff.answers import AnswerSockets
from imgserve.handoff.directory import LOCK, PREFIX, SCRATCH_PREFIX, ServerDirectory
from imgserve.handoff.dispatch import WORKER_CHECK_S, Dispatcher
from imgserve.handoff.items import InSlot
from imgserve.handoff.requests import ModelRequests
from imgserve.handoff.slots import SlotFiles
from imgserve.handoff.state import SharedState
from imgserve.models.builtin import LocalKinds, ModelAPI
from imgserve.models.denoiser import build_denoiser
from imgserve.models.shared import SharedWeights
from imgserve.pod import TorchThreads
from imgserve.served import Catalog, ServedModel
from imgserve.testing import InProcess
from imgserve.worker.serving import Worker, WorkerPlan
from loadtests.lib.closed_loop import run_closed_loop
from loadtests.lib.images import square_jpegs

SMALL_MESSAGE = 1024  # bytes: a request or an answer as it crosses the queues, whatever the image size
ONE_THREAD = TorchThreads(1, 1)


@pytest.fixture
def slot_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "slots"
    directory.mkdir()
    return directory


def test_a_slot_round_trips_arrays_and_gives_big_ones_memory_back(slot_dir: Path) -> None:
    files = SlotFiles(slot_dir)
    image = np.random.default_rng(0).integers(0, 256, (300, 200, 3), dtype=np.uint8)
    files.write(3, image)
    assert (files.read(3, image.shape) == image).all()
    assert pixel_slots.bytes_in_use(slot_dir) >= image.nbytes
    files.trim(3)  # under KEEP_BYTES: kept for the next request
    assert pixel_slots.bytes_in_use(slot_dir) >= image.nbytes
    files.trim(3, keep_bytes=0)
    assert pixel_slots.bytes_in_use(slot_dir) == 0
    with pytest.raises(ApiError):  # the slot is empty now: a short read is an error, not garbage
        files.read(3, image.shape)
    files.close()


def test_a_new_server_removes_the_directories_of_dead_servers_only(tmp_path: Path) -> None:
    """Stale: ours and unlocked. Kept: a live server's (locked), one being made (no lock yet, young), another user's
    or a symlink (never followed). A file planted where a lock would be cannot stop the start."""
    dead = ServerDirectory.create(tmp_path, tmp_path)
    (dead.slots / "0").write_bytes(b"pixels")
    (dead.scratch / "aotinductor_x").mkdir()
    for lock_fd in dead._lock_fds:  # the server was killed: nobody holds its locks now
        os.close(lock_fd)
    live = ServerDirectory.create(tmp_path, tmp_path)  # removes `dead`'s two
    assert not dead.root.exists() and not dead.scratch.exists()
    assert live.root.is_dir() and live.scratch.is_dir() and live.scratch.name.startswith(SCRATCH_PREFIX)
    being_made = tmp_path / f"{PREFIX}being-made"
    being_made.mkdir()
    target = tmp_path / "someone-elses"
    target.mkdir()
    (target / "keep").write_text("x")
    (tmp_path / f"{PREFIX}symlink").symlink_to(target)
    planted = tmp_path / f"{PREFIX}planted"
    planted.mkdir()
    (planted / LOCK).symlink_to(target / "keep")
    os.utime(planted, (0, 0))  # old: its lock is tried, through no symlink
    third = ServerDirectory.create(tmp_path, tmp_path)
    assert live.root.is_dir() and (live.root / LOCK).exists(), "a live server's directory was removed"
    assert live.scratch.is_dir() and (live.scratch / LOCK).exists(), "a live server's scratch directory was removed"
    assert being_made.is_dir() and (target / "keep").read_text() == "x"
    assert third.root.is_dir() and stat.S_IMODE(third.root.stat().st_mode) == 0o700
    for directory in (live, third):
        directory.remove()
    assert not live.root.exists() and not third.root.exists() and not live.scratch.exists()


def test_the_scratch_directory_is_tmpdir_while_the_server_runs_and_spares_a_users_own_folders(
    tmp_path: Path, monkeypatch
) -> None:
    """The temporary directory is shared with the user's own files: only imgserve-scratch-* folders are ever taken
    for a dead server's. Inside `temporary_files` TMPDIR and Python's tempfile name the scratch directory (what the
    server's children inherit); afterwards the caller's own TMPDIR is back."""
    shm, temporary = tmp_path / "shm", tmp_path / "tmp"
    shm.mkdir()
    temporary.mkdir()
    users_own = temporary / f"{PREFIX}checkout"
    users_own.mkdir()
    os.utime(users_own, (0, 0))  # old and without a lock: what a dead server's folder being made looks like
    monkeypatch.setenv("TMPDIR", str(temporary))
    directory = ServerDirectory.create(shm, temporary)
    assert users_own.is_dir(), "a folder of the user's was taken for a dead server's"
    callers = tempfile.gettempdir()
    with directory.temporary_files():
        assert os.environ["TMPDIR"] == str(directory.scratch) == tempfile.gettempdir()
        made = Path(tempfile.mkdtemp())
        assert made.parent == directory.scratch
    assert os.environ["TMPDIR"] == str(temporary) and tempfile.gettempdir() == callers
    directory.remove()
    assert not made.exists() and not directory.scratch.exists()


def worker_plan(slot_dir: Path, batch_size: int, threads: TorchThreads = ONE_THREAD) -> tuple[WorkerPlan, Batching]:
    """One worker alone on its device, loading its own copy of the model; its batching."""
    return WorkerPlan(slot_dir, threads, False, False), Batching(max_batch_size=batch_size)


def set_up(api: ImageAPI, state: SharedState, plan: tuple[WorkerPlan, Batching]) -> Worker:
    """A worker's one model set up on the CPU, as a worker process does it (its own copy of the weights)."""
    catalog = Catalog([ServedModel(0, "model", api, plan[1])])
    worker = Worker(catalog, state, plan[0], 0, "cpu")
    worker.set_up(0, SharedWeights(0, reason="a test worker"))
    return worker


def queued(files: SlotFiles, state: SharedState, slot: int, ticket: int, item: Any) -> wire.RequestMessage:
    """What a front end sends for `item` (what decode_request returned) in `slot`: its arrays in the slot, the
    rest in the message, as the worker receives it."""
    state.set_owner(slot, ticket)
    placed = items.place(item, lambda array, offset: files.write(slot, array, offset), inline_bytes=1024)
    now = time.monotonic()
    return wire.RequestMessage(0, f"uid-{ticket}", slot, ticket, 0, now, now + 30, placed)


@pytest.fixture
def restore_threads() -> Iterator[None]:
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_the_worker_reads_pixels_from_the_slot_and_answers_with_a_few_bytes(
    slot_dir: Path, restore_threads: None
) -> None:
    settings = Settings(max_batch_size=4)
    state = SharedState(workers=1, request_slots=8)
    worker = set_up(ModelAPI(settings, LocalKinds(), pad=False), state, worker_plan(slot_dir, 4))
    front_end = ModelAPI(settings, LocalKinds(), pad=False)  # the same API as a front end decodes with it
    images = [np.random.default_rng(i).integers(0, 256, (256, 320, 3), dtype=np.uint8) for i in range(3)]
    files = SlotFiles(slot_dir)
    requests = [
        queued(files, state, slot, 10 + slot, front_end.decode_request(Request.for_image(image)))
        for slot, image in enumerate(images)
    ]
    assert all(isinstance(request.item, InSlot) for request in requests), "the pixels are not in the slots"
    answers = worker.answer(requests)

    reference = ModelAPI(settings, LocalKinds(), pad=False)
    reference.model_loader = lambda device: build_denoiser().eval().to(device)
    expected = InProcess(reference).setup().predict(images)
    for slot, (request, answer) in enumerate(zip(requests, answers, strict=True)):
        assert isinstance(answer, InSlot) and answer.shape == images[slot].shape
        packed_answer = wire.pack_answer("uid", answer)
        assert len(wire.pack_request(request)) < SMALL_MESSAGE and len(packed_answer) < SMALL_MESSAGE
        output = items.resolve(answer, lambda offset, shape, dtype, slot=slot: files.read(slot, shape, dtype, offset))
        assert np.abs(output.astype(int) - expected[slot].astype(int)).max() <= 1
    files.close()


def test_a_cpu_worker_runs_a_lone_batch_on_all_its_threads_and_its_share_while_others_are_in_flight(
    slot_dir: Path, restore_threads: None
) -> None:
    settings = Settings(max_batch_size=1)
    state = SharedState(workers=2, request_slots=4)
    plan = worker_plan(slot_dir, 1, TorchThreads(2, 1))
    worker = set_up(ModelAPI(settings, LocalKinds(), pad=False), state, plan)
    request = queued(SlotFiles(slot_dir), state, 0, 1, np.zeros((16, 16, 3), dtype=np.uint8))
    used = []
    for admitted in (1, 3):  # this request alone; then two more in flight elsewhere in the pod
        assert state.try_admit(limit=8, count=admitted)
        (answer,) = worker.answer([request])
        assert not isinstance(answer, ApiError), answer
        used.append(torch.get_num_threads())
        state.release(admitted)
    assert used == [2, 1]


class GivenUpMidBatch(ImageAPI):
    """An API whose `predict` runs while the front end gives its request up and hands the slot to the next one
    (`meanwhile`, set once the worker is set up)."""

    meanwhile: Any = None

    def predict(self, batch: np.ndarray) -> np.ndarray:
        if self.meanwhile is not None:
            self.meanwhile()
        return 255 - batch


def test_a_result_is_not_written_into_a_slot_that_moved_on(slot_dir: Path, restore_threads: None) -> None:
    state = SharedState(workers=1, request_slots=2)
    api = GivenUpMidBatch()
    worker = set_up(api, state, worker_plan(slot_dir, 1))
    files = SlotFiles(slot_dir)
    given_up = np.ones((200, 200, 3), dtype=np.uint8)  # over the answer message's inline size: it goes to the slot
    successor = np.full((200, 200, 3), 7, dtype=np.uint8)
    request = queued(files, state, 0, 5, given_up)

    def front_end_moves_on() -> None:  # request 5 got its 504; request 99 now holds slot 0 and placed its pixels
        queued(files, state, 0, 99, successor)

    worker.runners[0].api.meanwhile = front_end_moves_on  # the worker's own copy of the API, set up
    (answer,) = worker.answer([request])
    assert isinstance(answer, ApiError) and (answer.status, answer.code) == (504, "deadline"), answer
    assert (files.read(0, successor.shape) == successor).all(), "the late result overwrote the next request's pixels"
    assert pixel_slots.bytes_in_use(slot_dir) <= successor.nbytes + 4096  # nothing written past them either
    files.close()


def test_the_dispatcher_sends_small_messages_and_holds_a_given_up_slot_until_its_answer(slot_dir: Path) -> None:
    """Plays the worker by hand on the real request and answer sockets."""
    state = SharedState(workers=1, request_slots=4)
    model_requests, answers = ModelRequests(slot_dir.parent, 1), AnswerSockets(slot_dir.parent, 1)
    requests = model_requests[0]
    dispatcher = Dispatcher(state, slot_dir, slots_per_front_end=2, retry_after_s=1)
    image = np.random.default_rng(1).integers(0, 256, (512, 512, 3), dtype=np.uint8)

    async def handler(timeout: float) -> object:
        async with dispatcher.slot(0, "denoiser") as slot:
            item = slot.place(image)
            return slot.result(await slot.submit(item, time.monotonic() + timeout))

    def work(message: wire.RequestMessage, taken: bool = False) -> None:
        """What a worker does: take the request, read its item from the slot, place its output there, send a
        small answer."""
        index = message.slot
        assert taken or state.mark_taken(index, message.ticket, worker=0)
        files = SlotFiles(slot_dir)
        pixels = items.resolve(message.item, lambda offset, shape, dtype: files.read(index, shape, dtype, offset))
        answer = items.place(255 - pixels, lambda array, offset: files.write(index, array, offset))
        answers.send(0, message.uid, answer)
        files.close()

    async def scenario() -> None:
        dispatcher.start(0, model_requests, answers.receiver(0))
        task = asyncio.create_task(handler(timeout=30))
        message = await asyncio.to_thread(requests.get, timeout=5)
        assert len(wire.pack_request(message)) < SMALL_MESSAGE, "pixels went through the queue"
        await asyncio.to_thread(work, message)
        assert (await task == 255 - image).all()
        assert state.queue_depth == 0 and len(dispatcher._free) == 2

        # Given up (deadline) while the worker still has it: the slot waits for the worker's answer.
        late = asyncio.create_task(handler(timeout=0.3))
        message = await asyncio.to_thread(requests.get, timeout=5)
        with pytest.raises(ApiError) as error:
            await late
        assert error.value.status == 504 and len(dispatcher._free) == 1
        await asyncio.to_thread(work, message)
        for _ in range(50):
            await asyncio.sleep(0.02)
            if len(dispatcher._free) == 2:
                break
        assert len(dispatcher._free) == 2, "the slot was not freed when the late answer came"

        # A worker dies while being handed a request (it had received it, not yet marked it): it is queued again.
        lost = asyncio.create_task(handler(timeout=30))
        await asyncio.to_thread(requests.get, timeout=5)  # ... and never marked: the worker is gone
        state.worker_lost(0)
        resent = await asyncio.to_thread(requests.get, timeout=5)
        # Its replacement (the same worker index) takes the copy: the request is the new worker's, not lost with
        # the dead one, and its slot stays the request's until the answer.
        assert state.mark_taken(resent.slot, resent.ticket, worker=0)
        await asyncio.sleep(4 * WORKER_CHECK_S)
        assert not lost.done() and len(dispatcher._free) == 1, "failed with the dead worker"
        state.worker_ready(0)
        await asyncio.to_thread(work, resent, True)
        assert (await lost == 255 - image).all()
        assert not state.mark_taken(resent.slot, resent.ticket, worker=0), (
            "a second copy of a taken request must be dropped"
        )

        # Every slot held: the next request is shed, not queued without a slot.
        blockers = [asyncio.create_task(handler(timeout=30)) for _ in range(2)]
        await asyncio.sleep(0.1)
        with pytest.raises(ApiError) as error:
            await handler(timeout=30)
        assert (error.value.status, error.value.code) == (503, "queue_full")
        for _ in blockers:
            await asyncio.to_thread(work, await asyncio.to_thread(requests.get, timeout=5))
        await asyncio.gather(*blockers)

    asyncio.run(scenario())


def test_after_a_flood_a_kill_and_a_sigterm_shared_memory_and_rss_are_back_at_baseline(tmp_path: Path) -> None:
    server = start_server({"max_batch_size": 4, "drain_timeout_s": 20}, tmp_path)
    try:
        wait_ready(server)
        url = f"{server.url}/predict"
        assert httpx.post(url, content=image_bytes(64, 64), headers={"Content-Type": "image/png"}).status_code == 200
        baseline = server.tree_pss()
        big = square_jpegs(768, count=2)
        flood = run_closed_loop(url, users=32, seconds=6, images=big)
        assert flood.failed == 0 and flood.answered, flood.errors()
        assert server.metric("imgserve_shared_memory_bytes") > 0, "the images did not go through shared memory"

        os.kill(server.worker_pids()[0], signal.SIGKILL)
        after_kill = run_closed_loop(url, users=16, seconds=3, images=big)
        assert after_kill.failed == 0 and {o.status for o in after_kill.outcomes} <= {200, 503}, after_kill.errors()
        wait_ready(server, timeout=60)
        assert server.slots_freed(), "a slot is still held after every answer came back"

        time.sleep(8)  # idle: free slots empty themselves, idle workers give their batch memory back
        held = {path.name: path.stat().st_blocks * 512 for path in server.slot_directory.iterdir()}
        assert server.metric("imgserve_shared_memory_bytes") == 0, f"slot files still holding memory: {held}"
        assert server.tree_pss() < baseline * 1.3, (baseline, server.tree_pss())
        private = server.private_directory
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(timeout=30) == 0
        assert not private.exists(), "the server left shared memory behind"
    finally:
        stop_server(server)
