"""One copy of the weights per device, however many inference workers hold the model.

The main process loads the model once, converts it to the serving layout once (channels_last), and hands the
weights over: on a CPU as a safetensors file in /dev/shm that every worker maps read-only (MAP_PRIVATE: the pages
stay shared while nobody writes them), on CUDA as the device tensors themselves, which reach each worker as CUDA IPC
views of the main process's memory (the main process owns them and outlives its workers). A worker builds its
module without weights and adopts the shared tensors as its parameters and buffers (`adopt`), so nothing is copied.
"""

from __future__ import annotations

import contextlib
import json
import logging
import pickle
import shutil
from dataclasses import dataclass, field
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing  # noqa: F401 - registers the tensor reducers (CUDA IPC handles) on ForkingPickler

from imgserve.models.loader import for_inference
from imgserve.models.native import NativeModule

log = logging.getLogger(__name__)
FILE_NAME = "weights.safetensors"
NHWC_KEY, ALIAS_KEY = "imgserve.nhwc", "imgserve.aliases"  # metadata: 4-D tensors stored as NHWC; tied names
Identity = tuple[int, tuple[int, ...], tuple[int, ...]]  # a tensor's data pointer, shape and strides
# What each worker still holds on its own, by the kind of module the model file gives (parameters and buffers are
# always shared): /info says it.
PRIVATE_PER_WORKER = {
    "torchscript": "tensor constants folded into the graph (all the weights of a torch.jit.freeze'd module)",
    "torch.export": "tensor constants lifted into the graph (not parameters or buffers)",
    "module": "nothing",
    "aotinductor": "all the weights (they are inside the compiled package)",
}


@dataclass
class SharedWeights:
    """How the workers get the weights: one copy of `nbytes` per device they map, or (neither `path` nor `cuda`
    set) a private copy each, for `reason`. Small: it travels to each worker."""

    nbytes: int
    path: Path | None = None  # CPU: the prepared file in /dev/shm
    cuda: dict[str, bytes] = field(default_factory=dict)  # CUDA: per device, the tensors pickled as IPC handles
    reason: str = ""  # why each worker loads its own copy
    kind: str = "module"  # a key of PRIVATE_PER_WORKER
    owner: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict, repr=False)  # main process only

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "owner": {}}  # the owner's tensors stay in the main process

    @property
    def shared(self) -> bool:
        return self.path is not None or bool(self.cuda)

    def to_message(self) -> dict[str, Any]:
        """What a worker needs of it, as plain values (a worker's control message carries it)."""
        path = None if self.path is None else str(self.path)
        return {"nbytes": self.nbytes, "path": path, "cuda": self.cuda, "reason": self.reason, "kind": self.kind}

    @classmethod
    def from_message(cls, data: dict[str, Any]) -> SharedWeights:
        path = data["path"]
        return cls(
            int(data["nbytes"]), None if path is None else Path(path), dict(data["cuda"]), data["reason"], data["kind"]
        )

    def release(self) -> None:
        """In the main process, once no worker holds the model: its shared copy goes (the file, the device tensors)."""
        if self.path is not None:
            self.path.unlink(missing_ok=True)
        self.owner.clear()
        if self.cuda:
            torch.cuda.empty_cache()

    def describe(self) -> dict[str, object]:
        """What /info says about the weights."""
        route = (
            f"read-only mapping of {self.path}"
            if self.path
            else "CUDA IPC views of the main process's tensors"
            if self.cuda
            else f"a private copy per worker: {self.reason}"
        )
        private = PRIVATE_PER_WORKER[self.kind] if self.shared else "all the weights"
        return {"bytes": self.nbytes, "shared": self.shared, "route": route, "private_per_worker": private}

    def tensors(self, device: str) -> dict[str, torch.Tensor]:
        """The weights as views of the shared memory (called in the worker)."""
        if self.path is None:
            views: dict[str, torch.Tensor] = pickle.loads(self.cuda[device])  # noqa: S301 - our main process wrote them
            return views
        from safetensors import safe_open

        with safe_open(str(self.path), framework="pt") as mapped:
            metadata = mapped.metadata() or {}
            tensors = {name: mapped.get_tensor(name) for name in mapped.keys()}  # noqa: SIM118 - not a dict
        for name in json.loads(metadata.get(NHWC_KEY, "[]")):
            tensors[name] = tensors[name].permute(0, 3, 1, 2)  # NHWC memory seen as NCHW: channels_last, no copy
        for alias, name in json.loads(metadata.get(ALIAS_KEY, "{}")).items():
            tensors[alias] = tensors[name]
        return tensors


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters and buffers, each storage counted once."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in model.state_dict().values()}
    return sum(storages.values())


