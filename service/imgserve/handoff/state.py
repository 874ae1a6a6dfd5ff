"""Counters and flags shared by every process of one server: HTTP front ends, inference workers, the main process.

They live in shared memory made by the main process before it starts any child (the workers, from the fork server, and
the forked front ends alike get them), so no process has to be asked for them and none can take them down with it."""

from __future__ import annotations

import multiprocessing as mp
import time
from multiprocessing.sharedctypes import Synchronized, SynchronizedArray
from typing import Any

from imgserve.handoff.model_state import ModelStates

SETUP_FAILURE_BYTES = 2048
STARTING, READY, FAILED = 0, 1, 2  # a worker process's start-up status
# spawn-context primitives can be handed to the workers (the fork server's) and inherited by forked front ends alike.
_ctx = mp.get_context("spawn")


class SharedState:
    """Exact per-pod numbers (queue depth, draining, worker health) that no single process could know alone."""

    def __init__(self, workers: int, request_slots: int = 1, front_ends: int = 1, models: int = 1) -> None:
        # Admitted requests per front end and model, so the requests of a front end that died can be written off.
        self._admitted: SynchronizedArray[int] = _ctx.Array("i", front_ends * models)
        self.models = ModelStates(models, workers)
        self._front_end = 0  # which front end this process is (set after the fork, in that process)
        self._draining: Synchronized[int] = _ctx.Value("b", 0)
        # The front end whose gRPC server listens (--grpc-port); -1: none.
        self._grpc_front_end: Synchronized[int] = _ctx.Value("i", -1)
        self._exit_code: Synchronized[int] = _ctx.Value("i", 0)
        # Per worker index: its current process's STARTING, READY, FAILED; its process's own memory, before any model.
        self._status: SynchronizedArray[int] = _ctx.Array("b", workers)
        self._overhead: SynchronizedArray[int] = _ctx.Array("q", workers)
        self._alive: SynchronizedArray[int] = _ctx.Array("b", [1] * workers)
        self._lost_at: SynchronizedArray[float] = _ctx.Array("d", [0.0] * workers)
        self._lives = _ctx.Array("i", workers, lock=False)  # per worker index: how many of its processes died
        # Per request slot: the front end's ticket (one writer), and which worker took it (first taker wins).
        self._owner = _ctx.Array("q", request_slots, lock=False)
        self._taken = _ctx.Array("q", request_slots, lock=False)
        self._taken_in_life = _ctx.Array("i", request_slots, lock=False)  # ... and which process of that worker
        self._take_lock = _ctx.Lock()
        self._setup_failure: Any = _ctx.Array("c", SETUP_FAILURE_BYTES)

    # Admission: requests admitted and not yet answered.
    def serve_as(self, front_end: int) -> None:
        """In a front-end process: count what this process admits as front end `front_end`'s."""
        self._front_end = front_end

    def try_admit(self, limit: int, count: int = 1, model: int = 0, model_limit: int | None = None) -> bool:
        """Take `count` places in the pod's queue, of `model`'s, if that many are free in both (all or none)."""
        with self._admitted.get_lock():
            if self.queue_depth + count > limit:
                return False
            if model_limit is not None and self._model_depth(model) + count > model_limit:
                return False
            self._admitted[self._front_end * self.models.count + model] += count
            return True

    def release(self, count: int = 1, model: int = 0) -> None:
        with self._admitted.get_lock():
            self._admitted[self._front_end * self.models.count + model] -= count

    def forget_front_end(self, front_end: int) -> None:
        """A front end died: its admitted requests died with their connections and will never be released, and
        its gRPC server (if it ran one) with it."""
        models = self.models.count
        with self._admitted.get_lock():
            self._admitted[front_end * models : (front_end + 1) * models] = [0] * models
        if self._grpc_front_end.value == front_end:
            self._grpc_front_end.value = -1

    @property
    def queue_depth(self) -> int:
        """Admitted and not yet answered, all models: the pod's. Read without the lock, which only the writers take: a
        read between two of their writes is one a moment earlier or later (try_admit reads it holding the lock)."""
        return sum(self._counts())

    def model_queue_depth(self, model: int) -> int:
        """Admitted and not yet answered, of `model`."""
        return self._model_depth(model)

    def _model_depth(self, model: int) -> int:
        return sum(self._counts()[model :: self.models.count])

    def _counts(self) -> Any:
        """The admitted counts themselves, for reads without their lock."""
        return self._admitted.get_obj()

    # Shutdown.
    @property
    def draining(self) -> bool:
        return bool(self._draining.value)

    @property
    def grpc_serving(self) -> bool:
        return self._grpc_front_end.value >= 0

    def serve_grpc(self, serving: bool) -> None:
        """In a front-end process: its gRPC server now listens (True), or has stopped (False)."""
        self._grpc_front_end.value = self._front_end if serving else -1

    def start_draining(self, exit_code: int = 0) -> None:
        self._exit_code.value = max(self._exit_code.value, exit_code)
        self._draining.value = 1

    @property
    def exit_code(self) -> int:
        return self._exit_code.value

    # The workers' start.
    def fail_setup(self, worker: int, reason: str) -> None:
        """Worker `worker` could not load or warm up the model: the one-line reason `imgserve serve` ends with."""
        self._setup_failure.value = reason.encode()[: SETUP_FAILURE_BYTES - 1]
        self._status[worker] = FAILED

    def worker_ready(self, worker: int) -> None:
        """Worker `worker` has set up its API and measured it: it takes requests."""
        self._status[worker] = READY
        self._alive[worker] = 1

    def report_overhead(self, worker: int, nbytes: int) -> None:
        """Worker `worker`'s own memory before any model, measured on a CPU: the interpreter and its libraries."""
        self._overhead[worker] = nbytes

    def worker_overhead(self) -> int:
        """The largest memory of a worker process of its own, as the workers reported it (0 before any did)."""
        return max(self._overhead[:], default=0)

    def worker_status(self, worker: int) -> int:
        return self._status[worker]

    @property
    def workers_ready(self) -> bool:
        """Every worker has set up its API and none has died since."""
        return all(status == READY for status in self._status[:]) and self.all_workers_alive

    @property
    def setup_failure(self) -> str:
        failure: bytes = self._setup_failure.value
        return failure.decode(errors="replace")

    # Worker health, kept by the main process's supervisor.
    def worker_lost(self, worker: int) -> None:
        """Worker `worker`'s process died (called before its replacement starts, which sets it up again)."""
        self.models.drop_worker(worker)
        self._status[worker] = STARTING
        self._alive[worker] = 0
        self._lost_at[worker] = time.monotonic()
        self._lives[worker] += 1

    @property
    def all_workers_alive(self) -> bool:
        return all(self._alive[:])

    def last_loss(self) -> float:
        """When a worker last died (time.monotonic(); 0 if none has)."""
        return max(self._lost_at[:], default=0.0)

    # Which request is in which slot and which worker took it: shared-memory writes instead of queue messages.
    def set_owner(self, slot: int, ticket: int) -> None:
        """The front end put request `ticket` in `slot` (its pixels are in the slot's file)."""
        self._owner[slot] = ticket

    def owns(self, slot: int, ticket: int) -> bool:
        """Is request `ticket` still the one in `slot`? (A request given up on long ago may have lost it.)"""
        owner: int = self._owner[slot]
        return owner == ticket

    def mark_taken(self, slot: int, ticket: int, worker: int) -> bool:
        """Worker `worker` takes request `ticket` from `slot`; False (nothing marked) if the slot moved on or another
        worker took this request already (it was sent again after a worker died: the first copy taken wins)."""
        with self._take_lock:
            if not self.owns(slot, ticket) or self._taken[slot] >> 8 == ticket:
                return False
            self._taken_in_life[slot] = self._lives[worker]  # written first: whoever sees the ticket sees this
            self._taken[slot] = ticket << 8 | worker + 1
            return True

    def taken_by(self, slot: int, ticket: int) -> int | None:
        """The worker holding request `ticket`, or None while it is queued (a stale ticket in the slot is ignored)."""
        value = self._taken[slot]
        return (value & 0xFF) - 1 if value >> 8 == ticket else None

    def taker_died(self, slot: int, ticket: int) -> bool:
        """Did the worker process that took request `ticket` die? (Its replacement has the same worker index.)"""
        worker = self.taken_by(slot, ticket)
        return worker is not None and self._lives[worker] != self._taken_in_life[slot]
