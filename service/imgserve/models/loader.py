"""Load the model to serve: the built-in denoiser, TorchScript, torch.export (.pt2), or weights plus a factory."""

from __future__ import annotations

import contextlib
import importlib
import io
import os
import pickle
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from imgserve.config import BUILTIN_MODEL
from imgserve.models.exported import unsafe_reason
from imgserve.models.native import NativeModule, is_native_package

Weights = dict[str, torch.Tensor]


class ModelLoadError(RuntimeError):
    """The model named in the settings cannot be loaded; the message says why and what to do."""


def check_model_source(spec: str, factory: str | None) -> None:
    """Fail fast, before any worker starts, on a missing file, an unknown format or a bad factory."""
    if spec == BUILTIN_MODEL:
        return
    path = Path(spec)
    if not path.is_file():
        raise ModelLoadError(f"model file not found: {path}")
    if path.suffix not in (".pt", ".pth", ".ts", ".jit", ".pt2", ".safetensors"):
        raise ModelLoadError(
            f"unknown model format {path.suffix!r}: use .pt/.pth (TorchScript or state dict), .pt2, .safetensors"
        )
    if path.suffix == ".safetensors" and not factory:
        raise ModelLoadError("a .safetensors file holds only weights: set --model-factory module:function")
    if path.suffix != ".safetensors" and not _torch_can_read(path):
        raise ModelLoadError(
            f"{path} is not a model file torch can read (torch.save, torch.jit.save and torch.export.save "
            "write zip archives; this is neither one nor a pickle)"
        )
    if factory:
        _import_factory(factory)


def load_model(
    spec: str,
    factory: str | None = None,
    trust_pickle: bool = False,
    shared: Weights | None = None,
    *,
    trust_native_code: bool = False,
) -> torch.nn.Module:
    """The model in eval mode on the CPU; with `shared` (the tensors of the main process's one copy, see
    models/shared.py), those tensors become its parameters and buffers and its own are never loaded (factory
    formats and the built-in model: built on the meta device) or dropped (TorchScript, torch.export, a pickle).
    An AOTInductor package loads only with `trust_native_code` (models/native.py)."""
    check_model_source(spec, factory)
    if shared is not None and (spec == BUILTIN_MODEL or factory):
        return _built_around(_builder(spec, factory), shared)
    path = Path(spec)
    if path.suffix == ".pt2" and is_native_package(path):
        if not trust_native_code:
            raise ModelLoadError(
                f"{path} is an AOTInductor package: native code that would run as the server. "
                "Pass --trust-native-code if you trust its author."
            )
        model: torch.nn.Module = NativeModule(path)
    else:
        model = _load(path, factory, trust_pickle, lazy=shared is not None)
    return model if shared is None else adopt(model, shared)


def adopt(module: torch.nn.Module, tensors: Weights) -> torch.nn.Module:
    """Make `tensors` the module's parameters and buffers, without copying them; eval mode, no gradients."""
    try:
        module.load_state_dict(tensors, assign=True)
    except RuntimeError as exc:
        raise ModelLoadError(f"the shared weights do not fit the model: {exc}") from None
    return for_inference(module)


def for_inference(module: torch.nn.Module) -> torch.nn.Module:
    """Eval mode (an exported program's module keeps the mode it was exported in: it refuses eval()), no gradients
    (parameter by parameter: a ScriptModule has no requires_grad_)."""
    with contextlib.suppress(NotImplementedError):
        module.eval()
    for parameter in module.parameters():
        parameter.requires_grad_(False)
    return module


def _built_around(build: Callable[[], torch.nn.Module], tensors: Weights) -> torch.nn.Module:
    """The module built without weights (meta device) around `tensors`; built for real when the factory makes a
    tensor the state does not hold (a non-persistent buffer), whose own weights are then dropped."""
    with torch.device("meta"):
        module = adopt(build(), tensors)
    named = [*module.named_parameters(), *module.named_buffers()]
    if any(tensor.is_meta for _, tensor in named):
        module = adopt(build(), tensors)
    return module


