"""The composition root: reads the machine, plans the pod (pod.py), builds what the plan says and runs it.

The main process binds the port, spawns the inference workers, forks the HTTP front ends onto the port and
supervises them all (supervisor/), with nothing between them but the hand-off's sockets, pipes and shared memory.
Imported by nothing but the command that runs it, and only after `PROMETHEUS_MULTIPROC_DIR` is set.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import multiprocessing as mp
import os
import pickle
import socket
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

import litserve as ls
import msgpack
import torch

from imgserve import metrics, tracing
from imgserve.api import ImageAPI
from imgserve.config import Access, Logging, Settings
from imgserve.frontend import process as front_end_process
from imgserve.frontend import telemetry
from imgserve.frontend.admission import Admission
from imgserve.frontend.app import FrontEnd
from imgserve.frontend.auth import KeyProblem, Keys
from imgserve.frontend.connections import GuardedHttpToolsProtocol
from imgserve.frontend.inference import CodecThreads, Inference
from imgserve.handoff.answers import AnswerSockets
from imgserve.handoff.directory import ServerDirectory
from imgserve.handoff.dispatch import Dispatcher
from imgserve.handoff.requests import ModelRequests
from imgserve.handoff.state import SharedState
from imgserve.models import outputs
from imgserve.models.builtin import LocalKinds, ModelAPI, decodes_in_worker, pads
from imgserve.models.loader import ModelLoadError, check_model_source
from imgserve.pod import DeviceMemory, PodPlan, available_ram, plan_pod, read_machine
from imgserve.repository import Chosen, batching_of, catalog_of, chosen_models
from imgserve.served import Catalog
from imgserve.startup import StartupError, load_weights, probe_gpu, resolve_device
from imgserve.supervisor import forkserver
from imgserve.supervisor.children import Children
from imgserve.supervisor.lifecycle import Lifecycle
from imgserve.supervisor.models import ModelControl
from imgserve.version import __version__
from imgserve.worker import process as worker_process
from imgserve.worker.serving import WorkerPlan

log = logging.getLogger(__name__)
BACKLOG = 2048  # connections the kernel queues for the front ends to accept (uvicorn's default)
WORKER_OVERHEAD_ALLOWED = {"cpu": 256 << 20, "cuda": 512 << 20}  # a CUDA context; on a CPU, until measured


def serve(settings: Settings, directory: ServerDirectory, apis: Sequence[ls.LitAPI] = ()) -> int:
    """Serve `apis` and what the settings name (--api, --model, --model-repository; the built-in API over --model
    when nothing else is named) until SIGTERM/SIGINT, in the server's private `directory` (its caller removes it).
    The exit code is 0 after a clean drain, 1 if children kept dying, 2 when what the user named cannot be served
    (one line says why)."""
    settings.configure_logging()
    try:
        chosen = _checked(settings, chosen_models(settings, list(apis)))
        tracing_problem = tracing.check()  # the SDK itself starts in each child process, after its fork or spawn
        if tracing_problem is not None:
            raise StartupError(tracing_problem)
        keys = Keys.load(settings.part(Access), directory.root / "api-keys")  # a key source without a key: none
        with_v2 = any(one.api is None or isinstance(one.api, ImageAPI) for one in chosen)
        if settings.grpc_port and with_v2 and not port_free(settings.host, settings.grpc_port):
            raise StartupError(
                f"--grpc-port {settings.grpc_port} is already in use on {settings.host} (0 turns gRPC off)"
            )
        listening = listen(settings.host, settings.port)
    except (ModelLoadError, KeyProblem) as exc:
        log.error("imgserve: %s", exc)
        return 2
    with listening:
        try:
            pod = build(settings, directory, chosen)
            return processes(pod, directory, keys).run(pod, listening)
        except ModelLoadError as exc:
            log.error("imgserve: %s", exc)
            return 2


def _checked(settings: Settings, chosen: list[Chosen]) -> list[Chosen]:
    """The built-in model's settings describe built-in models: with none served they are a mistake. Each built-in
    model's file and labels are checked before any process starts."""
    builtin = [one.builtin for one in chosen if one.builtin is not None]
    if not builtin and (given := settings.model_settings_given()):
        flags = ", ".join(f"--{name.replace('_', '-')}" for name in given)
        raise StartupError(f"{flags}: the built-in model's settings do not apply to an API of your own")
    for model in builtin:
        check_model_source(model.model[0], model.model_factory)
        outputs.read_labels(model.labels)
    return chosen


