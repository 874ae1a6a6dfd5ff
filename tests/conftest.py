"""Shared fixtures: one real server on the built-in model for the HTTP tests, and toy models saved to disk."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import save_file
from serving import Server, grpc_stub, running_server


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The built-in denoiser with small limits so the limit paths are cheap to reach."""
    with running_server(
        tmp_path_factory.mktemp("logs"),
        max_body_bytes=2_000_000,
        max_image_pixels=1_000_000,
        max_batch_size=8,
        batch_timeout_ms=20,
    ) as running:
        yield running


@pytest.fixture(scope="module")
def stub(server: Server) -> Iterator[Any]:
    """Triton's generated gRPC stub on the module's server (one started with a gRPC port)."""
    with grpc_stub(server) as found:
        yield found


@pytest.fixture
def toy_model(tmp_path: Path) -> Callable[[str], dict[str, str]]:
    """Settings that serve tests/support/toy_models.py:<name> from a safetensors file written for it."""

    def settings_for(name: str) -> dict[str, str]:
        import toy_models

        path = tmp_path / f"{name}.safetensors"
        save_file(getattr(toy_models, name)().state_dict(), str(path))
        return {"model": str(path), "model_factory": f"toy_models:{name}"}

    return settings_for
