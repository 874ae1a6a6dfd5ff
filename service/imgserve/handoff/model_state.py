"""Each model's state, shared by every process of one server: loaded or not (the repository extension's states),
which workers hold it, what they measured of it, the batch limits the main process gave it, its output kind.

A model is READY once every worker holds it and the main process has fitted it into the device's memory; the front
ends admit requests only for READY models. The main process alone moves a model between states; workers report what
they hold and measured.
"""

from __future__ import annotations

import multiprocessing as mp
from dataclasses import dataclass
from multiprocessing.sharedctypes import SynchronizedArray
from typing import Any

from imgserve.pod import Limits, Measured

UNAVAILABLE, LOADING, READY, UNLOADING = 0, 1, 2, 3
STATE_NAMES = ("UNAVAILABLE", "LOADING", "READY", "UNLOADING")  # as the repository extension writes them
NOT_HELD, HELD, FAILED = 0, 1, 2  # a worker's hold of a model
REASON_BYTES = 512
TASK_BYTES = 16
_ctx = mp.get_context("spawn")


class ModelStates:
    """The models' shared state; model and worker indices as in the catalog and the pod plan."""

    def __init__(self, models: int, workers: int) -> None:
        self.count, self.workers = models, workers
        self._state: SynchronizedArray[int] = _ctx.Array("b", models)
        self._wanted: SynchronizedArray[int] = _ctx.Array("b", models)
        self._reason: Any = _ctx.Array("c", models * REASON_BYTES)
        self._held: SynchronizedArray[int] = _ctx.Array("b", workers * models)
        self._measured: SynchronizedArray[float] = _ctx.Array("d", models * 2)
        self._limits: SynchronizedArray[int] = _ctx.Array("q", models * 3)
        self._task: Any = _ctx.Array("c", models * TASK_BYTES)
        self._weight_bytes: SynchronizedArray[int] = _ctx.Array("q", models)
        self._generation: Any = _ctx.RawValue("q", 0)  # one writer (the main process); read without a lock

    # The main process's word.
    def state(self, model: int) -> int:
        return self._state[model]

    def set_state(self, model: int, state: int, reason: str = "") -> None:
        self.note_failure(model, reason)
        self._state[model] = state
        self._generation.value += 1

    def note_failure(self, model: int, reason: str) -> None:
        """A worker could not set the model up: the one line its load answers with (the state is the main
        process's to change)."""
        encoded = reason.encode()[: REASON_BYTES - 1]
        self._reason[model * REASON_BYTES : model * REASON_BYTES + len(encoded) + 1] = encoded + b"\0"

    def reason(self, model: int) -> str:
        """Why the model is not ready (a failed load's one line), or ""."""
        raw = bytes(self._reason[model * REASON_BYTES : (model + 1) * REASON_BYTES])
        return raw.split(b"\0", 1)[0].decode(errors="replace")

    def ready(self, model: int) -> bool:
        return self._state[model] == READY

    def set_limits(self, model: int, limits: Limits) -> None:
        self._limits[model * 3 : model * 3 + 3] = [limits.batch_size, limits.element_budget, limits.budget_bytes]
        self._generation.value += 1

    @property
    def generation(self) -> int:
        """Counts every change of a model's state or limits (after the change is written): what was worked out from
        them holds while it stays the same."""
        return int(self._generation.value)

    def limits(self, model: int) -> Limits | None:
        """The model's limits, or None before the main process has fitted it."""
        batch_size, elements, budget = self._limits[model * 3 : model * 3 + 3]
        return Limits(batch_size, elements, budget) if batch_size else None

    def set_weight_bytes(self, model: int, nbytes: int) -> None:
        """What the model's weights hold on each device, all its workers (the main process knows, /metrics shows)."""
        self._weight_bytes[model] = nbytes

    def weight_bytes(self, model: int) -> int:
        return self._weight_bytes[model]

    # What the front ends ask for (the repository extension's load and unload).
    def want(self, model: int, loaded: bool) -> None:
        self._wanted[model] = int(loaded)

    def wanted(self, model: int) -> bool:
        return bool(self._wanted[model])

    # What the workers report.
    def hold(self, worker: int, model: int, status: int) -> None:
        self._held[worker * self.count + model] = status

    def held(self, worker: int, model: int) -> int:
        return self._held[worker * self.count + model]

    def holders(self, model: int, status: int = HELD) -> list[int]:
        """The workers whose hold of `model` is `status`."""
        return [worker for worker in range(self.workers) if self.held(worker, model) == status]

    def drop_worker(self, worker: int) -> None:
        """Worker `worker`'s process died: it holds nothing now (its replacement sets up what is loaded)."""
        for model in range(self.count):
            self.hold(worker, model, NOT_HELD)

    def measure(self, model: int, measured: Measured) -> None:
        """A worker's measurement; the largest of all workers' is kept."""
        with self._measured.get_lock():
            current = self._measured[model * 2]
            if measured.bytes_per_element > current:
                self._measured[model * 2 : model * 2 + 2] = [measured.bytes_per_element, measured.example_elements]

    def measured(self, model: int) -> Measured | None:
        bytes_per_element, elements = self._measured[model * 2 : model * 2 + 2]
        return Measured(bytes_per_element, int(elements)) if bytes_per_element else None

    def forget_measure(self, model: int) -> None:
        self._measured[model * 2 : model * 2 + 2] = [0.0, 0.0]
        self._limits[model * 3 : model * 3 + 3] = [0, 0, 0]

    # The output kind a built-in model's workers decided at warm-up.
    def set_task(self, model: int, kind: str) -> None:
        encoded = kind.encode()[: TASK_BYTES - 1]
        self._task[model * TASK_BYTES : model * TASK_BYTES + len(encoded) + 1] = encoded + b"\0"

    def task(self, model: int) -> str | None:
        raw = bytes(self._task[model * TASK_BYTES : (model + 1) * TASK_BYTES])
        return raw.split(b"\0", 1)[0].decode() or None

    def kinds(self, model: int) -> ModelKind:
        return ModelKind(self, model)


@dataclass(frozen=True)
class ModelKind:
    """One model's output kind in the shared state, as the built-in API records and reads it (models/builtin.py)."""

    states: ModelStates
    model: int

    @property
    def task(self) -> str | None:
        return self.states.task(self.model)

    def set_task(self, kind: str) -> None:
        self.states.set_task(self.model, kind)
