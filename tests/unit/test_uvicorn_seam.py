"""The seam over uvicorn (imgserve/frontend/connections.py): every uvicorn internal the connection guard uses is still
there, with what it was written against; an upgrade that moves one fails here, naming it; and no other module of the
package reaches past uvicorn's public names."""

from __future__ import annotations

import ast
from pathlib import Path

import uvicorn

import imgserve
from imgserve.frontend import connections
from imgserve.frontend.connections import HTTPTOOLS, PINNED
from imgserve.pins import Pinned, pinned_problems

SEAM = Path(connections.__file__)
# Pinned names that other code has too (asyncio's protocols and transports, Starlette's request.url and .headers,
# event loops, loggers): the scan below looks for the others, which only uvicorn's protocol has.
ORDINARY = {
    *("__init__", "connection_made", "connection_lost", "data_received", "pause_reading", "resume_reading"),
    *("loop", "logger", "parser", "connections", "transport", "url", "headers", "scope", "shutdown"),
}


def test_the_installed_uvicorn_has_every_internal_the_connection_guard_uses() -> None:
    problems = pinned_problems(PINNED)
    assert not problems, "uvicorn moved what frontend/connections.py uses:\n" + "\n".join(problems)


def test_a_moved_internal_is_named_in_one_line() -> None:
    """A signature changed, a method renamed, an attribute assigned elsewhere, a module gone: one line each, naming
    it; an attribute uvicorn assigns with a type annotation is found."""
    changed = (
        Pinned(HTTPTOOLS, "HttpToolsProtocol.on_url", ("self", "url", "at")),
        Pinned(HTTPTOOLS, "HttpToolsProtocol._unset_keepalive", ("self",)),
        Pinned(HTTPTOOLS, "HttpToolsProtocol.expect_100_continue", assigned_in="on_url"),
        Pinned(HTTPTOOLS, "RequestResponseCycle.keep_alive", assigned_in="on_keep_alive"),
        Pinned("uvicorn.protocols.http.gone_impl", "HttpToolsProtocol.cycle", assigned_in="__init__"),
        Pinned(HTTPTOOLS, "HttpToolsProtocol.cycle", assigned_in="__init__"),  # `self.cycle: ... = None`
    )
    problems = pinned_problems(changed)
    assert len(problems) == 5, problems
    assert problems[0] == (
        f"{HTTPTOOLS}.HttpToolsProtocol.on_url: parameters are ('self', 'url'), not ('self', 'url', 'at')"
    )
    assert problems[1].startswith(f"{HTTPTOOLS}.HttpToolsProtocol._unset_keepalive: missing (")
    assert problems[2] == (
        f"{HTTPTOOLS}.HttpToolsProtocol.expect_100_continue: no longer assigned in HttpToolsProtocol.on_url"
    )
    assert problems[3].startswith(f"{HTTPTOOLS}.RequestResponseCycle.keep_alive: missing (")
    assert problems[4].startswith("uvicorn.protocols.http.gone_impl.HttpToolsProtocol.cycle: missing (")
    assert all("\n" not in problem for problem in problems)


def reaches_into_uvicorn(path: Path) -> list[str]:
    """Where the module at `path` uses uvicorn past its public names (`uvicorn.__all__`): a submodule imported, a
    private name taken, or a member only uvicorn's protocol has (from PINNED) named."""
    return [f"{path.name}: {what}" for node in ast.walk(ast.parse(path.read_text())) for what in _past_public(node)]


def _past_public(node: ast.AST) -> list[str]:
    public = set(uvicorn.__all__)
    members = {pinned.name.rpartition(".")[2] for pinned in PINNED} - ORDINARY
    if isinstance(node, ast.Import):
        return [f"import {alias.name}" for alias in node.names if alias.name.startswith("uvicorn.")]
    if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "uvicorn":
        names = [alias.name for alias in node.names if node.module != "uvicorn" or alias.name not in public]
        return [f"from {node.module} import {name}" for name in names]
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "uvicorn":
        return [f"uvicorn.{node.attr}"] if node.attr not in public else []
    if isinstance(node, ast.Attribute) and node.attr in members:
        return [f".{node.attr}"]
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name in members:
        return [f"def {node.name}"]
    return []


def test_no_module_outside_the_seam_reaches_past_uvicorns_public_names() -> None:
    package = Path(imgserve.__file__).parent
    assert [found for path in package.rglob("*.py") if path != SEAM for found in reaches_into_uvicorn(path)] == []


def test_the_scan_sees_each_way_past_the_public_names(tmp_path: Path) -> None:
    planted = tmp_path / "planted.py"
    planted.write_text(
        "import uvicorn, uvicorn.protocols\n"
        "from uvicorn import Config, _types\n"
        "from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol\n"
        "config = uvicorn.Config(app=None)\n"
        "server = uvicorn.supervisors\n"
        "class Guard(HttpToolsProtocol):\n"
        "    def on_headers_complete(self): self._unset_keepalive_if_required(); self.url = self.cycle.keep_alive\n"
    )
    assert sorted(reaches_into_uvicorn(planted)) == sorted(
        f"planted.py: {what}"
        for what in (
            "import uvicorn.protocols",
            "from uvicorn import _types",
            "from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol",
            "uvicorn.supervisors",
            "def on_headers_complete",
            "._unset_keepalive_if_required",
            ".keep_alive",
            ".cycle",
        )
    )
