"""Builds and runs the LitServer: front-end routes and middleware, inference workers, drain and worker monitor.

Import it only after `PROMETHEUS_MULTIPROC_DIR` is set (the `imgserve serve` command does it first).
"""

from __future__ import annotations

import contextlib
import copy
import gc
import logging
import multiprocessing as mp
import socket
import sys
import threading
from collections.abc import AsyncIterator
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import litserve as ls
import numpy as np
import torch
import uvicorn
from litserve.utils import WorkerSetupStatus
from starlette.routing import Route

from imgserve import __version__, heap, metrics
from imgserve.config import GPU_BUSY_GOAL, MAX_CPU_WORKERS, Settings, gpu_workers_for, passive_openmp
from imgserve.errors import install_handlers
from imgserve.frontend import telemetry
from imgserve.frontend.admission import Admission, AdmissionMiddleware, queue_bound
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
from imgserve.supervisor.children import Supervisor
from imgserve.supervisor.lifecycle import FrontEndServer, install_drain_on_signals
from imgserve.worker.api import ImageAPI, WorkerPlan
from imgserve.worker.batching import AUTO_BATCH_CAP, BatchRunner, InMemory

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


def choose_gpu_workers(settings: Settings, weights: SharedWeights, device_type: str) -> tuple[int, str]:
    """workers_per_device auto: on a GPU from one probe batch timed on cuda:0 (config.gpu_workers_for); the reason."""
    if device_type != "cuda":
        return 1, f"one per core, at most {MAX_CPU_WORKERS}"
    device = torch.device("cuda:0")
    shared_tensors = weights.owner.get(str(device))  # the main process's copy: adopted, not copied
    model = load_model(settings.model, settings.model_factory, settings.trust_pickle, shared_tensors).to(device)
    runner = BatchRunner.for_settings(model, device, settings)
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
    workers = gpu_workers_for(cpu_s, device_s)
    return workers, (
        f"a batch of {batch} {side}x{side} images took {1000 * cpu_s:.1f} ms of a worker's CPU and "
        f"{1000 * device_s:.1f} ms on the GPU: {workers} worker(s) keep it {GPU_BUSY_GOAL:.0%} busy"
    )


