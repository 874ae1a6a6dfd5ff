"""The composition root: reads the machine, plans the pod (pod.py), builds what the plan says and runs it.

Imported by nothing but the command that runs it, and only after `PROMETHEUS_MULTIPROC_DIR` is set.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from starlette.routing import Route

from imgserve import __version__, heap, metrics
from imgserve.config import Settings
from imgserve.engine import EngineServer
from imgserve.errors import install_handlers
from imgserve.frontend import telemetry
from imgserve.frontend.admission import Admission, AdmissionMiddleware
from imgserve.frontend.auth import ApiKeyMiddleware, KeyProblem, Keys
from imgserve.frontend.connections import GuardedHttpToolsProtocol
from imgserve.frontend.inference import CodecThreads, Inference
from imgserve.frontend.routes import Routes
from imgserve.frontend.v2 import grpc_service
from imgserve.frontend.v2.http import V2Routes
from imgserve.frontend.v2.model import ServedModel
from imgserve.handoff.answers import AnswerSockets
from imgserve.handoff.directory import ServerDirectory
from imgserve.handoff.dispatch import Dispatcher
from imgserve.handoff.requests import RequestSocket
from imgserve.handoff.state import SharedState
from imgserve.models import outputs, shared
from imgserve.models.loader import ModelLoadError, check_model_source, load_model
from imgserve.models.shared import SharedWeights
from imgserve.pod import GpuProbe, PodPlan, available_ram, plan_pod, read_machine
from imgserve.supervisor.children import Supervisor
from imgserve.supervisor.lifecycle import install_drain_on_signals
from imgserve.worker.api import ImageAPI, WorkerPlan
from imgserve.worker.batching import BatchRunner, InMemory

log = logging.getLogger(__name__)
PROBE_BATCH = 8  # the batch timed for workers_per_device auto on a GPU when max_batch_size is auto too


def resolve_device(device: str) -> str:
    """auto -> cuda when torch sees a GPU, else cpu."""
    if device == "cuda" and not torch.cuda.is_available():
        print("imgserve: --device cuda was asked for but torch sees no GPU", file=sys.stderr)
        raise SystemExit(2)
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def load_weights(settings: Settings, device_type: str, devices: int, directory: Path) -> SharedWeights:
    """Load the model once, here in the main process, and share its weights with the workers of each device."""
    try:
        model = load_model(settings.model, settings.model_factory, settings.trust_pickle)
    except ModelLoadError:
        raise
    except Exception as exc:  # the user's factory or file: one line, as a worker's failure would say it
        raise ModelLoadError(f"cannot load the model: {type(exc).__name__}: {exc}") from None
    names = [f"cuda:{index}" for index in range(devices)] if device_type == "cuda" else ["cpu"]
    return shared.prepare(model, device_type, names, directory, settings.share_weights, settings.channels_last)


def probe_gpu(settings: Settings, weights: SharedWeights) -> GpuProbe:
    """One batch timed on cuda:0 (for workers_per_device auto): a worker's own CPU seconds and the device's."""
    device = torch.device("cuda:0")
    shared_tensors = weights.owner.get(str(device))  # the main process's copy: adopted, not copied
    model = load_model(settings.model, settings.model_factory, settings.trust_pickle, shared_tensors).to(device)
    runner = BatchRunner.for_settings(model, device, settings, pad=settings.pad_mixed_sizes is not False)
    batch = settings.max_batch_size if isinstance(settings.max_batch_size, int) else PROBE_BATCH
    side = runner.probe_side
    images = [InMemory(np.zeros((side, side, 3), dtype=np.uint8)) for _ in range(batch)]
    try:
        runner.measure(settings.gpu_memory_fraction)  # warm-up (and the channels_last fallback)
        batch, cpu_s, device_s = runner.split_seconds(images)  # halved until it fits
    except torch.OutOfMemoryError:
        raise ModelLoadError(f"the model runs out of GPU memory on one {side}x{side} image") from None
    del runner, model
    torch.cuda.empty_cache()
    return GpuProbe(batch, side, cpu_s, device_s)


def plan_for(settings: Settings, weights: SharedWeights, device_type: str, devices: int) -> PodPlan:
    """Read this machine (timing a probe batch when the GPU's worker count is `auto`) and plan the pod on it."""
    cuda = device_type == "cuda"
    probe = probe_gpu(settings, weights) if cuda and settings.workers_per_device == "auto" else None
    free = torch.cuda.mem_get_info(0)[0] if cuda else available_ram()
    return plan_pod(settings, read_machine(device_type, devices, free, probe))


class ImageServer(EngineServer):
    """The server the plan describes: imgserve's routes, admission and keys in front, the hand-off sockets, the
    supervisor, and the inference workers LitServe starts."""

    def __init__(
        self, settings: Settings, directory: ServerDirectory, keys: Keys, weights: SharedWeights, plan: PodPlan
    ) -> None:
        self.settings, self.directory, self.keys, self.weights, self.plan = settings, directory, keys, weights, plan
        self.front_end_host = settings.host
        self.state = SharedState(
            plan.workers, request_slots=plan.slots_per_front_end * plan.front_ends, front_ends=plan.front_ends
        )
        self.dispatcher = Dispatcher(self.state, directory.slots, plan.slots_per_front_end, settings.retry_after_s)
        worker_plan = WorkerPlan(
            directory.slots,
            weights,
            plan.batch_size,
            plan.torch_threads,
            plan.workers_per_device,
            plan.reserved_slot_bytes,
            plan.pad_mixed_sizes,
        )
        self.supervisor = Supervisor(self)  # started with the front ends
        self.admission = Admission(self.state, settings, lambda: self.queue_limit)
        super().__init__(
            ImageAPI(settings, self.state, worker_plan),
            accelerator=plan.device_type,
            devices=len(plan.devices),
            workers_per_device=plan.workers_per_device,
            timeout=False,  # deadlines are imgserve's (admission + worker), per request
            disable_openapi_url=True,  # no /docs, /redoc, /openapi.json
            middlewares=[  # the last is outermost
                (AdmissionMiddleware, {"admission": self.admission, "settings": settings}),
                (ApiKeyMiddleware, {"settings": settings, "keys": keys}),
                telemetry.MetricsMiddleware,
            ],
        )
        install_handlers(self.app)
        copies = 1 if weights.shared else plan.workers_per_device
        self.pod_collector = telemetry.PodCollector(
            self.state,
            directory.slots,
            telemetry.ModelFacts(
                settings.model, settings.precision, plan.devices, copies * weights.nbytes, __version__
            ),
        )
        metrics.preregister()

    def add_routes(self) -> None:
        self.inference = Inference(
            self.settings,
            self.state,
            self.dispatcher,
            self.admission,
            CodecThreads(self.plan.codec_threads_per_front_end),
        )
        routes = Routes(
            self.settings,
            self.state,
            self.inference,
            lambda: telemetry.exposition(self.pod_collector),
            self.describe,
            self.setup_status,
        )
        for path in telemetry.PREDICT_PATHS:
            self.app.router.routes.append(Route(path, routes.predict, methods=["POST"]))
        model = ServedModel(self.settings, self.state, self.inference, routes.renderer, routes.not_ready_reason)
        self.app.router.routes.extend(V2Routes(model, self.settings.max_body_bytes).routes())
        self.grpc_servicer = grpc_service.Servicer(model, self.settings, self.keys)
        for path, endpoint in (
            ("/health/live", routes.live),
            ("/health/ready", routes.ready),
            ("/health", routes.ready),
            ("/info", routes.info),
            ("/metrics", routes.metrics),
        ):
            self.app.router.routes.append(Route(path, endpoint, methods=["GET"]))

    def hand_off(self, front_ends: int) -> tuple[RequestSocket, AnswerSockets]:
        return RequestSocket(self.directory.root), AnswerSockets(self.directory.root, front_ends)

    def front_ends_started(self) -> None:
        self.supervisor.start()

    def stopping(self) -> None:
        """The children LitServe stops are not taken for dead ones and replaced."""
        self.supervisor.stop()

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Any) -> AsyncIterator[None]:
        """Each front end's start: its dispatcher (requests and answers on its event loop, not LitServe's thread hop
        per answer), and its decoding threads share a few heap arenas; the first also serves gRPC (--grpc-port) on
        its event loop, until it stops."""
        heap.few_arenas()
        front_end = app.response_queue_id
        self.state.serve_as(front_end)
        self.dispatcher.start(front_end, self.request_queue, self.answer_transport.receiver(front_end))
        if front_end != 0 or not self.settings.grpc_port:
            yield
            return
        grpc_server = await grpc_service.start(self.grpc_servicer, self.settings)
        self.state.serve_grpc(True)  # ready waits for it: another front end may answer /health/ready first
        try:
            yield
        finally:
            self.state.serve_grpc(False)
            await grpc_server.stop(grpc_service.GRACE_S)

    def restart_front_end(self, index: int) -> Any:
        """Fork a new front end in place of front end `index` (the supervisor's word for it)."""
        return self.fork_front_end(index)

    @property
    def queue_limit(self) -> int:
        """The admission bound, from the batch size the workers settled on at warm-up (max_batch_size auto)."""
        return self.plan.queue_bound(self.state.limits["max_batch_size"] or self.plan.batch_size)

    def describe(self) -> dict[str, Any]:
        """What GET /info answers."""
        limits, plan = self.state.limits, self.plan
        return {
            "model": self.settings.model,
            "device": plan.devices[0],
            "devices": plan.devices,
            "precision": self.settings.precision,
            "workers": plan.workers,
            "workers_per_device": plan.workers_per_device,
            "workers_per_device_why": plan.workers_per_device_why,
            "api_servers": plan.front_ends,
            "torch_threads_per_worker": plan.torch_threads.alone,
            "torch_threads_per_worker_under_load": plan.torch_threads.busy,
            "weights": self.weights.describe(),
            "max_batch_size": limits["max_batch_size"] or self.settings.max_batch_size,
            "batch_memory_budget_bytes_per_worker": limits["budget_bytes"],
            "batch_pixel_budget": limits["pixel_budget"],
            "batch_timeout_ms": self.settings.batch_timeout_ms,
            "max_queue_depth": self.queue_limit,
            "request_timeout_s": self.settings.request_timeout_s,
            "max_body_bytes": self.settings.max_body_bytes,
            "max_image_pixels": self.settings.max_image_pixels,
            "task": self.state.task,  # the output kind the workers decided at warm-up
            "plan": plan.describe(),
            "version": __version__,
        }


