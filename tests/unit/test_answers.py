"""The answers' way back (handoff/answers.py): a worker whose front end has not read its socket for a while waits
for it asleep, not spinning on a core the front end needs, and every answer arrives once it reads."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from imgserve.handoff.answers import AnswerSockets

ANSWERS = 600  # more than the kernel queues on one datagram socket (net.unix.max_dgram_qlen: 10, or 512 where raised)
UNREAD_S = 0.5


def test_a_worker_waits_for_a_full_front_end_asleep_and_every_answer_arrives(tmp_path: Path) -> None:
    answers = AnswerSockets(tmp_path, front_ends=1)
    receiver = answers.receiver(0)
    spent: dict[str, float] = {}

    def worker() -> None:
        cpu, wall = time.thread_time(), time.monotonic()
        for index in range(ANSWERS):
            answers.send(0, f"uid-{index}", {"index": index})
        spent["cpu"], spent["wall"] = time.thread_time() - cpu, time.monotonic() - wall

    sending = threading.Thread(target=worker)
    sending.start()
    time.sleep(UNREAD_S)  # the front end busy: its socket fills and the worker waits
    received: list[str] = []
    deadline = time.monotonic() + 30
    while len(received) < ANSWERS and time.monotonic() < deadline:
        received += [uid for uid, _ in receiver.receive_ready()]
        time.sleep(0.001)
    sending.join(30)
    assert sorted(received) == sorted(f"uid-{index}" for index in range(ANSWERS))
    assert spent["wall"] > UNREAD_S * 0.8, "the socket never filled: the worker did not wait"
    assert spent["cpu"] < 0.2 * spent["wall"], f"the worker spent {spent['cpu']:.2f} s of CPU in {spent['wall']:.2f} s"
