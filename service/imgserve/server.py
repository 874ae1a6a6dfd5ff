"""The composition root: reads the machine, plans the pod (pod.py), builds what the plan says and runs it.

The main process binds the port, spawns the inference workers, forks the HTTP front ends onto the port and
supervises them all (supervisor/), with nothing between them but the hand-off's sockets and shared memory. Imported
by nothing but the command that runs it, and only after `PROMETHEUS_MULTIPROC_DIR` is set.
"""

from __future__ import annotations

import gc
import logging
import multiprocessing as mp
import os
import pickle
import socket
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from typing import Any

import litserve as ls
import torch

from imgserve import metrics, tracing
from imgserve.api import ImageAPI
from imgserve.config import Access, Batching, Logging, Settings
from imgserve.frontend import process as front_end_process
from imgserve.frontend import telemetry
from imgserve.frontend.admission import Admission
from imgserve.frontend.app import FrontEnd, Served
from imgserve.frontend.auth import KeyProblem, Keys
from imgserve.frontend.connections import GuardedHttpToolsProtocol
from imgserve.frontend.inference import CodecThreads, Inference
from imgserve.handoff.answers import AnswerSockets
from imgserve.handoff.directory import ServerDirectory
from imgserve.handoff.dispatch import Dispatcher
from imgserve.handoff.requests import RequestSocket
from imgserve.handoff.state import SharedState
from imgserve.litapi import LitServeAPI
from imgserve.models import outputs
from imgserve.models.builtin import LocalKinds, ModelAPI, pads
from imgserve.models.loader import ModelLoadError, check_model_source
from imgserve.models.shared import SharedWeights
from imgserve.pod import PodPlan, available_ram, plan_pod, read_machine
from imgserve.startup import StartupError, load_api, load_weights, probe_gpu, resolve_device
from imgserve.supervisor.children import Children
from imgserve.supervisor.lifecycle import Lifecycle
from imgserve.version import __version__
from imgserve.worker import process as worker_process
from imgserve.worker.serving import WorkerPlan

log = logging.getLogger(__name__)
BACKLOG = 2048  # connections the kernel queues for the front ends to accept (uvicorn's default)


def serve(settings: Settings, directory: ServerDirectory, api: ls.LitAPI | None = None) -> int:
    """Serve `api` (else --api's, else the built-in API over --model) until SIGTERM/SIGINT, in the server's private
    `directory` (its caller removes it). The exit code is 0 after a clean drain, 1 if children kept dying, 2 when
    what the user named cannot be served (one line says why)."""
    settings.configure_logging()
    try:
        user_api = api or (load_api(settings.api) if settings.api else None)
        if user_api is None:
            check_model_source(settings.model, settings.model_factory)
            outputs.read_labels(settings.labels)
        elif given := settings.model_settings_given():
            flags = ", ".join(f"--{name.replace('_', '-')}" for name in given)
            raise StartupError(f"{flags}: the built-in model's settings do not apply to an API of your own")
        tracing_problem = tracing.check()  # the SDK itself starts in each child process, after its fork or spawn
        if tracing_problem is not None:
            raise StartupError(tracing_problem)
        keys = Keys.load(settings.part(Access), directory.root / "api-keys")  # a key source without a key: none
        serves_grpc = settings.grpc_port and not (user_api is not None and not isinstance(user_api, ImageAPI))
        if serves_grpc and not port_free(settings.host, settings.grpc_port):
            raise StartupError(
                f"--grpc-port {settings.grpc_port} is already in use on {settings.host} (0 turns gRPC off)"
            )
        listening = listen(settings.host, settings.port)
    except (ModelLoadError, KeyProblem) as exc:
        log.error("imgserve: %s", exc)
        return 2
    with listening:
        try:
            pod = build(settings, directory, user_api)
            return processes(pod, directory, keys).run(pod, listening)
        except ModelLoadError as exc:
            log.error("imgserve: %s", exc)
            return 2


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
    """What the plan built: the served API and the facts /info shows of it."""

    settings: Settings
    served: Served
    plan: PodPlan
    weights: SharedWeights
    state: SharedState

    def queue_limit(self) -> int:
        """The admission bound, from the batch size the workers settled on at warm-up (max_batch_size auto)."""
        return self.plan.queue_bound(self.state.limits["max_batch_size"] or self.plan.batch_size)

    def describe(self) -> dict[str, Any]:
        """What GET /info answers."""
        limits, plan, settings, batching = self.state.limits, self.plan, self.settings, self.served.batching
        return {
            "model": self.served.api.describe(),
            "device": plan.devices[0],
            "devices": plan.devices,
            "precision": self.served.api.precision,
            "workers": plan.workers,
            "workers_per_device": plan.workers_per_device,
            "workers_per_device_why": plan.workers_per_device_why,
            "api_servers": plan.front_ends,
            "torch_threads_per_worker": plan.torch_threads.alone,
            "torch_threads_per_worker_under_load": plan.torch_threads.busy,
            "weights": self.weights.describe(),
            "max_batch_size": limits["max_batch_size"] or batching.max_batch_size,
            "batch_memory_budget_bytes_per_worker": limits["budget_bytes"],
            "batch_element_budget": limits["element_budget"],
            "batch_timeout_ms": batching.batch_timeout_ms,
            "max_queue_depth": self.queue_limit(),
            "request_timeout_s": settings.request_timeout_s,
            "max_body_bytes": settings.max_body_bytes,
            "max_image_pixels": settings.max_image_pixels,
            "task": self.state.task,  # the output kind the workers decided at warm-up
            "plan": plan.describe(),
            "version": __version__,
        }


