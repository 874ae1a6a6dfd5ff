"""Pins on a library's private names: each one a seam of imgserve uses, with what it was written against.

A module that builds on a library's internals lists them as `Pinned` names beside the code that uses them, and a
unit test asserts `pinned_problems(PINNED) == []`: an upgrade that removes, renames or reshapes one fails that test
with one readable line per name, instead of a server at start or, worse, a limit that silently stops applying.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from collections.abc import Iterable
from dataclasses import dataclass
from importlib import import_module
from typing import Any


@dataclass(frozen=True)
class Pinned:
    """A private name of a library: where it is, and the parameters (a function) or the method whose source assigns
    it (an attribute of the instances) it was written against."""

    module: str
    name: str  # "Class.member" or a module-level name
    parameters: tuple[str, ...] | None = None  # a function's, as inspect.signature lists them
    assigned_in: str | None = None  # an instance attribute: the method of the class that assigns `self.<member>`


def pinned_problems(pinned: Iterable[Pinned]) -> list[str]:
    """What the installed libraries no longer have as `pinned` says, one line each (empty: all is as pinned)."""
    return [f"{symbol.module}.{symbol.name}: {problem}" for symbol in pinned if (problem := _problem(symbol))]


def _problem(symbol: Pinned) -> str | None:
    owner_name, _, member = symbol.name.rpartition(".")
    try:
        owner: Any = import_module(symbol.module)
        if owner_name:
            owner = getattr(owner, owner_name)
        if symbol.assigned_in is not None:
            method = getattr(owner, symbol.assigned_in)
            if not assigns(method, member):
                return f"no longer assigned in {owner_name}.{symbol.assigned_in}"
            return None
        found = getattr(owner, member)
    except (AttributeError, ImportError, OSError, TypeError) as exc:
        return f"missing ({exc})"
    if symbol.parameters is not None:
        parameters = tuple(inspect.signature(found).parameters)
        if parameters != symbol.parameters:
            return f"parameters are {parameters}, not {symbol.parameters}"
    return None


def assigns(method: Any, attribute: str) -> bool:
    """Whether the source of `method` stores `self.<attribute>` (a plain, annotated, augmented or unpacked
    assignment)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(method)))
    return any(
        isinstance(node, ast.Attribute)
        and isinstance(node.ctx, ast.Store)
        and node.attr == attribute
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
        for node in ast.walk(tree)
    )