def listen(host: str, port: int) -> socket.socket:
    """The listening socket every front end accepts from; StartupError when the port is taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listening = socket.socket(family, socket.SOCK_STREAM)
    listening.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listening.bind((host, port))
    except OSError as exc:
        listening.close()
        raise StartupError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    listening.listen(BACKLOG)
    listening.set_inheritable(True)
    return listening


def port_free(host: str, port: int) -> bool:
    """Can a server bind `host:port`? (The gRPC port, which the first front end binds later, where a clash would
    only show as a front end that keeps dying.)"""
    try:
        listen(host, port).close()
    except StartupError:
        return False
    return True


@dataclass
class Pod:
    """What the plan built: the served models, their control, and the facts /info shows of them."""

    settings: Settings
    catalog: Catalog
    plan: PodPlan
    state: SharedState
    control: ModelControl

    _bounds: dict[int, tuple[int, int]] = field(default_factory=dict, init=False, repr=False)
    _bounds_generation: int = field(default=-1, init=False, repr=False)

    def bounds(self, model: int) -> tuple[int, int]:
        """The pod's queue bound and `model`'s, at the batch sizes the loaded models settled on: asked three times a
        request, worked out again only once a model's state or limits changed (ModelStates.generation)."""
        generation = self.state.models.generation
        if generation != self._bounds_generation:
            self._bounds, self._bounds_generation = {}, generation
        found = self._bounds.get(model)
        if found is None:
            sizes = [self.batch_size(index) for index in range(len(self.catalog)) if self.state.models.ready(index)]
            found = self.plan.queue_bound(sizes or [1]), self.plan.model_queue_bound(self.batch_size(model))
            self._bounds[model] = found
        return found

    def batch_size(self, model: int) -> int:
        limits = self.state.models.limits(model)
        configured = self.catalog[model].batching.max_batch_size
        return limits.batch_size if limits else configured if isinstance(configured, int) else 1

    def describe(self) -> dict[str, Any]:
        """What GET /info answers: the pod, and each model's part of it (the first model's at the top as well)."""
        plan, settings, models = self.plan, self.settings, [self.describe_model(model) for model in self.catalog]
        first = models[0]
        return {
            "model": first["model"],
            "device": plan.devices[0],
            "devices": plan.devices,
            "precision": first["precision"],
            "workers": plan.workers,
            "workers_per_device": plan.workers_per_device,
            "workers_per_device_why": plan.workers_per_device_why,
            "api_servers": plan.front_ends,
            "torch_threads_per_worker": plan.torch_threads.alone,
            "torch_threads_per_worker_under_load": plan.torch_threads.busy,
            **{key: first[key] for key in ("weights", "max_batch_size", "batch_timeout_ms", "task")},
            "batch_memory_budget_bytes_per_worker": first["batch_memory_budget_bytes_per_worker"],
            "batch_element_budget": first["batch_element_budget"],
            "max_queue_depth": self.bounds(0)[0],
            "request_timeout_s": settings.request_timeout_s,
            "max_body_bytes": settings.max_body_bytes,
            "max_image_pixels": settings.max_image_pixels,
            "models": models,
            "plan": plan.describe(),
            "version": __version__,
        }

    def describe_model(self, served: Any) -> dict[str, Any]:
        index, states = served.index, self.state.models
        limits, weights = states.limits(index), self.control.weights.get(index)
        return {
            "name": served.name,
            "model": served.api.describe(),
            "path": served.paths[0],
            "state": ("UNAVAILABLE", "LOADING", "READY", "UNLOADING")[states.state(index)],
            "precision": served.api.precision,
            "weights": None if weights is None else weights.describe(),
            "max_batch_size": self.batch_size(index) if limits else served.batching.max_batch_size,
            "batch_timeout_ms": served.batching.batch_timeout_ms,
            "batch_memory_budget_bytes_per_worker": limits.budget_bytes if limits else None,
            "batch_element_budget": limits.element_budget if limits else None,
            "max_queue_depth": self.bounds(index)[1],
            "task": states.task(index),
        }


