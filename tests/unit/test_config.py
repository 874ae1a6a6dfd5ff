"""Settings: counts or auto, validated."""

from __future__ import annotations

import pytest

from imgserve.config import Settings


def test_workers_per_device_must_be_a_count_or_auto() -> None:
    with pytest.raises(ValueError, match="workers_per_device must be >= 1"):
        Settings(workers_per_device=0)


def test_torch_threads_must_be_a_count_or_auto() -> None:
    with pytest.raises(ValueError, match="torch_threads must be >= 1"):
        Settings(torch_threads=0)
