"""LitServe is the API contract users write to, nothing more: the package imports LitServe's `LitAPI` and no other
name of it (no server, loop, transport or utility), and touches no private member of a LitAPI."""

from __future__ import annotations

import ast
from pathlib import Path

import imgserve

PACKAGE = Path(imgserve.__file__).parent
ALLOWED = {"LitAPI"}


def litserve_uses(tree: ast.AST, where: str) -> list[str]:
    """Every use of LitServe in a module beyond `litserve.LitAPI`: other imports, other attributes of the module
    (however it is aliased), private members reached through a LitAPI-typed name."""
    aliases = {"litserve"}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "litserve":
                    aliases.add(alias.asname or "litserve")
                elif alias.name.startswith("litserve."):
                    found.append(f"{where}: import {alias.name}")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "litserve":
            names = {alias.name for alias in node.names}
            if node.module != "litserve" or not names <= ALLOWED:
                found.append(f"{where}: from {node.module} import {', '.join(sorted(names))}")
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        if isinstance(node.value, ast.Name) and node.value.id in aliases and node.attr not in ALLOWED:
            found.append(f"{where}: {node.value.id}.{node.attr}")
        private = node.attr.startswith("_") and not node.attr.startswith("__")
        if private and isinstance(node.value, ast.Attribute) and node.value.attr == "lit":
            found.append(f"{where}: .lit.{node.attr}")
    return found


def test_the_package_uses_only_litserves_api_class() -> None:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        found += litserve_uses(ast.parse(path.read_text()), str(path.relative_to(PACKAGE)))
    assert found == []


def test_the_check_sees_a_planted_use() -> None:
    planted = """
import litserve as ls
import litserve.server
from litserve.utils import WorkerSetupStatus
from litserve import LitAPI, LitServer

class Adapter:
    def run(self):
        ls.LitServer(self.lit)
        return self.lit._spec
"""
    assert sorted(litserve_uses(ast.parse(planted), "planted.py")) == [
        "planted.py: .lit._spec",
        "planted.py: from litserve import LitAPI, LitServer",
        "planted.py: from litserve.utils import WorkerSetupStatus",
        "planted.py: import litserve.server",
        "planted.py: ls.LitServer",
    ]