@dataclass
class Processes:
    """What every front end and every worker is started with."""

    front_end: FrontEnd
    worker: worker_process.WorkerSpec

    def run(self, pod: Pod, listening: socket.socket) -> int:
        """Start the children on `listening`, supervise them until the server stops; the exit code."""
        settings, plan = pod.settings, pod.plan
        options = {
            "host": settings.host,
            "port": settings.port,
            "log_level": settings.log_level,
            "access_log": False,  # the front ends write their own line, with the request id (frontend/tracing.py)
            "http": GuardedHttpToolsProtocol.configured(settings, self.front_end.inference.admission),
        }
        # A forked child shares the main process's Python objects until either writes to their pages, and a full
        # garbage collection writes to every one: the garbage is collected once, before the first fork, and the
        # collector leaves the rest alone.
        gc.collect()

        def start_front_end(index: int) -> BaseProcess:
            gc.freeze()
            args = (self.front_end, index, listening, options, os.getpid())
            return _started(mp.get_context("fork").Process(target=front_end_process.run, args=args))

        def start_worker(index: int) -> BaseProcess:
            args = (self.worker, index, plan.devices[index // plan.workers_per_device])
            try:
                return _started(mp.get_context("spawn").Process(target=worker_process.run, args=args))
            except (AttributeError, TypeError, pickle.PicklingError) as exc:  # what spawn cannot send to a worker
                reason = f"cannot start an inference worker with the API: {type(exc).__name__}: {exc}"
                raise StartupError(reason) from None

        children = Children(start_worker, start_front_end, plan.workers, plan.front_ends)
        return Lifecycle(children, pod.state, settings.drain_timeout_s).run()


def _started(process: BaseProcess) -> BaseProcess:
    process.daemon = True  # should the main process ever exit without stopping it, multiprocessing does
    process.start()
    return process


def build(settings: Settings, directory: ServerDirectory, user_api: ls.LitAPI | None) -> Pod:
    """Load the weights once, plan the pod on this machine and build it around `user_api` (None: the built-in API)."""
    settings = with_batching(settings, user_api)
    device_type = resolve_device(settings.device)
    devices = torch.cuda.device_count() if device_type == "cuda" else 1
    api = user_api if isinstance(user_api, ImageAPI) or user_api is None else _adapted(user_api, settings)
    source = (settings.model, settings.model_factory) if api is None else (api.model, api.model_factory)
    weights = load_weights(*source, settings, device_type, devices, directory.weights)
    cuda = device_type == "cuda"
    probe = None
    if cuda and settings.workers_per_device == "auto" and not isinstance(api, LitServeAPI):
        probe = probe_gpu(api or ModelAPI(settings, LocalKinds(), pad=True), settings, weights)
    free = torch.cuda.mem_get_info(0)[0] if cuda else available_ram()
    plan = plan_pod(settings, read_machine(device_type, devices, free, probe))
    for warning in plan.warnings:
        log.warning("%s", warning)
    if plan.passive_openmp:  # workers spawned from now on: OpenMP threads sleep when they wait instead of spinning
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    state = SharedState(plan.workers, plan.slots_per_front_end * plan.front_ends, plan.front_ends)
    api = api or ModelAPI(settings, state, pads(settings, device_type), settings.retry_after_s)
    served = Served(api, settings.model_name or api.name or type(api).__name__, settings.part(Batching))
    return Pod(settings, served, plan, weights, state)


def processes(pod: Pod, directory: ServerDirectory, keys: Keys) -> Processes:
    """The front end and the workers' start, as the plan says."""
    settings, plan, state, served, weights = pod.settings, pod.plan, pod.state, pod.served, pod.weights
    admission = Admission(state, settings, pod.queue_limit)
    dispatcher = Dispatcher(state, directory.slots, plan.slots_per_front_end, settings.retry_after_s)
    inference = Inference(dispatcher, admission, CodecThreads(plan.codec_threads_per_front_end))
    requests, answers = RequestSocket(directory.root), AnswerSockets(directory.root, plan.front_ends)
    copies = 1 if weights.shared else plan.workers_per_device
    facts = telemetry.ModelFacts(
        served.api.describe(), served.api.precision or "", plan.devices, copies * weights.nbytes, __version__
    )
    collector = telemetry.PodCollector(state, directory.slots, facts)
    metrics.preregister()
    front_end = FrontEnd(
        served, settings, state, keys, inference, (requests, answers), lambda: telemetry.exposition(collector),
        pod.describe,
    )  # fmt: skip
    worker_plan = WorkerPlan(
        directory.slots,
        weights,
        plan.batch_size,
        served.batching.batch_timeout_ms / 1000,
        served.batching.max_batch_size == "auto",
        plan.torch_threads,
        plan.workers_per_device,
        plan.reserved_slot_bytes,
        settings.gpu_memory_fraction,
        settings.trust_pickle,
    )
    worker = worker_process.WorkerSpec(
        served.api, worker_plan, state, requests, answers, settings.part(Logging), os.getpid(), served.name
    )
    return Processes(front_end, worker)


def _adapted(api: ls.LitAPI, settings: Settings) -> LitServeAPI:
    """A plain LitAPI, carried by the ImageAPI core at the batch size and timeout it is served with."""
    size = settings.max_batch_size if isinstance(settings.max_batch_size, int) else api.max_batch_size
    return LitServeAPI(api, size, settings.batch_timeout_ms / 1000)


def with_batching(settings: Settings, api: ls.LitAPI | None) -> Settings:
    """The settings with the batch size and timeout the workers use: a flag or IMGSERVE_ variable set explicitly wins,
    then what the API asked for, then the settings' defaults. A plain LitAPI asks for what its attributes say, as
    LitServe runs it, and has nothing to measure `auto` on."""
    if api is None:
        return settings
    if isinstance(api, ImageAPI):
        size, timeout_s = api.batching
    else:
        size, timeout_s = api.max_batch_size, api.batch_timeout
    explicit = settings.model_fields_set
    update: dict[str, Any] = {}
    if "max_batch_size" not in explicit and size is not None:
        update["max_batch_size"] = size
    if "batch_timeout_ms" not in explicit and timeout_s is not None:
        update["batch_timeout_ms"] = 1000 * timeout_s
    if not isinstance(api, ImageAPI) and update.get("max_batch_size", settings.max_batch_size) == "auto":
        update["max_batch_size"] = api.max_batch_size
    return settings.model_copy(update=update)
