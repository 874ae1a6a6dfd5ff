"""The main process's hand on the models: which are loaded, and the memory they share on each device.

A model is loaded in steps the front ends can see in the shared state (the repository extension's states): LOADING
while its weights are prepared (once per device, here) and every worker sets it up and measures it, READY once the
models loaded together fit the device's memory (pod.fit_models gives each its batch limits), or UNAVAILABLE with the
one-line reason when they do not or a worker failed. Unloading a model stops its admission (UNLOADING), waits for
its admitted requests to be answered, has every worker let it go, then frees its shared weights (UNAVAILABLE).
With --model-control explicit the front ends ask for loads and unloads (`ModelStates.want`); `step`, called by the
main loop, carries them out. Loading a model's weights runs on a thread, so the loop keeps watching the children.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from imgserve.handoff.model_state import FAILED, HELD, LOADING, READY, UNAVAILABLE, UNLOADING
from imgserve.handoff.state import SharedState
from imgserve.models.shared import SharedWeights
from imgserve.pod import DeviceMemory, MemoryRefusal, ModelNeed, fit_models
from imgserve.served import Catalog

log = logging.getLogger(__name__)
Prepare = Callable[[int], SharedWeights]  # a model's weights, loaded and shared on every device
Send = Callable[[dict[str, Any]], None]  # a command to every worker (their control pipes)


class ModelControl:
    """Loads and unloads the catalog's models; `weights` holds those of every model the workers hold or set up."""

    def __init__(self, catalog: Catalog, state: SharedState, memory: DeviceMemory, prepare: Prepare) -> None:
        self.catalog, self.state, self.memory, self.prepare = catalog, state, memory, prepare
        self.weights: dict[int, SharedWeights] = {}
        self.send: Send = lambda command: None  # set once the workers' pipes exist
        self._preparing: dict[int, Future[SharedWeights]] = {}
        self._letting_go: set[int] = set()  # models whose workers were told to let them go
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="imgserve-weights")

    def start_with(self, models: list[int]) -> None:
        """Before the workers start: the weights of the models they set up at their start."""
        for model in models:
            self.state.models.want(model, True)
            self.state.models.set_state(model, LOADING)
            self._hold(model, self.prepare(model))

    def fit_started(self) -> str | None:
        """Once every worker is ready: fit the models they set up; the refusal's one line if they do not fit."""
        loading = [model for model in range(len(self.catalog)) if self.state.models.state(model) == LOADING]
        try:
            self._fit(loading)
        except MemoryRefusal as refusal:
            return str(refusal)
        for model in loading:
            self.state.models.set_state(model, READY)
        return None

    def step(self) -> None:
        """Move each model one step towards what is wanted of it."""
        models = self.state.models
        for model in range(len(self.catalog)):
            state, wanted = models.state(model), models.wanted(model)
            if state == UNAVAILABLE and wanted and model not in self._preparing:
                models.set_state(model, LOADING)
                self._preparing[model] = self._loader.submit(self.prepare, model)
            elif state == LOADING and model in self._preparing and self._preparing[model].done():
                self._send_load(model, self._preparing.pop(model))
            elif state == LOADING and model in self.weights:
                self._finish_load(model)
            elif state == READY and not wanted:
                models.set_state(model, UNLOADING)
            elif state == UNLOADING:
                self._finish_unload(model)

    def _send_load(self, model: int, prepared: Future[SharedWeights]) -> None:
        try:
            weights = prepared.result()
        except Exception as exc:  # the model's file or factory: one line, as at start
            self._fail(model, f"cannot load the model: {type(exc).__name__}: {exc}")
            return
        self._hold(model, weights)
        self.send({"load": model, "weights": weights.to_message()})

    def _hold(self, model: int, weights: SharedWeights) -> None:
        self.weights[model] = weights
        copies = 1 if weights.shared else self.memory.workers
        self.state.models.set_weight_bytes(model, weights.nbytes * copies)

    def _finish_load(self, model: int) -> None:
        """Every worker holds it: fit it with the loaded models, or refuse it; a worker's failure refuses it."""
        models = self.state.models
        if models.holders(model, FAILED):
            self._fail(model, models.reason(model) or "a worker failed to set the model up")
        elif len(models.holders(model, HELD)) == models.workers:
            try:
                self._fit([*self._ready(), model])
            except MemoryRefusal as refusal:
                self._fail(model, str(refusal))
                return
            models.set_state(model, READY)
            log.info("model %s loaded", self.catalog[model].name)

    def _finish_unload(self, model: int) -> None:
        """Once its admitted requests are answered, every worker lets it go; once none holds it, its weights are
        freed."""
        models = self.state.models
        if self.state.model_queue_depth(model):
            return
        if model not in self._letting_go:
            self._letting_go.add(model)
            self.send({"unload": model})
        if models.holders(model, HELD) or models.holders(model, FAILED):
            return
        self._letting_go.discard(model)
        self._release(model)
        models.set_state(model, UNAVAILABLE)
        log.info("model %s unloaded", self.catalog[model].name)

    def _release(self, model: int) -> None:
        weights = self.weights.pop(model, None)
        if weights is not None:
            weights.release()
        self.state.models.forget_measure(model)

    def _fail(self, model: int, reason: str) -> None:
        """The load failed for `reason`: the workers let the model go, its weights are freed, its state says why."""
        log.error("model %s: %s", self.catalog[model].name, reason)
        self.send({"unload": model})
        self._release(model)
        self.state.models.want(model, False)
        self.state.models.set_state(model, UNAVAILABLE, reason)

    def _ready(self) -> list[int]:
        return [model for model in range(len(self.catalog)) if self.state.models.state(model) == READY]

    def _fit(self, loaded: list[int]) -> None:
        """Give each of the `loaded` models its batch limits on the device (MemoryRefusal when they do not fit)."""
        models, memory = self.state.models, self.memory
        overhead = self.state.worker_overhead() or memory.overhead_bytes  # measured on a CPU, else allowed
        needs = [
            ModelNeed(
                self.catalog[model].name,
                self.weights[model].nbytes * (1 if self.weights[model].shared else memory.workers),
                models.measured(model),
                self.catalog[model].batching.max_batch_size,
            )
            for model in loaded
        ]
        limits = fit_models(dataclasses.replace(memory, overhead_bytes=overhead), needs)
        for model in loaded:
            models.set_limits(model, limits[self.catalog[model].name])
