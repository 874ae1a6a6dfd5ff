"""The models a server is asked to serve, and the catalog they become: from Python (`imgserve.serve([A(), B()])`), from
`--api` and `--model` (each may be repeated), and from a model repository in Triton's layout.

A repository is a folder with one subfolder per model, whose name is the model's name::

    models/
      classifier/           config.yaml (preprocess: imagenet, labels: labels.txt)  model.pt2  labels.txt
      detector/             config.yaml (api: detector:Detector)                    detector.py
      embedder/             config.yaml (api: embedder:Embedder, max_batch_size: 16) embedder.py

`config.yaml` holds that model's own settings: `api` (module:Class, the module found in the model's folder) or the
built-in model's settings (`model`: its file, by default the one model file in the folder or in its version folder
`1/`), and `max_batch_size`, `batch_timeout_ms` and `api_path`. Part of the composition root: every mistake here is
the user's to fix, one line and exit 2 (`StartupError`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import litserve as ls
import yaml
from pydantic import ValidationError

from imgserve.api import ImageAPI
from imgserve.config import Batching, BuiltinModel, Settings, served_name
from imgserve.litapi import LitServeAPI
from imgserve.models.builtin import KindRecord, ModelAPI, decodes_in_worker, pads
from imgserve.served import Catalog, ServedModel
from imgserve.startup import StartupError, load_api

CONFIG = "config.yaml"
MODEL_SUFFIXES = (".pt", ".pth", ".ts", ".jit", ".pt2", ".safetensors")
OWN_SETTINGS = ("api", "api_path", "max_batch_size", "batch_timeout_ms")  # beside the built-in model's


@dataclass
class Chosen:
    """One model as the user named it: its name, and either its API (an ImageAPI or a plain LitAPI) or the built-in
    model's settings for its file; with what its own config says of its path and batching."""

    name: str
    api: ls.LitAPI | None = None
    builtin: BuiltinModel | None = None
    api_path: str | None = None
    batching: dict[str, Any] = field(default_factory=dict)


def chosen_models(settings: Settings, given: list[ls.LitAPI]) -> list[Chosen]:
    """Every model the settings and `given` name, in order: the given APIs, --api's, --model's (when set, or when
    nothing else is named: the built-in denoiser), the repository's; their names each unique."""
    apis = [*given, *(load_api(spec) for spec in settings.api)]
    found = [Chosen(_api_name(api), api) for api in apis]
    if "model" in settings.model_fields_set or not (apis or settings.model_repository):
        found += [Chosen(served_name(path), builtin=settings.one(path)) for path in settings.model]
    if settings.model_repository:
        found += read_repository(Path(settings.model_repository), settings)
    if settings.model_name:
        if len(found) != 1:
            raise StartupError("--model-name names the one model of a server: name each of several in its repository")
        found[0].name = settings.model_name
    names = [chosen.name for chosen in found]
    if twice := sorted({name for name in names if names.count(name) > 1}):
        raise StartupError(f"two models are named {twice[0]!r}: each model's name must be its own")
    return found


def read_repository(root: Path, settings: Settings) -> list[Chosen]:
    """The models of the repository at `root`, one per subfolder, in name order."""
    if not root.is_dir():
        raise StartupError(f"--model-repository {root} is not a folder")
    folders = sorted(path for path in root.iterdir() if path.is_dir() and not path.name.startswith("."))
    if not folders:
        raise StartupError(f"--model-repository {root} holds no model folder")
    return [_read_model(folder, settings) for folder in folders]


def _read_model(folder: Path, settings: Settings) -> Chosen:
    config = _config(folder)
    own = {key: config.pop(key) for key in OWN_SETTINGS if key in config}
    batching: dict[str, Any] = {key: own[key] for key in ("max_batch_size", "batch_timeout_ms") if key in own}
    if "api" in own:
        if config:
            raise StartupError(f"{folder / CONFIG}: {', '.join(sorted(config))} do not apply to an API of your own")
        if str(folder) not in sys.path:
            sys.path.insert(0, str(folder))  # the workers inherit sys.path, and import the module the same way
        return Chosen(folder.name, load_api(str(own["api"])), api_path=own.get("api_path"), batching=batching)
    model = config.pop("model", None) or _model_file(folder)
    path = model if model.startswith("builtin:") else str(folder / model)
    base = {name: getattr(settings, name) for name in BuiltinModel.model_fields} | {"model": [path]}
    if "labels" in config:
        config["labels"] = str(folder / config["labels"])
    try:
        builtin = BuiltinModel.model_validate(base | config)
    except ValidationError as error:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in error.errors())
        raise StartupError(f"{folder / CONFIG}: {problems}") from None
    return Chosen(folder.name, builtin=builtin, api_path=own.get("api_path"), batching=batching)


