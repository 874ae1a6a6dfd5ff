"""Settings by concern: every knob of the server and of the built-in model, from `imgserve serve` flags or
`IMGSERVE_<NAME>` environment variables.

Each concern is a small pydantic model (`Listening`, `Placement`, `Batching`, `Queueing`, `RequestLimits`,
`ConnectionLimits`, `Access`, `Logging`, and `BuiltinModel`, the built-in model's own); `ServerSettings` is the
server's concerns together, `Settings` everything `imgserve serve` takes. A module takes the part it needs
(`settings.part(ConnectionLimits)`), never the whole. The built-in model's settings apply only where no `--api` is
given: `Settings.model_settings_given` names those given.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated, Literal, TypeVar

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

BUILTIN_MODEL = "builtin:denoiser"
# The bounds of the `auto` settings (pod.py decides them within these; the settings' help names them).
MAX_CPU_WORKERS = 4
MAX_GPU_WORKERS = 4
GPU_BUSY_GOAL = 0.9  # workers_per_device auto on a GPU: the share of time the GPU should have work
CPU_FRONT_ENDS = 2  # api_servers auto on a CPU (at most one per core)
# api_servers auto on a GPU where the device decodes the uploads: this share of the cores the workers leave.
DEVICE_DECODE_FRONT_END_SHARE = 0.5
# compile unset: whether a fixed-size model runs compiled, by device kind (the faster; docs/benchmarks.md, gpu_check)
COMPILED_BY_DEFAULT = {"cpu": True, "cuda": False}
COMPILE_DEFAULTS = " and ".join(kind.upper() for kind, on in COMPILED_BY_DEFAULT.items() if on) or "no device"
# torchvision's ImageNet weight transforms (ImageClassification preset): what --preprocess imagenet sets.
PRESETS: dict[str, dict[str, object]] = {
    "imagenet": {
        "resize_size": 256,
        "input_size": 224,
        "interpolation": "bilinear",
        "mean": (0.485, 0.456, 0.406),
        "std": (0.229, 0.224, 0.225),
    },
}
Channels = Annotated[tuple[float, float, float], NoDecode]  # "R,G,B" from a flag or an environment variable

Part = TypeVar("Part", bound=BaseModel)


def _count_or_auto(value: object, info: ValidationInfo) -> object:
    """A positive count or "auto" (a digit string from a flag or the environment is the count)."""
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, int) and value < 1:
        raise ValueError(f"{info.field_name} must be >= 1 or 'auto'")
    return value


CountOrAuto = Annotated[int | Literal["auto"], BeforeValidator(_count_or_auto)]


def _split(value: object) -> object:
    """A comma-separated string (an environment variable) as a list; a flag given several times is one already."""
    if isinstance(value, str):
        return [part.strip() for part in value.split(",") if part.strip()]
    return value


Several = Annotated[list[str], NoDecode, BeforeValidator(_split)]  # a repeated flag, or "a,b" in a variable


class Concern(BaseModel):
    """A group of settings that one part of the server reads; its docstring's first line is its heading in
    docs/settings.md."""

    model_config = ConfigDict(protected_namespaces=())


class Listening(Concern):
    """Where it listens."""

    host: Literal["0.0.0.0", "127.0.0.1", "::"] = Field("0.0.0.0", description="Address to bind.")
    port: int = Field(8000, ge=1024, le=65535, description="TCP port.")
    grpc_port: int = Field(
        8001,
        ge=0,
        le=65535,
        description="TCP port of the Open Inference Protocol's gRPC service (served by the first HTTP front end); "
        "0 = off.",
    )
    api_servers: CountOrAuto = Field(
        "auto",
        description=f"HTTP front-end processes (they share the port); auto = on a CPU {CPU_FRONT_ENDS} (at most one "
        "per core: one event loop is what limits a cheap model), on a GPU the cores the inference workers leave "
        f"free ({DEVICE_DECODE_FRONT_END_SHARE:.0%} of them where the device decodes the uploads), at least 1.",
    )


class Serving(Concern):
    """What it serves."""

    api: Several = Field(
        [],
        description="module:Class of your own imgserve.ImageAPI, or of a plain litserve.LitAPI, to serve instead "
        "of --model (the module is found in the current directory first); repeat it for several; docs/custom-api.md.",
    )
    model_repository: str | None = Field(
        None,
        description="A folder of models in Triton's layout, one subfolder per model (its name): its model file or "
        "API module and a config.yaml of its own settings; docs/models.md.",
    )
    model_control: Literal["none", "explicit"] = Field(
        "none",
        description="explicit = models are loaded and unloaded while serving, by the Open Inference Protocol's "
        "repository routes (Triton's word); at start only --load-model's are loaded.",
    )
    load_model: Several = Field(
        [],
        description="With --model-control explicit: the repository's models to load at start (repeat it; * = all).",
    )
    model_name: str | None = Field(
        None,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$",
        description="The model's name in the Open Inference Protocol (/v2/models/<name>, gRPC) when one model is "
        "served; default: denoiser for the built-in model, else the model file's name without its extension, or an "
        "--api's `name` (its class name when it sets none).",
    )
    trust_pickle: bool = Field(
        False,
        description="Load model files that can run code: a whole pickled model, or a .pt2 in any form other than "
        "the plain one torch.export.save writes (runs code from the file!).",
    )
    trust_native_code: bool = Field(
        False,
        description="Serve an AOTInductor package (.pt2 from torch._inductor.aoti_compile_and_package): native code "
        "compiled for one device kind, which runs as the server (only from authors you trust!).",
    )


class Placement(Concern):
    """Where and how it runs."""

    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto picks cuda when a GPU is visible.")
    workers_per_device: CountOrAuto = Field(
        "auto",
        description="Inference worker processes per device; auto = on a CPU "
        f"one per core (at most {MAX_CPU_WORKERS}); on a GPU as many as keep it {GPU_BUSY_GOAL:.0%} busy while each "
        f"does its own CPU work, measured at start (at most {MAX_GPU_WORKERS} and half the cores).",
    )
    torch_threads: CountOrAuto = Field(
        "auto",
        description="Torch threads per inference worker; auto = on a CPU twice the worker's share of the cores (at "
        "most all of them) for a batch that is all the pod has admitted, so a lone request uses every core, and its "
        "share while other requests are in flight; on a GPU its share.",
    )
    share_weights: bool = Field(
        True,
        description="One copy of the weights per device for all its workers (a read-only /dev/shm mapping on a "
        "CPU, CUDA IPC on a GPU); off = a private copy per worker.",
    )
    gpu_memory_fraction: float = Field(
        0.8,
        gt=0,
        le=1,
        description="Share of free device memory (RAM on CPU) that the batches of all the device's workers together "
        "may use (on a CPU less the request slots' room).",
    )


class Batching(Concern):
    """Batching.

    An API's own `max_batch_size` and `batch_timeout` apply where these are not set explicitly."""

    max_batch_size: CountOrAuto = Field(
        8,
        description="Most items in one model call; auto measures memory at warm-up and picks the largest that fits.",
    )
    batch_timeout_ms: float = Field(
        5.0, ge=0, description="How long a batch may wait to fill up, counted from its oldest request's arrival."
    )