class ImageServer(ls.LitServer):
    """LitServer with imgserve's own predict/health/info/metrics routes and admission in front."""

    def __init__(self, settings: Settings, directory: ServerDirectory, keys: Keys) -> None:
        self.settings, self.directory, self.keys = settings, directory, keys
        slot_directory = directory.slots
        self.accelerator = resolve_device(settings.device)
        devices = torch.cuda.device_count() if self.accelerator == "cuda" else 1
        self.weights = load_weights(settings, self.accelerator, devices, directory.weights)
        gpu_workers, self.workers_reason = 1, "set by --workers-per-device"
        if settings.workers_per_device == "auto":
            gpu_workers, self.workers_reason = choose_gpu_workers(settings, self.weights, self.accelerator)
        self.workers_per_device = workers_per_device = settings.workers_on(self.accelerator, gpu_workers)
        self.worker_count = devices * workers_per_device
        auto_batch = settings.max_batch_size == "auto"
        self.configured_batch_size = 1 if auto_batch else settings.max_batch_size
        largest_batch = AUTO_BATCH_CAP if auto_batch else settings.max_batch_size
        # A front end may hold every admitted request, and as many again given up on whose workers still have them.
        slots_per_front_end = 2 * queue_bound(settings, self.worker_count, largest_batch)
        self.front_ends = settings.front_ends_on(self.accelerator, workers_per_device)
        self.state = SharedState(
            self.worker_count, request_slots=slots_per_front_end * self.front_ends, front_ends=self.front_ends
        )
        self.dispatcher = Dispatcher(self.state, slot_directory, slots_per_front_end, settings.retry_after_s)
        self.torch_threads = settings.torch_threads_on(self.accelerator, self.worker_count)
        if self.accelerator != "cuda":
            passive_openmp()
        # On a CPU the slots live in the same RAM as the batches: room for every admitted request at its largest.
        admitted = 0 if self.accelerator == "cuda" else queue_bound(settings, self.worker_count, largest_batch)
        plan = WorkerPlan(
            slot_directory,
            self.weights,
            self.configured_batch_size,
            self.torch_threads,
            workers_per_device,
            admitted * 3 * settings.max_image_pixels,
        )
        api = ImageAPI(settings, self.state, plan)
        self.supervisor = Supervisor(self)  # started with the front ends (_start_server)
        self.admission = Admission(self.state, settings, lambda: self.queue_limit)
        super().__init__(
            api,
            accelerator=self.accelerator,
            devices=devices,
            workers_per_device=workers_per_device,
            timeout=False,  # deadlines are imgserve's (admission + worker), per request
            disable_openapi_url=True,  # no /docs, /redoc, /openapi.json
            middlewares=[  # the last is outermost
                (AdmissionMiddleware, {"admission": self.admission, "settings": settings}),
                (ApiKeyMiddleware, {"settings": settings, "keys": keys}),
                telemetry.MetricsMiddleware,
            ],
        )
        install_handlers(self.app)
        self._monitor_workers = False  # imgserve's own monitor answers for the dead worker's requests
        copies = 1 if self.weights.shared else workers_per_device
        self.pod_collector = telemetry.PodCollector(
            self.state,
            slot_directory,
            telemetry.ModelFacts(
                settings.model, settings.precision, self.device_names, copies * self.weights.nbytes, __version__
            ),
        )
        metrics.preregister()

    def _register_internal_endpoints(self) -> None:
        """Called by LitServer.__init__; our routes replace LitServe's /health and /info."""

    def _register_api_endpoints(self, lit_api: ls.LitAPI, request_type: Any, response_type: Any) -> None:
        self.inference = Inference(
            self.settings, self.state, self.dispatcher, self.admission, CodecThreads.for_front_ends(self.front_ends)
        )
        routes = Routes(
            self.settings,
            self.state,
            self.inference,
            lambda: telemetry.exposition(self.pod_collector),
            self.describe,
            lambda: dict(self.workers_setup_status),
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

    def _register_middleware(self) -> None:
        """LitServe's GZip is left out: images do not compress, and it would burn front-end CPU."""
        for middleware, kwargs in [m if isinstance(m, tuple) else (m, {}) for m in self.middlewares]:
            if middleware.__name__ != "GZipMiddleware":
                self.app.add_middleware(middleware, **kwargs)

    @property
    def device_names(self) -> list[str]:
        """LitServe keeps 'cpu' as a string and CUDA devices as one-element lists."""
        return [d if isinstance(d, str) else d[0] for d in self.devices]

    def _init_manager(self, num_api_servers: int) -> Any:
        """LitServe's Manager (worker status, shutdown event), with requests and answers over imgserve's datagram
        sockets instead of its queues."""
        # A forked child (this Manager, the front ends) shares the main process's Python objects until either
        # writes to their pages, and a full garbage collection writes to every one (~50 MiB copied per child).
        # So the garbage is collected once, before the first fork, and the collector leaves the rest alone.
        gc.collect()
        gc.freeze()
        manager = super()._init_manager(num_api_servers)
        self.litapi_request_queues[self.lit_api.api_path] = RequestSocket(self.directory.root)
        self._transport = AnswerSockets(self.directory.root, num_api_servers)
        self.queue_process = manager._process
        # run() blocks on this until it is stopped (by SIGINT): a Manager event would raise EOFError the moment the
        # queue process died, before the supervisor could answer anything.
        self._shutdown_event = threading.Event()
        return manager

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Any) -> AsyncIterator[None]:
        """Each front end's start: its dispatcher (requests and answers on its event loop, not LitServe's thread hop
        per answer), and its decoding threads share a few heap arenas; the first also serves gRPC (--grpc-port) on
        its event loop, until it stops."""
        heap.few_arenas()
        front_end = app.response_queue_id
        self.state.serve_as(front_end)
        self.dispatcher.start(front_end, self.request_queue, self._transport.receiver(front_end))
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

    def restart_worker(self, index: int) -> BaseProcess:
        return self.launch_single_inference_worker(self.lit_api, index)

    def worker_starting(self, index: int) -> bool:
        key = f"{self.lit_api.api_path.split('/')[-1]}_{index}"
        return self.workers_setup_status.get(key) == WorkerSetupStatus.STARTING

    def _start_server(
        self,
        port: int,
        num_uvicorn_servers: int,
        log_level: str,
        sockets: list[socket.socket],
        uvicorn_worker_type: str,
        **kwargs: Any,
    ) -> dict[int, BaseProcess]:
        """Fork the HTTP front ends (LitServe's loop, one front end at a time so that one can be replaced; always
        processes, which is all imgserve asks for), then supervise every child. LitServe stops the front ends in
        this dict at shutdown, replacements included."""
        self._front_end_sockets = sockets
        self._front_end_config = dict(port=port, log_level=log_level, **kwargs)
        self.front_end_processes = {index: self.restart_front_end(index) for index in range(num_uvicorn_servers)}
        self.supervisor.start()
        return self.front_end_processes

    def _perform_graceful_shutdown(self, *args: Any, **kwargs: Any) -> None:
        """LitServe's shutdown (Ctrl-C, or the end of a drain), with the supervisor stopped first so that the children
        it stops are not taken for dead ones and replaced."""
        self.supervisor.stop()
        super()._perform_graceful_shutdown(*args, **kwargs)

    def restart_front_end(self, index: int) -> BaseProcess:
        """Fork front end `index` on the listening socket, as LitServe's _start_server does for each."""
        self.app.response_queue_id = index
        app = copy.copy(self.app)
        self._prepare_app_run(app)
        config = uvicorn.Config(
            app,
            host=self.settings.host,
            timeout_graceful_shutdown=self.uvicorn_graceful_timeout,
            **self._front_end_config,
        )
        process = mp.get_context("fork").Process(
            target=FrontEndServer(config=config).run, args=(index, self._front_end_sockets), name=f"LitServer-{index}"
        )
        gc.freeze()  # what was made since the Manager's fork too (see _init_manager)
        process.start()
        return process

    @property
    def queue_limit(self) -> int:
        """The admission bound, from the batch size the workers settled on at warm-up (max_batch_size auto)."""
        batch_size = self.state.limits["max_batch_size"] or self.configured_batch_size
        return queue_bound(self.settings, self.worker_count, batch_size)

    @property
    def request_queue(self) -> Any:
        return self._get_request_queue(self.lit_api.api_path)

    def describe(self) -> dict[str, Any]:
        """What GET /info answers."""

        limits = self.state.limits
        return {
            "model": self.settings.model,
            "device": self.device_names[0],
            "devices": self.device_names,
            "precision": self.settings.precision,
            "workers": self.worker_count,
            "workers_per_device": self.workers_per_device,
            "workers_per_device_why": self.workers_reason,
            "api_servers": self.front_ends,
            "torch_threads_per_worker": self.torch_threads.alone,
            "torch_threads_per_worker_under_load": self.torch_threads.busy,
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
        return run_server(ImageServer(settings, directory, keys))
    except ModelLoadError as exc:
        log.error("imgserve: %s", exc)
        return 2


def run_server(server: ImageServer) -> int:
    """Serve until SIGTERM/SIGINT; 2 when a worker's setup failed (with its one-line reason)."""
    settings = server.settings
    install_drain_on_signals(server)
    try:
        server.run(
            host=settings.host,
            port=settings.port,
            num_api_servers=server.front_ends,
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
