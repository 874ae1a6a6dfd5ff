"""The package's shape: every folder a regular package that says which process runs it; every room (top-level module
or subpackage) placed as a process role or a listed top-level module; imports run one way (front end -> hand-off <-
worker; only the shared top-level modules are imported by all); no cycle between modules or between rooms; nothing
imports the composition root but the command that runs it; no cycles in loadtests/; nothing installed as `service`."""

from __future__ import annotations

import ast
import pkgutil
from pathlib import Path

from serving import REPO, SOURCE

PACKAGE = SOURCE / "imgserve"
# Each process role (a subpackage) and the other roles it may import; any module may import the shared modules.
ROLES = {
    "frontend": {"handoff", "models"},
    "worker": {"handoff", "models"},
    "handoff": set(),
    "supervisor": {"handoff", "models"},  # models: the shared weights of what it loads
    "models": set(),
    "tools": {"models"},
}
# Every top-level module and what of the package it may import besides the shared modules: roles by name, top-level
# modules in full. The shared ones (every process imports them) may import nothing else. A top-level module or a
# subpackage that is in neither ROLES nor here, or one here that is gone, fails test_every_room_is_placed.
TOP_LEVEL: dict[str, set[str]] = {
    "imgserve.api": set(),
    "imgserve.codec": set(),
    "imgserve.config": set(),
    "imgserve.errors": set(),
    "imgserve.heap": set(),
    "imgserve.lifetime": set(),
    "imgserve.litapi": set(),  # a plain LitAPI as an ImageAPI: the front end packs, the worker runs its hooks
    "imgserve.metrics": set(),
    "imgserve.pins": set(),
    "imgserve.pod": set(),
    "imgserve.served": set(),  # the catalog of the server's models, in every process
    "imgserve.tracing": set(),  # the OTEL_* variables, the SDK set up in each child, the request id, the trace context
    "imgserve.version": set(),
    "imgserve": {"imgserve.cli"},  # the public names, `serve` among them (imported on first use)
    "imgserve.startup": {"models", "worker"},  # the main process, before the composition root builds the server
    "imgserve.repository": {"models", "imgserve.startup"},  # the models asked for, into the catalog
    "imgserve.testing": {"worker"},  # a user's hooks run in the test's own process
    "imgserve.server": {
        "frontend",
        "handoff",
        "models",
        "supervisor",
        "worker",
        "imgserve.startup",
        "imgserve.repository",
    },  # builds all
    # the command: the only importer of the composition root, which it imports beside the fork server (supervisor)
    "imgserve.cli": {"handoff", "supervisor", "tools", "imgserve.server"},
    "imgserve.__main__": {"imgserve.cli"},
}
SHARED = {module for module, others in TOP_LEVEL.items() if not others}


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path, prefix: str) -> dict[str, set[str]]:
    """Module -> the modules of the same tree it imports (at any depth of the file: lazy imports count).

    `from package import module` depends on that module, not on the package's __init__ (Python imports a submodule
    the package has not finished setting up yet); `from package import name` of anything else depends on the
    __init__ that defines the name."""
    modules = {module_name(path, root): path for path in (root / prefix).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                    base = f"{anchor}.{base}" if base else anchor
                targets = [f"{base}.{alias.name}" for alias in node.names]
                if not all(target in modules for target in targets):
                    targets.append(base)
            else:
                continue
            found |= {target for target in targets if target in modules and target != name}
        graph[name] = found
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every import cycle found by a depth-first search (each reported once, from where it was entered)."""
    found, state = [], {}

    def visit(node: str, trail: list[str]) -> None:
        state[node] = "open"
        for target in sorted(graph[node]):
            if state.get(target) == "open":
                found.append(trail[trail.index(target) :] + [target])
            elif target not in state:
                visit(target, [*trail, target])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return found


def room(module: str) -> str:
    """A module's room: its top-level module or subpackage of the package (`imgserve.frontend.v2.http` ->
    `imgserve.frontend`)."""
    return ".".join(module.split(".")[:2])


def room_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Room -> the other rooms its modules import."""
    rooms: dict[str, set[str]] = {room(module): set() for module in graph}
    for module, targets in graph.items():
        rooms[room(module)] |= {room(target) for target in targets} - {room(module)}
    return rooms