def prepare(
    model: torch.nn.Module, device_type: str, devices: list[str], directory: Path, enabled: bool, channels_last: bool
) -> SharedWeights:
    """Convert the model once (no gradients, channels_last) and share its weights the device's way."""
    for_inference(model)
    if channels_last:
        model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]  # torch's stubs lack it
    if not enabled:
        weights = SharedWeights(weight_bytes(model), reason="--no-share-weights")
    elif device_type == "cuda":
        weights = share_on_cuda(model, devices)
    else:
        weights = share_on_cpu(model, directory)
    weights.kind = _kind(model)
    return weights


def _kind(model: torch.nn.Module) -> str:
    if isinstance(model, NativeModule):
        return "aotinductor"
    if isinstance(model, torch.jit.ScriptModule):
        return "torchscript"
    return "torch.export" if isinstance(model, torch.fx.GraphModule) else "module"


def share_on_cpu(model: torch.nn.Module, directory: Path) -> SharedWeights:
    """Write the model's state into `directory` (in /dev/shm) for the workers to map; private copies (and one
    warning line) when it does not fit in half of the free space there (the rest is left to the request slots) or
    cannot be written."""
    from safetensors.torch import save_file

    state, nhwc, aliases = _flat_state(model)
    nbytes = sum(t.nbytes for t in state.values())
    path = directory / FILE_NAME
    try:
        directory.mkdir(mode=0o700, exist_ok=True)
        free = shutil.disk_usage(directory).free
        if nbytes <= free // 2:
            save_file(state, str(path), metadata={NHWC_KEY: json.dumps(nhwc), ALIAS_KEY: json.dumps(aliases)})
            path.chmod(0o400)
            return SharedWeights(nbytes, path=path)
        reason = f"the weights ({nbytes >> 20} MiB) do not fit in half of {directory}'s free {free >> 20} MiB"
    except OSError as exc:
        with contextlib.suppress(OSError):  # a partial file goes; there may be no folder to hold one
            path.unlink(missing_ok=True)
        reason = f"cannot write the shared weights to {directory}: {exc}"
    log.warning("%s: each worker loads its own copy", reason)
    return SharedWeights(nbytes, reason=reason)


def share_on_cuda(model: torch.nn.Module, devices: list[str]) -> SharedWeights:
    """Place one copy of the weights on each device, owned by this (the main) process, as IPC handles to send."""
    owner = {device: _moved(model.state_dict(), device) for device in devices}
    pickled = {device: bytes(ForkingPickler.dumps(tensors)) for device, tensors in owner.items()}
    return SharedWeights(weight_bytes(model), cuda=pickled, owner=owner)


def _moved(state: dict[str, torch.Tensor], device: str) -> dict[str, torch.Tensor]:
    """The state on `device` in its layout (channels_last kept), tied tensors still one tensor."""
    moved: dict[Identity, torch.Tensor] = {}
    out = {}
    for name, tensor in state.items():
        key = _identity(tensor)
        if key not in moved:
            moved[key] = tensor.to(device)
        out[name] = moved[key]
    return out


def _identity(tensor: torch.Tensor) -> Identity:
    """The same tensor under two names (tied weights) has the same identity."""
    return tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride())


def _flat_state(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], list[str], dict[str, str]]:
    """The state as contiguous tensors safetensors can write: channels_last 4-D ones as their NHWC memory, tied
    tensors once (the others named as aliases), other views of one storage copied, anything else contiguous."""
    state: dict[str, torch.Tensor] = {}
    nhwc: list[str] = []
    aliases: dict[str, str] = {}
    seen: dict[Identity, str] = {}
    storages: set[int] = set()
    for name, tensor in model.state_dict().items():
        key = _identity(tensor)
        if key in seen:
            aliases[name] = seen[key]
            continue
        seen[key] = name
        storage = tensor.untyped_storage().data_ptr()
        if storage in storages:  # another view of a storage already written: safetensors wants its own bytes
            tensor = tensor.clone()
        storages.add(storage)
        if tensor.dim() == 4 and not tensor.is_contiguous() and tensor.is_contiguous(memory_format=torch.channels_last):
            state[name] = tensor.permute(0, 2, 3, 1)  # contiguous already: this is its memory order
            nhwc.append(name)
        else:
            state[name] = tensor.contiguous()
    return state, nhwc, aliases
