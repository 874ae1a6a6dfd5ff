"""Command-line tools the tests drive (helm, promtool, prometheus, checkov, hadolint), found on PATH."""

from __future__ import annotations

import shutil

import pytest


def tool(name: str) -> str:
    """Path of a command-line tool, or a clear failure saying how to get it."""
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"`{name}` is not on PATH: `make test` installs it (helm and prometheus into .tools/bin)")
    return path
