"""The models one server serves: each an API under its own name (the Open Inference Protocol's `/v2/models/{name}`)
and at its own HTTP path (the API's `api_path`, as in LitServe), with its own batching.

Every process holds the same catalog, built by the main process before it starts any child: a model's index is its
place in the shared state and in each request message. Which models are loaded now is the shared state's to say
(`handoff/state.py`), not the catalog's.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from imgserve.api import ImageAPI
from imgserve.config import Batching

PREDICT_ALIAS = "/v1/images:predict"  # answered as /predict, by the model at /predict


@dataclass(frozen=True)
class ServedModel:
    """One model of the server: its index, its name, its API and the batching it runs with."""

    index: int
    name: str
    api: ImageAPI
    batching: Batching

    @property
    def paths(self) -> tuple[str, ...]:
        """Where it answers over HTTP: its API's path (the model at /predict also at the alias)."""
        path = self.api.api_path
        return (path, PREDICT_ALIAS) if path == "/predict" else (path,)


class Catalog(Sequence[ServedModel]):
    """The server's models, in index order; each name and each path belongs to one model."""

    def __init__(self, models: Sequence[ServedModel]) -> None:
        self.models = tuple(models)
        self.by_name = {model.name: model for model in self.models}
        self.by_path = {path: model for model in self.models for path in model.paths}

    def __getitem__(self, index: int) -> ServedModel:  # type: ignore[override]
        return self.models[index]

    def __len__(self) -> int:
        return len(self.models)

    def __iter__(self) -> Iterator[ServedModel]:
        return iter(self.models)

    @property
    def names(self) -> list[str]:
        return [model.name for model in self.models]
