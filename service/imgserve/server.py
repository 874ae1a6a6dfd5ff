"""The composition root: reads the machine, plans the pod (pod.py), builds what the plan says and runs it.

Imported by nothing but the command that runs it, and only after `PROMETHEUS_MULTIPROC_DIR` is set.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from collections.abc import AsyncIterator
from typing import Any

import litserve as ls
import torch
from starlette.routing import Route

from imgserve import heap, metrics
from imgserve.api import ImageAPI
from imgserve.config import Settings
from imgserve.engine import EngineServer
from imgserve.errors import install_handlers
from imgserve.frontend import docs_page, openapi, telemetry
from imgserve.frontend.admission import Admission, AdmissionMiddleware
from imgserve.frontend.auth import ApiKeyMiddleware, KeyProblem, Keys
from imgserve.frontend.connections import GuardedHttpToolsProtocol
from imgserve.frontend.inference import CodecThreads, Inference
from imgserve.frontend.litserve_route import LitServeRoute
from imgserve.frontend.routes import Routes
from imgserve.frontend.v2 import grpc_service
from imgserve.frontend.v2.http import V2Routes
from imgserve.frontend.v2.model import ServedModel
from imgserve.handoff.answers import AnswerSockets
from imgserve.handoff.directory import ServerDirectory
from imgserve.handoff.dispatch import Dispatcher
from imgserve.handoff.requests import RequestSocket
from imgserve.handoff.state import SharedState
from imgserve.models import outputs
from imgserve.models.builtin import LocalKinds, ModelAPI
from imgserve.models.loader import ModelLoadError, check_model_source
from imgserve.models.shared import SharedWeights
from imgserve.pod import PodPlan, available_ram, plan_pod, read_machine
from imgserve.startup import load_api, load_weights, probe_gpu, resolve_device
from imgserve.supervisor.children import Supervisor
from imgserve.supervisor.lifecycle import install_drain_on_signals
from imgserve.version import __version__
from imgserve.worker.api import WorkerAPI, WorkerPlan

log = logging.getLogger(__name__)


class ImageServer(EngineServer):
    """The server the plan describes: the API behind imgserve's routes, admission and keys, the hand-off sockets,
    the supervisor, and the inference workers LitServe starts."""

    def __init__(
        self,
        settings: Settings,
        directory: ServerDirectory,
        keys: Keys,
        api: ls.LitAPI,
        weights: SharedWeights,
        plan: PodPlan,
        state: SharedState,
    ) -> None:
        self.settings, self.directory, self.keys, self.api = settings, directory, keys, api
        self.weights, self.plan, self.state = weights, plan, state
        self.front_end_host = settings.host
        self.dispatcher = Dispatcher(state, directory.slots, plan.slots_per_front_end, settings.retry_after_s)
        worker_plan = WorkerPlan(
            directory.slots,
            weights,
            plan.batch_size,
            settings.batch_timeout_ms / 1000,
            settings.max_batch_size == "auto",
            plan.torch_threads,
            plan.workers_per_device,
            plan.reserved_slot_bytes,
        )
        self.supervisor = Supervisor(self)  # started with the front ends
        self.admission = Admission(state, settings, lambda: self.queue_limit)
        super().__init__(
            WorkerAPI(api, settings, state, worker_plan),
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
        facts = telemetry.ModelFacts(
            describe_api(settings, api), settings.precision, plan.devices, copies * weights.nbytes, __version__
        )
        self.pod_collector = telemetry.PodCollector(state, directory.slots, facts)
        metrics.preregister()

    def add_routes(self) -> None:
        self.inference = Inference(self.dispatcher, self.admission, CodecThreads(self.plan.codec_threads_per_front_end))
        routes = Routes(
            self.settings,
            self.state,
            self.inference,
            lambda: telemetry.exposition(self.pod_collector),
            self.describe,
            self.setup_status,
        )
        api = self.api
        name: str | None = None  # the model's name in the Open Inference Protocol: an ImageAPI's
        if isinstance(api, ImageAPI):
            predict = routes.predict_with(api)
            for path in telemetry.PREDICT_PATHS:
                self.app.router.routes.append(Route(path, predict, methods=["POST"]))
            name = self.settings.model_name or api.name or type(api).__name__
            model = ServedModel(api, name, self.settings, self.state, self.inference, routes.not_ready_reason)
            self.app.router.routes.extend(V2Routes(model, self.settings.max_body_bytes).routes())
            self.grpc_servicer: grpc_service.Servicer | None = grpc_service.Servicer(model, self.settings, self.keys)
        else:
            LitServeRoute(api, self.inference, self.settings).register(self.app)
            self.grpc_servicer = None
        for path, endpoint in (
            ("/health/live", routes.live),
            ("/health/ready", routes.ready),
            ("/health", routes.ready),
            ("/info", routes.info),
            ("/metrics", routes.metrics),
        ):
            self.app.router.routes.append(Route(path, endpoint, methods=["GET"]))
        if self.settings.docs:  # after every other route: the document describes them
            described = openapi.document(self.settings, api, name, self.app.routes)
            self.app.router.routes.extend(docs_page.routes(described))

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
        if front_end != 0 or not self.settings.grpc_port or self.grpc_servicer is None:
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
            "model": describe_api(self.settings, self.api),
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
            "batch_element_budget": limits["element_budget"],
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


def serve(settings: Settings, directory: ServerDirectory, api: ls.LitAPI | None = None) -> int:
    """Serve `api` (else --api's, else the built-in API over --model) until SIGTERM/SIGINT, in the server's private
    `directory` (its caller removes it). The exit code is 0 after a clean drain, 1 if workers kept dying, 2 when
    what the user named cannot be served (one line says why)."""
    settings.configure_logging()
    try:
        if api is None and settings.api:
            api = load_api(settings.api)
        if api is None:
            check_model_source(settings.model, settings.model_factory)
            outputs.read_labels(settings.labels)
        keys = Keys.load(settings, directory.root / "api-keys")  # a key source that yields no key: no server
    except (ModelLoadError, KeyProblem) as exc:
        log.error("imgserve: %s", exc)
        return 2
    serves_grpc = settings.grpc_port and (api is None or isinstance(api, ImageAPI))
    if serves_grpc and not port_free(settings.host, settings.grpc_port):
        log.error(
            "imgserve: --grpc-port %d is already in use on %s (0 turns gRPC off)", settings.grpc_port, settings.host
        )
        return 2
    try:
        return run_server(build_server(settings, directory, keys, api))
    except ModelLoadError as exc:
        log.error("imgserve: %s", exc)
        return 2


def build_server(settings: Settings, directory: ServerDirectory, keys: Keys, api: ls.LitAPI | None) -> ImageServer:
    """Load the weights once, plan the pod on this machine and build it around `api` (None: the built-in API)."""
    settings = with_batching(settings, api)
    if api is not None and not isinstance(api, ImageAPI) and settings.grpc_port:
        log.info("a plain LitAPI has no Open Inference Protocol routes: gRPC is off")
        settings = settings.model_copy(update={"grpc_port": 0})
    device_type = resolve_device(settings.device)
    devices = torch.cuda.device_count() if device_type == "cuda" else 1
    source: tuple[str | None, str | None]
    if api is None:
        source = (settings.model, settings.model_factory)
    else:  # the API's class attributes, which ImageAPI.load_model builds its module from
        source = (getattr(api, "model", None), getattr(api, "model_factory", None))
    weights = load_weights(*source, settings, device_type, devices, directory.weights)
    cuda = device_type == "cuda"
    probe = None
    if cuda and settings.workers_per_device == "auto" and (api is None or isinstance(api, ImageAPI)):
        probe = probe_gpu(api or ModelAPI(settings, LocalKinds(), pad=True), settings, weights)
    free = torch.cuda.mem_get_info(0)[0] if cuda else available_ram()
    plan = plan_pod(settings, read_machine(device_type, devices, free, probe))
    for warning in plan.warnings:
        log.warning("%s", warning)
    if plan.passive_openmp:  # workers spawned from now on: OpenMP threads sleep when they wait instead of spinning
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    state = SharedState(plan.workers, plan.slots_per_front_end * plan.front_ends, plan.front_ends)
    served = api or ModelAPI(settings, state, pad=plan.pad_mixed_sizes)
    return ImageServer(settings, directory, keys, served, weights, plan, state)


def with_batching(settings: Settings, api: ls.LitAPI | None) -> Settings:
    """The settings with the batch size and timeout the workers use: a flag or IMGSERVE_ variable set explicitly wins,
    then what the API asked for, then the settings' defaults. A plain LitAPI keeps its own, as LitServe runs it."""
    explicit = settings.model_fields_set
    if api is None:
        return settings
    if isinstance(api, ImageAPI):
        size, timeout_s = api.batching
    else:
        size, timeout_s = api.max_batch_size, api.batch_timeout
    update: dict[str, Any] = {}
    if "max_batch_size" not in explicit and size is not None:
        update["max_batch_size"] = size
    if "batch_timeout_ms" not in explicit and timeout_s is not None:
        update["batch_timeout_ms"] = 1000 * timeout_s
    if not isinstance(api, ImageAPI) and update.get("max_batch_size", settings.max_batch_size) == "auto":
        update["max_batch_size"] = api.max_batch_size  # nothing to measure a plain LitAPI's memory on
    return settings.model_copy(update=update)


def describe_api(settings: Settings, api: ls.LitAPI) -> str:
    """What /info and imgserve_model_info call the served model: the model file, or the API's class."""
    if isinstance(api, ModelAPI):
        return settings.model
    return f"{type(api).__module__}.{type(api).__qualname__}"


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
