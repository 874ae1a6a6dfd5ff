"""torch.compile for the built-in API: the model compiled in each inference worker before the server is ready, for
every batch size the worker can run, with the compiled code kept in a private directory, so a restart with the same
model, device, processor and torch reuses it instead of compiling again.

One compile serves many shapes. The batch dimension is marked dynamic (and the height and width too, where the model
takes any size), so torch compiles one graph for a batch of one (it specializes sizes 0 and 1) and one for larger
batches, which a kernel choice of its own may split further; torch also guards each graph on the thread count it
was compiled at. `warm_up` runs every batch size on each thread count the worker uses before it reports ready. A
graph compiled after that is one a request waited for: it is counted (`late_graphs`) and logged.

On a CPU, a torch.export program of a fixed input size in fp32 is frozen instead (`freezes`): exported again with
its batch dynamic, and compiled by AOTInductor with Inductor's freezing (batch norms folded into the convolutions)
into one package in the cache directory, which every worker loads; a restart only loads it. Its convolutions' weights
are packed for oneDNN in the package (`packing`), so no call copies them. It is the faster way there
(docs/benchmarks.md). Its own kernels run on one thread; oneDNN's convolutions take the worker's thread count as they
run. Other modules keep torch.compile, which still runs the Python they hold
(a traced program holds none), as does a program torch.export cannot trace again (with a warning).

torch.compile's CPU kernels keep the thread count they were compiled at (kernels that read it at run time,
`cpp.dynamic_threads`, ran the ResNet-50 about a third slower), so each of the worker's two thread counts, alone and
under load, gets kernels of its own. Torch runs the code it finds in the cache directory, so that directory must be
this user's, writable by no other (`cache_directory`).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import platform
import stat
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

import torch

from imgserve.config import COMPILED_BY_DEFAULT, BuiltinModel
from imgserve.models.loader import ModelLoadError
from imgserve.models.native import NativeModule

log = logging.getLogger(__name__)
CACHE_FOLDER = Path("imgserve", "compiled")  # under $XDG_CACHE_HOME (~/.cache) when no directory is set
CPU_FACTS = "/proc/cpuinfo"  # the CPU's model and instruction sets, which name a package in the cache (Linux)
LOCK = "imgserve.lock"  # in the cache directory: held by the process that is compiling into it
SHARED_WRITE = stat.S_IWGRP | stat.S_IWOTH
FROZEN_ON = ("cpu",)  # device kinds whose fixed-size fp32 models are frozen into a package (docs/benchmarks.md)
# Freezing, the package's own kernels on one thread, and a dynamic batch that may be a batch of one.
FREEZING = {"freezing": True, "cpp.threads": 1, "aot_inductor.check_lowerbound": False}
LAYOUT_BATCHES = 64  # the weight packing checks oneDNN's layout at each batch size up to the largest, at most this


def wanted(setting: bool | None, device_type: str, model: torch.nn.Module, fixed_size: bool) -> bool:
    """Whether the model runs compiled: --compile / --no-compile, else the device kind's default for a model of a
    fixed input size (one that takes any size may be compiled again for a new one, on a request). A TorchScript
    module or an AOTInductor package never is (torch.compile cannot trace the one, the other is compiled already); an
    explicit --compile for one is refused."""
    kind = "a TorchScript model" if isinstance(model, torch.jit.ScriptModule) else None
    kind = "an AOTInductor package" if isinstance(model, NativeModule) else kind
    if kind and setting:
        raise ModelLoadError(f"--compile does not apply to {kind}: serve it without --compile, or a torch.export .pt2")
    if setting is None:
        return not kind and fixed_size and COMPILED_BY_DEFAULT[device_type]
    return not kind and setting


def one_line(exc: BaseException) -> str:
    """An exception for a warning: its type and message on one line, at most 300 characters."""
    return " ".join(f"{type(exc).__name__}: {exc}".split())[:300]


def freezes(model: torch.nn.Module, device_type: str, fixed_size: bool, precision: str) -> bool:
    """Whether a compiled model is frozen into a package: a traced program (a torch.export .pt2's module) of a fixed
    input size, in fp32 (a package cannot hold autocast), on a device kind where that is measured faster."""
    return isinstance(model, torch.fx.GraphModule) and fixed_size and precision == "fp32" and device_type in FROZEN_ON


def cache_directory(setting: str | None) -> Path:
    """Where compiled code is kept: `setting`, else $XDG_CACHE_HOME/imgserve/compiled. Made (mode 0700) if missing;
    refused unless it is a directory of this user's that no other user can write."""
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    path = Path(setting) if setting else base / CACHE_FOLDER
    problem = f"--compile-cache-dir {path} is not a directory of this user's that only it can write"
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        facts = path.lstat()
    except OSError as exc:
        raise ModelLoadError(f"{problem} ({exc})") from None
    if not stat.S_ISDIR(facts.st_mode) or facts.st_uid != os.getuid() or facts.st_mode & SHARED_WRITE:
        raise ModelLoadError(f"{problem}: torch would run the compiled code another user put there")
    return path


def _thread_lock_for_tqdm() -> None:
    """torch.fx builds a (hidden) tqdm progress bar while compiling, and tqdm's first bar makes a multiprocessing
    lock: a semaphore the main process reports as leaked, in a warning after imgserve's last line, whenever a worker
    is stopped. A thread lock does as well in a worker."""
    with contextlib.suppress(ImportError):
        import tqdm

        tqdm.tqdm.set_lock(threading.RLock())


def warm_key(settings: BuiltinModel, max_batch_size: int | Literal["auto"], device: torch.device) -> str:
    """What names a warm-up's code in the cache: the model file (path, size and time), the settings that shape its
    graphs, the device's kind and processor, the worker's threads, torch's version and the weight packing's. A cache
    shared by pods on other processors (a PersistentVolumeClaim) so never hands one a package made for another. A
    wrong match costs time, never correctness: the workers then compile beside each other, or one after the other."""
    model = settings.model[0]
    path = Path(model)
    facts = path.stat() if path.is_file() else None
    shape = (settings.input_size, max_batch_size, settings.precision, settings.channels_last)
    found = [model, facts and (facts.st_size, facts.st_mtime_ns), shape, device.type, processor(device)]
    from imgserve.models import packing  # torch's compiler (800 modules, 70 MiB a worker): only where one compiles

    versions = [torch.get_num_threads(), torch.__version__, packing.VERSION]
    return hashlib.sha256(repr([*found, *versions]).encode()).hexdigest()[:16]


def processor(device: torch.device) -> str:
    """The processor compiled code is made for: a GPU's name and compute capability, or the CPU's model and the
    instruction sets it has (a frozen package holds machine code and weight layouts for them); from /proc/cpuinfo."""
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} {torch.cuda.get_device_capability(device)}"
    facts: dict[str, str] = {}
    with contextlib.suppress(OSError):
        for line in Path(CPU_FACTS).read_text().splitlines():
            name, _, value = line.partition(":")
            facts.setdefault(name.strip(), value.strip())  # the first processor's; the others are the same
    return f"{facts.get('model name', platform.machine())} [{facts.get('flags', '')}]"