def port_free(host: str, port: int) -> bool:
    """Can a server bind `host:port`? (The HTTP port LitServe binds itself; the gRPC port its first front end binds
    later, where a clash would only show as a front end that keeps dying.)"""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True


def serve(settings: Settings, directory: ServerDirectory) -> int:
    """Run until SIGTERM/SIGINT in the server's private `directory` (its caller removes it); the exit code is 0 after
    a clean drain, 1 if workers kept dying."""
    settings.configure_logging()
    try:
        check_model_source(settings.model, settings.model_factory)
        outputs.read_labels(settings.labels)
    except ModelLoadError as exc:
        log.error("imgserve: %s", exc)
        return 2
    try:
        keys = Keys.load(settings, directory.root / "api-keys")  # a key source that yields no key: no server
    except KeyProblem as exc:
        log.error("imgserve: %s", exc)
        return 2
    if settings.grpc_port and not port_free(settings.host, settings.grpc_port):
        log.error(
            "imgserve: --grpc-port %d is already in use on %s (0 turns gRPC off)", settings.grpc_port, settings.host
        )
        return 2
    try:
        return run_server(build_server(settings, directory, keys))
    except ModelLoadError as exc:
        log.error("imgserve: %s", exc)
        return 2


def build_server(settings: Settings, directory: ServerDirectory, keys: Keys) -> ImageServer:
    """Load the weights once, plan the pod on this machine and build it."""
    device_type = resolve_device(settings.device)
    devices = torch.cuda.device_count() if device_type == "cuda" else 1
    weights = load_weights(settings, device_type, devices, directory.weights)
    plan = plan_for(settings, weights, device_type, devices)
    for warning in plan.warnings:
        log.warning("%s", warning)
    if plan.passive_openmp:  # workers spawned from now on: OpenMP threads sleep when they wait instead of spinning
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return ImageServer(settings, directory, keys, weights, plan)


def run_server(server: ImageServer) -> int:
    """Serve until SIGTERM/SIGINT; 2 when a worker's setup failed (with its one-line reason)."""
    settings = server.settings
    install_drain_on_signals(server)
    try:
        server.run(
            host=settings.host,
            port=settings.port,
            num_api_servers=server.plan.front_ends,
            log_level=settings.log_level,
            generate_client_file=False,
            access_log=settings.access_log,
            http=GuardedHttpToolsProtocol.configured(settings, server.admission),
            ws="none",
        )
    except RuntimeError as exc:  # a worker's setup failed: it left its reason in the shared state
        for worker in server.inference_workers:  # the others would log their own failure after ours
            worker.terminate()
            worker.join(timeout=5)
        log.error("imgserve: %s", server.state.setup_failure or f"the model failed to load or warm up ({exc})")
        return 2
    return server.state.exit_code