def place(module: str) -> str:
    """Where a module sits for the one-way rule: its process role (`imgserve.frontend.v2.http` -> `frontend`), or the
    top-level module or unlisted subpackage it is (its room)."""
    name = room(module).partition(".")[2]
    return name if name in ROLES else room(module)


def unplaced(graph: dict[str, set[str]]) -> list[str]:
    """The rooms of `graph` that are neither a role nor a listed top-level module, and the listed ones it lacks."""
    rooms = {room(module) for module in graph}
    listed = {f"imgserve.{name}" for name in ROLES} | set(TOP_LEVEL)
    return [f"{name} is not placed" for name in sorted(rooms - listed)] + [
        f"{name} is placed but gone" for name in sorted(listed - rooms)
    ]


def wrong_way(graph: dict[str, set[str]]) -> list[str]:
    """Each import from another place that its module's place may not make (see ROLES and TOP_LEVEL)."""
    found = []
    for module, targets in sorted(graph.items()):
        here = place(module)
        allowed = SHARED | ROLES.get(here, TOP_LEVEL.get(here, set()))
        for target in sorted(targets):
            there = place(target)
            if there != here and there not in allowed:
                found.append(f"{module} ({here}) imports {target} ({there})")
    return found


def test_the_package_has_no_import_cycles() -> None:
    assert cycles(import_graph(SOURCE, "imgserve")) == []


def test_no_cycle_between_rooms() -> None:
    assert cycles(room_graph(import_graph(SOURCE, "imgserve"))) == []


def test_every_folder_is_a_regular_package_that_says_who_runs_it() -> None:
    folders = [path for path in PACKAGE.rglob("*") if path.is_dir() and path.name != "__pycache__"]
    assert folders, "no subpackages found"
    for folder in [PACKAGE, *folders]:
        init = folder / "__init__.py"
        assert init.is_file(), f"{folder} is not a regular package"
        docstring = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert "process" in docstring or folder == PACKAGE, f"{init} does not say which process runs it"
    seen = {name for _, name, _ in pkgutil.walk_packages([str(PACKAGE)], "imgserve.")}
    files = set(import_graph(SOURCE, "imgserve")) - {"imgserve"}
    assert files <= seen, f"pkgutil does not see {sorted(files - seen)}"


def test_every_room_is_placed() -> None:
    assert unplaced(import_graph(SOURCE, "imgserve")) == []


def test_imports_run_one_way() -> None:
    assert wrong_way(import_graph(SOURCE, "imgserve")) == []


def test_the_rules_see_a_planted_violation() -> None:
    """Planted into the package's own graph, each breach is named: a worker importing the front end, a shared module
    importing the hand-off, a role importing a module that is not shared, a front end importing the composition root,
    and a new top-level module nobody placed."""
    graph = import_graph(SOURCE, "imgserve")
    graph["imgserve.worker.serving"].add("imgserve.frontend.routes")
    graph["imgserve.metrics"].add("imgserve.handoff.slots")
    graph["imgserve.frontend.routes"] |= {"imgserve.startup", "imgserve.server"}
    graph["imgserve.newcomer"] = set()
    assert wrong_way(graph) == [
        "imgserve.frontend.routes (frontend) imports imgserve.server (imgserve.server)",
        "imgserve.frontend.routes (frontend) imports imgserve.startup (imgserve.startup)",
        "imgserve.metrics (imgserve.metrics) imports imgserve.handoff.slots (handoff)",
        "imgserve.worker.serving (worker) imports imgserve.frontend.routes (frontend)",
    ]
    assert unplaced(graph) == ["imgserve.newcomer is not placed"]
    del graph["imgserve.pins"]
    assert unplaced(graph) == ["imgserve.newcomer is not placed", "imgserve.pins is placed but gone"]