def graphs_compiled() -> int:
    """Graphs torch.compile has compiled in this process (dynamo's own counter)."""
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


class CompiledModel:
    """A model under torch.compile, its code cached in `cache`; `any_size`: the height and width vary too."""

    def __init__(
        self,
        model: torch.nn.Module,
        cache: Path,
        any_size: bool,
        warm_key: str,
        freeze: bool = False,
        largest: int | None = None,
        threads: Sequence[int] = (),
    ) -> None:
        """`freeze`: into a package for batches of up to `largest` (None: any), else torch.compile; its weights
        packed for the worker's thread counts, `threads` (none given: the count the package is made at)."""
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache)  # read when the first graph is compiled
        _thread_lock_for_tqdm()
        self.model, self.freeze, self.largest, self.threads = model, freeze, largest, threads
        self.function: Callable[[torch.Tensor], Any] = torch.compile(model)
        self.cache, self.dims = cache, (0, 2, 3) if any_size else (0,)
        self.warmed = cache / f"warmed-{warm_key}"  # made once a warm-up of this key has filled the cache
        self.package = cache / f"frozen-{warm_key}.pt2"
        self.frozen: str | None = None  # how the package came: "made" or "found in the cache"
        self.late_graphs = 0
        self._ready = False

    def __call__(self, batch: torch.Tensor) -> Any:
        if self.freeze:  # the first call: freeze, or stay with torch.compile
            self.freeze = False
            self.function = self._frozen(batch) or self.function
        for dim in self.dims:
            torch._dynamo.maybe_mark_dynamic(batch, dim)
        before = graphs_compiled()
        output = self.function(batch)
        if self._ready and graphs_compiled() > before:
            self.late_graphs += graphs_compiled() - before
            log.warning("the model was compiled again for a batch of shape %s: that batch waited", tuple(batch.shape))
        return output

    def _frozen(self, example: torch.Tensor) -> NativeModule | None:
        """The package for this key, made from the model on `example`'s layout if the cache lacks it; None where
        torch.export cannot trace the model."""
        if self.package.exists():
            self.frozen = "found in the cache"
            return NativeModule(self.package)
        pair = torch.cat([example[:1], example[:1]])  # a batch of two: export would fix a batch of one's size
        batch = torch.export.Dim("batch", min=1, max=self.largest)
        try:
            program = torch.export.export(self.model, (pair,), dynamic_shapes=({0: batch},))
        except Exception as exc:
            log.warning("torch.export cannot trace the model (%s): compiling it with torch.compile", one_line(exc))
            return None
        part = self.package.with_name(f".{os.getpid()}-{self.package.name}")  # renamed into place once whole
        batches = range(1, min(self.largest or LAYOUT_BATCHES, LAYOUT_BATCHES) + 1)
        from imgserve.models import packing  # torch's compiler: only where one compiles (see warm_key)

        configs = {**FREEZING, packing.CONFIG: packing.PackWeights(batches, self.threads or [torch.get_num_threads()])}
        torch._inductor.aoti_compile_and_package(program, package_path=str(part), inductor_configs=configs)
        part.replace(self.package)
        self.frozen = "made"
        return NativeModule(self.package)

    @contextlib.contextmanager
    def compiling(self) -> Iterator[None]:
        """Hold the cache directory while compiling: one process at a time compiles into it, so the device's other
        workers find its code there instead of compiling it again beside it. Once a warm-up of the same key has
        filled it, the workers only read it, all at once."""
        if self.warmed.exists():
            yield
            return
        with open(self.cache / LOCK, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file is closed
            yield
            self.warmed.touch()

    def warm_up(self, run: Callable[[int], object], sizes: list[int], threads: list[int]) -> None:
        """Compile for every batch of `sizes` on every count of `threads` (torch guards a graph on the thread count)
        by `run`ning batches, after the caller's batch of one on the first count: each size on the first count, then
        on the others only the sizes that opened a graph (the rest pass its guards). From then on a new graph is one
        a request waited for. A package runs every batch size as it is: it has nothing to compile."""
        if self.frozen is None:
            _run_every_size(run, sizes, threads)
        self._ready = True

    def describe(self) -> str:
        """How many graphs were compiled, and how many of them the cache directory already held; or the package."""
        if self.frozen is not None:
            return f"frozen into a package, {self.frozen}: {self.package}"
        found = torch._dynamo.utils.counters["inductor"]["fxgraph_cache_hit"]
        return f"{graphs_compiled()} graphs, {found} of them from the cache in {self.cache}"


def _run_every_size(run: Callable[[int], object], sizes: list[int], threads: list[int]) -> None:
    """Each size on the first thread count, then on the others only the sizes that opened a graph."""
    opened = [1]
    for index, count in enumerate(threads):
        torch.set_num_threads(count)
        for size in sizes if index == 0 else opened:
            before = graphs_compiled()
            run(size)
            if index == 0 and graphs_compiled() > before:
                opened.append(size)