def _builder(spec: str, factory: str | None) -> Callable[[], torch.nn.Module]:
    if spec == BUILTIN_MODEL:
        from imgserve.models.denoiser import Denoiser

        return Denoiser
    return _import_factory(factory or "")


def _load(path: Path, factory: str | None, trust_pickle: bool, lazy: bool) -> torch.nn.Module:
    """The model with its own weights; `lazy` maps a zip archive's weights instead of reading them (to be replaced)."""
    if str(path) == BUILTIN_MODEL:
        from imgserve.models.denoiser import build_denoiser

        return build_denoiser().eval()
    if path.suffix == ".pt2":
        return _load_exported(path, trust_pickle)
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return _with_state(factory, load_file(str(path)))
    if is_torchscript(path):
        # torch leaves jit.load unannotated
        script: torch.jit.ScriptModule = torch.jit.load(str(path), map_location="cpu")  # type: ignore[no-untyped-call]
        return script.eval()
    mmap = lazy and zipfile.is_zipfile(path)
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError:
        if not trust_pickle:
            raise ModelLoadError(
                f"{path} is a pickled Python object, not weights: loading it would run code from the file. "
                "Re-save it with torch.jit.save / torch.export.save / model.state_dict(), "
                "or pass --trust-pickle if you trust its author."
            ) from None
        loaded = torch.load(path, map_location="cpu", weights_only=False, mmap=mmap)
    if isinstance(loaded, torch.nn.Module):
        return loaded.eval()
    if isinstance(loaded, dict):
        if not factory:
            raise ModelLoadError(f"{path} holds a state dict: set --model-factory module:function to build the module")
        return _with_state(factory, loaded)
    raise ModelLoadError(f"{path} holds a {type(loaded).__name__}, not a model or a state dict")


def _load_exported(path: Path, trust_pickle: bool) -> torch.nn.Module:
    """A torch.export program. torch.export.load can run code the archive carries (pickles, SymPy and guard strings,
    names written into generated code): without --trust-pickle only the plain form torch.export.save writes for an
    ordinary model is loaded (models/exported.py), from the very bytes that were checked."""
    if trust_pickle:
        return torch.export.load(str(path)).module()
    data = path.read_bytes()
    reason = unsafe_reason(data)
    if reason:
        raise ModelLoadError(
            f"{path} is a torch.export archive that could run code when loaded: {reason}. "
            "Re-export it with torch.export.save, or pass --trust-pickle if you trust its author."
        )
    return torch.export.load(io.BytesIO(data)).module()


def _torch_can_read(path: Path) -> bool:
    """A zip archive (every torch writer since 1.6) or a legacy pickle (protocol 2+ starts with 0x80)."""
    with path.open("rb") as file:
        return zipfile.is_zipfile(file) or file.read(1) == b"\x80"


def is_torchscript(path: Path) -> bool:
    """Whether the file is a TorchScript archive (torch.jit.save), whatever its suffix."""
    if not zipfile.is_zipfile(path):
        return False
    with zipfile.ZipFile(path) as archive:
        return any(name.endswith("/constants.pkl") or "/code/" in name for name in archive.namelist())


def _import_factory(factory: str) -> Callable[[], torch.nn.Module]:
    module_name, _, attribute = factory.partition(":")
    if not module_name or not attribute:
        raise ModelLoadError(f"model factory must look like module:function, got {factory!r}")
    if os.getcwd() not in sys.path:  # `nets:build` finds nets.py in the current directory, as `python -m` would
        sys.path.insert(0, os.getcwd())
    try:
        build: Callable[[], torch.nn.Module] = getattr(importlib.import_module(module_name), attribute)
        return build
    except (ImportError, AttributeError) as exc:
        raise ModelLoadError(f"cannot import model factory {factory!r}: {exc}") from None


def _with_state(factory: str | None, state: dict[str, Any]) -> torch.nn.Module:
    module = _import_factory(factory or "")()
    try:
        module.load_state_dict(state)
    except RuntimeError as exc:
        raise ModelLoadError(f"the weights do not fit the module built by {factory}: {exc}") from None
    return module.eval()
