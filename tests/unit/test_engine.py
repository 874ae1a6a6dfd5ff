"""The seam over LitServe (imgserve/engine.py): every private LitServe symbol imgserve uses is still there, with the
parameters it was written against; an upgrade that moves one fails here, naming it."""

from __future__ import annotations

import ast
from pathlib import Path

import imgserve
from imgserve.engine import PINNED, Pinned, pinned_problems


def test_the_installed_litserve_has_every_private_symbol_the_seam_uses() -> None:
    assert pinned_problems() == []


def test_a_moved_symbol_is_named() -> None:
    """A method gone, a signature changed, an attribute no longer assigned: each is one line naming it."""
    changed = (
        Pinned("litserve.server", "LitServer._register_internal_endpoints", ("self", "extra")),
        Pinned("litserve.server", "LitServer._gone_in_a_later_release", ("self",)),
        Pinned("litserve.server", "LitServer._transport", assigned_in="__init__"),
        Pinned("litserve.loops.base", "_NO_SUCH_SENTINEL"),
    )
    problems = pinned_problems(changed)
    assert len(problems) == 4, problems
    assert "LitServer._register_internal_endpoints: parameters are ('self',)" in problems[0]
    assert "LitServer._gone_in_a_later_release: missing" in problems[1]
    assert "LitServer._transport: no longer assigned in LitServer.__init__" in problems[2]
    assert "_NO_SUCH_SENTINEL: missing" in problems[3]


def test_the_package_uses_litserve_privates_only_in_the_seam() -> None:
    """Outside engine.py no module of the package names a private LitServe symbol."""
    package = Path(imgserve.__file__).parent
    names = {symbol.name.rpartition(".")[2] for symbol in PINNED} - {"run"}  # `_Server.run` is a public method
    found = []
    for path in package.rglob("*.py"):
        if path.name == "engine.py":
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("litserve"):
                found += [f"{path.name}: {alias.name}" for alias in node.names if alias.name.startswith("_")]
            elif isinstance(node, ast.Attribute) and node.attr in names:
                found.append(f"{path.name}: .{node.attr}")
    assert found == []