def _config(folder: Path) -> dict[str, Any]:
    path = folder / CONFIG
    if not path.is_file():
        return {}
    try:
        config = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise StartupError(f"{path}: not readable YAML ({exc})".replace("\n", " ")) from None
    if not isinstance(config, dict):
        raise StartupError(f"{path}: a mapping of settings was expected")
    unknown = sorted(set(config) - set(OWN_SETTINGS) - set(BuiltinModel.model_fields))
    if unknown:
        raise StartupError(f"{path}: unknown settings {', '.join(unknown)}")
    return config


def _model_file(folder: Path) -> str:
    """The one model file in the folder, or in its version folder `1/` (Triton's layout), relative to the folder."""
    for where in (folder, folder / "1"):
        files = sorted(path for path in where.glob("*") if path.suffix in MODEL_SUFFIXES)
        if len(files) == 1:
            return str(files[0].relative_to(folder))
        if len(files) > 1:
            names = ", ".join(path.name for path in files)
            raise StartupError(f"{where} holds several model files ({names}): name one in {CONFIG} as `model`")
    raise StartupError(f"{folder}: no model file ({', '.join(MODEL_SUFFIXES)}) and no `api` in {CONFIG}")


def _api_name(api: ls.LitAPI) -> str:
    """An API's name: its `name` (an ImageAPI may set one), else its class name."""
    return (api.name if isinstance(api, ImageAPI) else None) or type(api).__name__


def batching_of(chosen: Chosen, settings: Settings) -> Batching:
    """The batch size and timeout a model runs with: its repository config's; else a flag or IMGSERVE_ variable set
    explicitly, then what its API asked for, then the settings' defaults. A plain LitAPI asks for what its
    attributes say, as LitServe runs it, and has nothing to measure `auto` on."""
    explicit, api = settings.model_fields_set, chosen.api
    size: Any = settings.max_batch_size
    timeout_ms = settings.batch_timeout_ms
    if api is not None:
        asked_size, asked_timeout = (
            api.batching if isinstance(api, ImageAPI) else (api.max_batch_size, api.batch_timeout)
        )
        if "max_batch_size" not in explicit and asked_size is not None:
            size = asked_size
        if "batch_timeout_ms" not in explicit and asked_timeout is not None:
            timeout_ms = 1000 * asked_timeout
        if not isinstance(api, ImageAPI) and size == "auto":
            size = api.max_batch_size
    own = {"max_batch_size": size, "batch_timeout_ms": timeout_ms, **chosen.batching}
    try:
        return Batching.model_validate(own)
    except ValidationError as error:
        raise StartupError(f"{chosen.name}: {error.errors()[0]['msg']}") from None


def catalog_of(
    chosen: list[Chosen], batching: list[Batching], kinds: Callable[[int], KindRecord], device_type: str, retry_s: int
) -> Catalog:
    """The served models: a built-in model's API made (`kinds` records its output kind), a plain LitAPI carried
    by the ImageAPI core at its batch size, each at its path (a built-in model at /predict when it is the only model,
    else /<name>/predict, unless its config says); no two on one path."""
    models = []
    for index, (one, batches) in enumerate(zip(chosen, batching, strict=True)):
        if one.builtin is not None:
            decoding = decodes_in_worker(one.builtin, device_type)
            pad = pads(one.builtin, device_type)
            api: ImageAPI = ModelAPI(one.builtin, kinds(index), pad, retry_s, decoding, batches.max_batch_size)
            api.api_path = "/predict" if len(chosen) == 1 else f"/{one.name}/predict"
        elif isinstance(one.api, ImageAPI):
            api = one.api
        else:
            size = batches.max_batch_size if isinstance(batches.max_batch_size, int) else 1
            api = LitServeAPI(one.api, size, batches.batch_timeout_ms / 1000)
        if one.api_path:
            api.api_path = one.api_path
        models.append(ServedModel(index, one.name, api, batches))
    paths = [path for model in models for path in model.paths]
    if twice := sorted({path for path in paths if paths.count(path) > 1}):
        owners = [model.name for model in models if twice[0] in model.paths]
        raise StartupError(f"models {', '.join(owners)} are all at {twice[0]}: give each its own api_path")
    return Catalog(models)