class Queueing(Concern):
    """Admission and deadlines."""

    max_queue_depth: int = Field(
        0,
        ge=0,
        description="Admitted-but-unanswered requests per pod, and per model, before 503; 0 = each model's "
        "max_batch_size x workers x 4, the pod's their sum.",
    )
    request_timeout_s: float = Field(30.0, gt=0, description="Default deadline of a request.")
    max_request_timeout_s: float = Field(120.0, gt=0, description="Cap on the X-Request-Timeout header.")
    retry_after_s: int = Field(1, ge=1, description="Retry-After sent with 503.")
    drain_timeout_s: float = Field(
        30.0, ge=0, description="On SIGTERM or Ctrl-C, how long to finish in-flight requests."
    )


class RequestLimits(Concern):
    """Input limits."""

    max_body_bytes: int = Field(20 * 1024 * 1024, ge=1024, description="Largest request body (413 above).")
    max_image_pixels: int = Field(
        16_777_216, ge=64, description="Largest width x height of an input image (413 above; stops bombs)."
    )


class ConnectionLimits(Concern):
    """Connections and uploads (each front-end process)."""

    max_connections: int = Field(
        1024,
        ge=1,
        description="Open connections per front-end process; past it a new one gets 503 and is closed. Also the "
        "gRPC port's calls in progress, streams per connection and connections.",
    )
    header_timeout_s: float = Field(
        5.0, gt=0, description="Time for a request's line and headers to arrive (408 and close after it)."
    )
    max_header_bytes: int = Field(16384, ge=1024, description="Largest request line + headers (431 above).")
    max_headers: int = Field(100, ge=8, description="Most header fields in a request (431 above).")
    body_timeout_s: float = Field(
        10.0, gt=0, description="Longest silence within an upload, and the grace before min_upload_rate applies."
    )
    min_upload_rate: int = Field(
        16384, ge=0, description="Slowest average upload, in bytes/s, after body_timeout_s (408 below; 0 = none)."
    )
    max_uploads: int = Field(
        128, ge=1, description="Request bodies being received at once per front-end process (503 above)."
    )