@dataclass
class Processes:
    """What every front end and every worker is started with."""

    front_end: FrontEnd
    worker: worker_process.WorkerSpec

    def run(self, pod: Pod, listening: socket.socket) -> int:
        """Start the children on `listening`, supervise them until the server stops; the exit code."""
        settings, plan, control = pod.settings, pod.plan, pod.control
        options = {
            "host": settings.host,
            "port": settings.port,
            "log_level": settings.log_level,
            "access_log": False,  # the front ends write their own line, with the request id (frontend/tracing.py)
            "http": GuardedHttpToolsProtocol.configured(settings, self.front_end.inference.admission),
        }
        pipes: dict[int, Connection] = {}  # each worker's control pipe, the main process's end
        control.send = lambda command: _send(pipes, command)
        # A forked child shares the main process's Python objects until either writes to their pages, and a full
        # garbage collection writes to every one: the garbage is collected once, before the first fork, and the
        # collector leaves the rest alone.
        gc.collect()

        def start_front_end(index: int) -> BaseProcess:
            gc.freeze()
            args = (self.front_end, index, listening, options, os.getpid())
            return _started(mp.get_context("fork").Process(target=front_end_process.run, args=args))

        def start_worker(index: int) -> BaseProcess:
            reader, pipes[index] = forkserver.context().Pipe(duplex=False)
            held = {model: weights for model, weights in control.weights.items() if pod.state.models.wanted(model)}
            spec = dataclasses.replace(self.worker, weights=held)
            args = (spec, index, plan.devices[index // plan.workers_per_device], reader)
            try:
                return _started(forkserver.context().Process(target=worker_process.run, args=args))
            except (AttributeError, TypeError, pickle.PicklingError) as exc:  # what spawn cannot send to a worker
                reason = f"cannot start an inference worker with the API: {type(exc).__name__}: {exc}"
                raise StartupError(reason) from None
            finally:
                reader.close()

        children = Children(start_worker, start_front_end, plan.workers, plan.front_ends)
        return Lifecycle(children, pod.state, settings.drain_timeout_s, control).run()


def _send(pipes: dict[int, Connection], command: dict[str, Any]) -> None:
    """A command to every worker, as msgpack (a worker that died meanwhile is replaced with what is loaded)."""
    data = msgpack.packb(command)
    for pipe in pipes.values():
        try:
            pipe.send_bytes(data)
        except OSError:
            continue


def _started(process: BaseProcess) -> BaseProcess:
    process.daemon = True  # should the main process ever exit without stopping it, multiprocessing does
    process.start()
    return process


def build(settings: Settings, directory: ServerDirectory, chosen: list[Chosen]) -> Pod:
    """Plan the pod on this machine for the chosen models, and load the weights of those loaded at start once."""
    device_type = resolve_device(settings.device)
    devices = torch.cuda.device_count() if device_type == "cuda" else 1
    batching = [batching_of(one, settings) for one in chosen]
    cuda = device_type == "cuda"
    free = min(torch.cuda.mem_get_info(i)[0] for i in range(devices)) if cuda else available_ram()
    probe = None
    if cuda and settings.workers_per_device == "auto":
        probe = _probe(settings, chosen[0], device_type, directory)
    # The front ends need fewer cores where the device decodes every model's uploads (the built-in's decode_in).
    on_device = cuda and all(one.builtin is not None and decodes_in_worker(one.builtin, device_type) for one in chosen)
    machine = read_machine(device_type, devices, free, probe)
    plan = plan_pod(settings, machine, [b.max_batch_size for b in batching], decode_on_device=on_device)
    for warning in plan.warnings:
        log.warning("%s", warning)
    state = SharedState(plan.workers, plan.slots_per_front_end * plan.front_ends, plan.front_ends, len(chosen))
    catalog = catalog_of(chosen, batching, state.models.kinds, device_type, settings.retry_after_s)
    memory = DeviceMemory(
        "cpu" if not cuda else "each GPU",
        free,
        settings.gpu_memory_fraction,
        plan.workers_per_device,
        WORKER_OVERHEAD_ALLOWED[device_type],
        plan.reserved_slot_bytes,
    )

    def prepare(model: int) -> Any:
        api, name = catalog[model].api, catalog[model].name
        return load_weights(api.model, api.model_factory, settings, device_type, devices, directory.weights / name)

    control = ModelControl(catalog, state, memory, prepare)
    control.start_with(_loaded_at_start(settings, catalog))
    return Pod(settings, catalog, plan, state, control)


def _loaded_at_start(settings: Settings, catalog: Catalog) -> list[int]:
    """Every model, unless --model-control explicit: then those --load-model names (* for all)."""
    if settings.model_control != "explicit":
        if settings.load_model:
            raise StartupError("--load-model names the models to load at start with --model-control explicit")
        return list(range(len(catalog)))
    names = set(settings.load_model)
    unknown = names - {"*", *catalog.names}
    if unknown:
        raise StartupError(f"--load-model {sorted(unknown)[0]}: no such model ({', '.join(catalog.names)})")
    return [model.index for model in catalog if "*" in names or model.name in names]


def _probe(settings: Settings, first: Chosen, device_type: str, directory: ServerDirectory) -> Any:
    """One probe batch of the first model on the first GPU (workers_per_device auto)."""
    if first.builtin is not None:
        pad = pads(first.builtin, device_type)
        api: ImageAPI = ModelAPI(first.builtin, LocalKinds(), pad, max_batch_size=settings.max_batch_size)
    elif isinstance(first.api, ImageAPI):
        api = first.api
    else:
        return None
    weights = load_weights(api.model, api.model_factory, settings, device_type, 1, directory.weights / "probe")
    return probe_gpu(api, settings, weights)


def processes(pod: Pod, directory: ServerDirectory, keys: Keys) -> Processes:
    """The front end and the workers' start, as the plan says."""
    settings, plan, state, catalog = pod.settings, pod.plan, pod.state, pod.catalog
    admission = Admission(state, catalog, settings.retry_after_s, pod.bounds)
    dispatcher = Dispatcher(state, directory.slots, plan.slots_per_front_end, settings.retry_after_s)
    inference = Inference(dispatcher, admission, CodecThreads(plan.codec_threads_per_front_end))
    requests = ModelRequests(directory.root, len(catalog))
    answers = AnswerSockets(directory.root, plan.front_ends)
    facts = telemetry.PodFacts(
        [telemetry.ModelFacts(m.name, m.api.describe(), m.api.precision or "") for m in catalog],
        plan.devices,
        __version__,
    )
    collector = telemetry.PodCollector(state, directory.slots, facts)
    metrics.preregister(catalog.names)
    front_end = FrontEnd(
        catalog, settings, state, keys, inference, (requests, answers), lambda: telemetry.exposition(collector),
        pod.describe,
    )  # fmt: skip
    worker_plan = WorkerPlan(directory.slots, plan.torch_threads, settings.trust_pickle, settings.trust_native_code)
    worker = worker_process.WorkerSpec(
        catalog, worker_plan, state, requests, answers, settings.part(Logging), os.getpid(), {}
    )
    return Processes(front_end, worker)