def test_the_checker_sees_a_wrong_way_import(tmp_path: Path) -> None:
    """The rules above can fail: a worker module that imports the front end, and a cycle, are both caught."""
    tree = tmp_path / "imgserve"
    for folder in ("worker", "frontend"):
        (tree / folder).mkdir(parents=True)
        (tree / folder / "__init__.py").write_text("")
    (tree / "__init__.py").write_text("")
    (tree / "worker" / "api.py").write_text("from imgserve.frontend import routes\n")
    (tree / "frontend" / "routes.py").write_text("from imgserve.worker.api import x\n")
    graph = import_graph(tmp_path, "imgserve")
    assert graph["imgserve.worker.api"] == {"imgserve.frontend.routes"}
    assert cycles(graph) == [["imgserve.frontend.routes", "imgserve.worker.api", "imgserve.frontend.routes"]]
    assert wrong_way(graph) == [
        "imgserve.frontend.routes (frontend) imports imgserve.worker.api (worker)",
        "imgserve.worker.api (worker) imports imgserve.frontend.routes (frontend)",
    ]


def test_the_checker_sees_a_cycle_through_a_package_init(tmp_path: Path) -> None:
    """A package whose __init__ re-exports its modules is no cycle with the modules that import their siblings
    from it; a module that imports a name the __init__ defines, while the __init__ imports that module, is one."""
    tree = tmp_path / "imgserve"
    tree.mkdir()
    (tree / "__init__.py").write_text("from imgserve.api import API\nfrom imgserve.errors import Error\n")
    (tree / "errors.py").write_text("class Error(Exception): ...\n")
    (tree / "api.py").write_text("from imgserve import errors\nAPI = 1\n")
    assert cycles(import_graph(tmp_path, "imgserve")) == []
    (tree / "api.py").write_text("from imgserve import Error, errors\nAPI = 1\n")
    graph = import_graph(tmp_path, "imgserve")
    assert graph["imgserve.api"] == {"imgserve", "imgserve.errors"}
    assert cycles(graph) == [["imgserve", "imgserve.api", "imgserve"]]


def test_the_checker_sees_a_cycle_between_rooms(tmp_path: Path) -> None:
    """Two modules that import each other's rooms, not each other: no module cycle, a room cycle."""
    tree = tmp_path / "imgserve"
    (tree / "handoff").mkdir(parents=True)
    for init in (tree / "__init__.py", tree / "handoff" / "__init__.py"):
        init.write_text("")
    (tree / "metrics.py").write_text("from imgserve.handoff import slots\n")
    (tree / "handoff" / "slots.py").write_text("x = 1\n")
    (tree / "handoff" / "dispatch.py").write_text("from imgserve import metrics\n")
    graph = import_graph(tmp_path, "imgserve")
    assert cycles(graph) == []
    assert cycles(room_graph(graph)) == [["imgserve.handoff", "imgserve.metrics", "imgserve.handoff"]]


def test_loadtests_have_no_import_cycles() -> None:
    assert cycles(import_graph(REPO, "loadtests")) == []


MAX_MODULE_LINES, MAX_FUNCTION_LINES = 400, 60


def oversized(root: Path) -> list[str]:
    """Modules over MAX_MODULE_LINES lines and functions over MAX_FUNCTION_LINES, under `root`."""
    found = []
    for path in sorted(root.rglob("*.py")):
        text = path.read_text()
        if text.count("\n") > MAX_MODULE_LINES:
            found.append(f"{path.relative_to(root)}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    found.append(f"{path.relative_to(root)}: {node.name} is {length} lines")
    return found


def test_modules_and_functions_stay_small(tmp_path: Path) -> None:
    """No module over 400 lines, no function over 60, in the package; and the check sees a planted one."""
    assert oversized(PACKAGE) == []
    body = "\n".join(f"    x = {i}" for i in range(MAX_FUNCTION_LINES))
    (tmp_path / "long.py").write_text(f"def long():\n{body}\n" + "\n" * MAX_MODULE_LINES)
    assert oversized(tmp_path) == ["long.py: 461 lines", f"long.py: long is {MAX_FUNCTION_LINES + 1} lines"]