class Access(Concern):
    """Authentication and documentation."""

    api_key: str | None = Field(
        None, description="Keys that may call /predict (comma separated, for rotation); none = no authentication."
    )
    api_key_file: str | None = Field(
        None,
        description="File with one API key per line (a mounted Secret), re-read every second; a change that leaves "
        "no key keeps the keys in force.",
    )
    protect_metrics: bool = Field(
        False, description="Require an API key for /metrics, /info, /docs and /openapi.json too."
    )
    docs: bool = Field(True, description="Serve /docs and /openapi.json (Swagger UI from the package's own files).")


class Logging(Concern):
    """Logging."""

    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="Log verbosity.")
    access_log: bool = Field(False, description="Log every HTTP request (costs front-end CPU under load).")

    def configure_logging(self) -> None:
        """The log format and level of every imgserve process (a worker starts with none)."""
        logging.basicConfig(level=self.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


class BuiltinModel(Concern):
    """The built-in model.

    --model and what describes it; given with an --api of one's own, they stop the start (exit 2)."""

    model: Several = Field(
        [BUILTIN_MODEL],
        description="builtin:denoiser, or a path to .pt/.pt2/.safetensors/.pth; repeat it for several models (the "
        "other settings of the built-in model apply to each).",
    )
    model_factory: str | None = Field(
        None, description="module:function that builds the nn.Module for a state-dict/safetensors file."
    )
    labels: str | None = Field(None, description="Text file with one class label per line (classifiers).")
    input_size: int | None = Field(
        None,
        ge=8,
        description="The model's square input: a centre crop of that size after --resize-size, else every image "
        "is resized to it (fixed-size models); also the warm-up probe's size (256 when unset).",
    )
    preprocess: Literal["none", "imagenet"] = Field(
        "none",
        description="Preset: imagenet = resize 256, crop 224, bilinear, ImageNet mean/std; explicit settings win.",
    )
    resize_size: int | None = Field(
        None, ge=8, description="Resize the shorter side to this, keeping the aspect ratio (torchvision Resize(N))."
    )
    interpolation: Literal["bilinear", "bicubic", "nearest"] = Field(
        "bilinear", description="Resampling filter of the resize (Pillow's, as torchvision uses on PIL images)."
    )
    mean: Channels | None = Field(None, description="R,G,B subtracted from the [0, 1] input (after resizing).")
    std: Channels | None = Field(None, description="R,G,B the input is divided by after subtracting the mean.")
    task: Literal["auto", "image", "classify", "segment", "detect"] = Field(
        "auto", description="What the output is; auto decides from the warm-up output's type and shape."
    )
    scores: Literal["logits", "probabilities"] = Field(
        "logits", description="A classifier's output: logits (softmax is applied) or probabilities (used as is)."
    )
    precision: Literal["fp32", "fp16", "bf16"] = Field("fp32", description="fp16/bf16 run under autocast.")
    pad_mixed_sizes: bool | Literal["auto"] = Field(
        "auto",
        description="Batch different sizes by padding (edge pixels may differ slightly); auto = on GPU only.",
    )
    decode_in: Literal["auto", "front-end", "worker"] = Field(
        "auto",
        description="Where uploads are decoded, resized and cropped: front-end (Pillow, in the HTTP front ends), "
        "worker (next to the batch: on a GPU the JPEGs in one batched call, then tensor resizes; on a CPU Pillow "
        "in the worker); auto = worker where the device is CUDA and torchvision's GPU JPEG decoder is installed.",
    )
    compile: bool | None = Field(
        None,
        description="torch.compile the model in each worker for every batch size before it is ready (a fixed-size "
        "fp32 torch.export program on a CPU: frozen into one AOTInductor package); unset = on for a fixed "
        f"--input-size on a {COMPILE_DEFAULTS} (measured faster), else off. TorchScript and AOTInductor are compiled.",
    )
    compile_cache_dir: str | None = Field(
        None,
        description="Keeps the compiled code for a restart with the same model, device, processor and torch: made "
        "(mode 0700), refused if another user can write it; unset = $XDG_CACHE_HOME/imgserve/compiled (~/.cache/...).",
    )
    channels_last: bool = Field(
        True,
        description="Run convolutions in NHWC memory (2-3x faster on CPU, tensor cores on GPU); "
        "a model that fails on it at warm-up falls back to NCHW.",
    )
    output_format: Literal["jpeg", "png", "webp"] = Field("jpeg", description="Image format when none is asked.")
    jpeg_quality: int = Field(90, ge=1, le=100, description="JPEG/WebP quality when none is asked.")

    @field_validator("mean", "std", mode="before")
    @classmethod
    def _comma_separated(cls, value: object) -> object:
        if isinstance(value, str):
            value = tuple(part.strip() for part in value.split(","))
        if isinstance(value, tuple | list) and len(value) != 3:
            raise ValueError("expects three comma-separated numbers R,G,B")
        return value

    @field_validator("std")
    @classmethod
    def _nonzero(cls, value: tuple[float, float, float] | None) -> tuple[float, float, float] | None:
        if value is not None and 0 in value:
            raise ValueError("std must not be 0")
        return value

    @model_validator(mode="after")
    def _apply_preset(self) -> BuiltinModel:
        """The preset fills in only the settings that were not given explicitly (and leaves them unset: given
        explicitly are only those the user gave)."""
        for name, value in PRESETS.get(self.preprocess, {}).items():
            if name not in self.model_fields_set:
                self.__dict__[name] = value
        if self.resize_size and self.input_size and self.resize_size < self.input_size:
            raise ValueError(f"--resize-size {self.resize_size} is under the --input-size {self.input_size} crop")
        return self

    def one(self, path: str) -> BuiltinModel:
        """These settings for the one model file `path`."""
        values = {name: getattr(self, name) for name in BuiltinModel.model_fields}
        return BuiltinModel.model_construct(**values | {"model": [path]})


def served_name(path: str) -> str:
    """A built-in model's default name: the built-in model's own, or the model file's stem."""
    return BUILTIN_MODEL.partition(":")[2] if path == BUILTIN_MODEL else Path(path).stem


# The server's concerns, in the order docs/settings.md lists them.
SERVER_CONCERNS: tuple[type[Concern], ...] = (
    Listening,
    Serving,
    Placement,
    Batching,
    Queueing,
    RequestLimits,
    ConnectionLimits,
    Access,
    Logging,
)


class ServerSettings(
    Listening, Serving, Placement, Batching, Queueing, RequestLimits, ConnectionLimits, Access, Logging, BaseSettings
):
    """The server's settings, every concern but the built-in model's."""

    model_config = SettingsConfigDict(env_prefix="IMGSERVE_", extra="ignore", protected_namespaces=())

    def part(self, concern: type[Part]) -> Part:
        """The settings of one concern, for the module that reads only those."""
        return concern.model_construct(**{name: getattr(self, name) for name in concern.model_fields})


class Settings(ServerSettings, BuiltinModel):
    """Everything `imgserve serve` takes: the server's settings and the built-in model's."""

    def model_settings_given(self) -> list[str]:
        """The built-in model's settings given explicitly (as flags or IMGSERVE_ variables): with an API of one's
        own they would describe a model that is not served."""
        return [name for name in BuiltinModel.model_fields if name in self.model_fields_set]


CONCERNS: tuple[type[Concern], ...] = (*SERVER_CONCERNS, BuiltinModel)  # every concern `imgserve serve` takes
