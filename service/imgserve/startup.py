"""What the main process does before it builds the server: find the device, load the API to serve, load its model
file once and share its weights, and on a GPU time one probe batch (for workers_per_device auto).

Part of the composition root: only server.py imports it. Every failure here is the user's to fix (a missing file,
an --api that does not import, a model that does not fit), so each is one line and exit 2 (`StartupError`).
"""

from __future__ import annotations

import importlib
import os
import sys
import time
from pathlib import Path

import litserve as ls
import numpy as np
import torch

from imgserve.api import ImageAPI
from imgserve.config import Settings
from imgserve.models import shared
from imgserve.models.loader import ModelLoadError, load_model
from imgserve.models.shared import SharedWeights
from imgserve.pod import GpuProbe
from imgserve.worker.batching import BatchRunner
from imgserve.worker.serving import shared_model_loader

PROBE_BATCH = 8  # the batch timed for workers_per_device auto on a GPU when max_batch_size is auto too


class StartupError(ModelLoadError):
    """Something the user named cannot be served; the message says what and why, in one line."""


def resolve_device(device: str) -> str:
    """auto -> cuda when torch sees a GPU, else cpu; cuda without a GPU is the user's mistake."""
    if device == "cuda" and not torch.cuda.is_available():
        raise StartupError("--device cuda was asked for but torch sees no GPU")
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def load_api(spec: str) -> ls.LitAPI:
    """The API that `--api module:Class` names: the class instantiated without arguments (or the instance the
    module holds). The module is found as `--model-factory`'s is, the current directory first."""
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise StartupError(f"--api must look like module:Class, got {spec!r}")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        found = getattr(importlib.import_module(module_name), attribute)
    except Exception as exc:  # ImportError, AttributeError, or whatever the user's module raises
        raise StartupError(f"cannot import --api {spec}: {type(exc).__name__}: {exc}") from None
    if isinstance(found, type) and issubclass(found, ls.LitAPI):
        try:
            found = found()
        except Exception as exc:
            raise StartupError(f"--api {spec}: {attribute}() failed: {type(exc).__name__}: {exc}") from None
    if not isinstance(found, ls.LitAPI):
        raise StartupError(f"--api {spec} is a {type(found).__name__}, not an imgserve.ImageAPI or litserve.LitAPI")
    return found


def load_weights(
    model: str | None, factory: str | None, settings: Settings, device_type: str, devices: int, directory: Path
) -> SharedWeights:
    """The API's model file (built by `factory`, for weights-only files) loaded once, here in the main process, its
    weights shared with the workers of each device; none when the API loads its own model in `setup`."""
    if model is None:
        return SharedWeights(0, reason="the API loads its own model in setup")
    try:
        loaded = load_model(model, factory, settings.trust_pickle, trust_native_code=settings.trust_native_code)
    except ModelLoadError:
        raise
    except Exception as exc:  # the user's factory or file: one line, as a worker's failure would say it
        raise StartupError(f"cannot load the model: {type(exc).__name__}: {exc}") from None
    names = [f"cuda:{index}" for index in range(devices)] if device_type == "cuda" else ["cpu"]
    return shared.prepare(loaded, device_type, names, directory, settings.share_weights, settings.channels_last)


def probe_gpu(api: ImageAPI, settings: Settings, weights: SharedWeights) -> GpuProbe:
    """One batch of the API's example request timed on cuda:0: a worker's own CPU seconds and the device's. The API
    is set up here, in the main process, on the weights it shares; then let go."""
    device = torch.device("cuda:0")
    api.model_loader = shared_model_loader(api, weights, settings.trust_pickle, settings.trust_native_code)
    api.setup(str(device))
    example = api.example_request()
    if example is None:
        raise StartupError(f"{type(api).__name__}.example_request() gives none: set --workers-per-device")
    item = api.decode_request(example)
    count = settings.max_batch_size if isinstance(settings.max_batch_size, int) else PROBE_BATCH
    runner = BatchRunner(api, device)
    try:
        runner.measure(item)  # the warm-up
        count, cpu_s, device_s = time_batch(runner, [item] * count)
    except torch.OutOfMemoryError:
        raise StartupError("the model runs out of GPU memory on one example request") from None
    finally:
        del runner
        torch.cuda.empty_cache()
    return GpuProbe(count, _describe(item), cpu_s, device_s)


def time_batch(runner: BatchRunner, items: list[object]) -> tuple[int, float, float]:
    """(batch size, a worker's own seconds, the device's seconds of `predict`) of the second run of `items`,
    halved until they fit."""
    while True:
        try:
            runner.call(items)
            break
        except torch.OutOfMemoryError:
            if len(items) == 1:
                raise
            torch.cuda.empty_cache()
            items = items[: len(items) // 2]
    api, device = runner.api, runner.device
    started = time.perf_counter()
    batch = api.batch(items)
    _synchronize(device)
    predicted = time.perf_counter()
    output = api.predict(batch)
    _synchronize(device)
    device_s = time.perf_counter() - predicted
    api.unbatch(output)
    total = time.perf_counter() - started
    return len(items), max(total - device_s, 0.0), device_s


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _describe(item: object) -> str:
    if isinstance(item, np.ndarray) and item.ndim == 3:
        return f"{item.shape[1]}x{item.shape[0]} images"
    return "example items"
