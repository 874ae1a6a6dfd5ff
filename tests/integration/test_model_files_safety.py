"""Model files load without running code unless --trust-pickle.

A torch.export archive can carry code in several places that torch.export.load runs: pickled entries (sample inputs,
weights), SymPy shape strings (sympify evaluates them), shape guards (compiled as Python) and parameter names
(written into the generated forward()). Each hostile archive here is a real torch.export.save archive with one entry
edited to write a marker file; plain torch runs each of them (checked in a subprocess), imgserve refuses each without
running it. Ordinary exports (weights, dynamic batch, guards, dict outputs, keyword inputs) still load without the flag.
"""

from __future__ import annotations

import io
import json
import logging
import pickle
import re
import subprocess
import sys
import time
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from serving import start_server, stop_server
from torch import nn

from imgserve.models.loader import ModelLoadError, load_model

Entries = dict[str, bytes]  # an archive's entries, by their name under its root folder


class Marker:
    """Unpickling it writes `path` (the code a hostile model file would run) and gives what torch expects of sample
    inputs (one image), so that a trusted load goes on."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self) -> tuple:
        inputs = "((__import__('torch').rand(2, 3, 16, 16),), {})"
        return eval, (f"(__import__('pathlib').Path({self.path!r}).write_text('pwned'), {inputs})[1]",)


class ConvNet(nn.Module):
    """A small classifier: convolution, batch norm, pooling and a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, stride=2, padding=1)
        self.norm = nn.BatchNorm2d(4)
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.norm(self.conv(x))), 2)
        return self.head(F.adaptive_avg_pool2d(x, 1).flatten(1))


class Segmenter(nn.Module):
    """torchvision's segmentation output (a dict), resized back with a scale factor."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 5, 3, padding=1)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"out": F.interpolate(self.conv(F.interpolate(x, scale_factor=0.5)), size=x.shape[-2:])}


class Gained(nn.Module):
    """A keyword input besides the image."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 1)

    def forward(self, x: torch.Tensor, *, gain: torch.Tensor) -> torch.Tensor:
        return self.conv(x) * gain


IMAGE = torch.rand(2, 3, 16, 16)
BATCH = torch.export.Dim("batch", min=1, max=64)
AUTO = torch.export.Dim.AUTO


def _export(path: Path, model: nn.Module, dynamic: dict | None, kwargs: dict | None = None) -> Path:
    program = torch.export.export(model.eval(), (IMAGE,), kwargs, dynamic_shapes=dynamic)
    torch.export.save(program, str(path))
    return path


ORDINARY: dict[str, Callable[[Path], Path]] = {
    "conv net, dynamic batch": lambda p: _export(p, ConvNet(), {"x": {0: BATCH}}),
    "conv net, static": lambda p: _export(p, ConvNet(), None),
    "conv net, automatic dims (shape guards)": lambda p: _export(p, ConvNet(), {"x": {0: AUTO, 2: AUTO, 3: AUTO}}),
    "segmenter, dict output": lambda p: _export(p, Segmenter(), {"x": {0: BATCH, 2: AUTO, 3: AUTO}}),
    "keyword input": lambda p: _export(p, Gained(), {"x": {0: BATCH}, "gain": None}, {"gain": torch.ones(1)}),
}


@pytest.mark.parametrize("name", list(ORDINARY))
def test_an_ordinary_export_loads_without_trust_pickle(tmp_path: Path, name: str) -> None:
    path = ORDINARY[name](tmp_path / "model.pt2")
    model = load_model(str(path))
    reference = torch.export.load(str(path)).module()
    inputs = {"gain": torch.ones(1)} if name == "keyword input" else {}
    torch.testing.assert_close(model(IMAGE, **inputs), reference(IMAGE, **inputs))


def _plain(directory: Path) -> Path:
    return _export(directory / "plain.pt2", ConvNet(), {"x": {0: BATCH}})


def _edited(source: Path, target: Path, edit: Callable[[Entries], None]) -> Path:
    """A copy of the archive `source` whose entries `edit` changed (names relative to the archive's root folder)."""
    with zipfile.ZipFile(source) as archive:
        root = archive.namelist()[0].split("/")[0]
        entries = {name.partition("/")[2]: archive.read(name) for name in archive.namelist()}
    edit(entries)
    with zipfile.ZipFile(target, "w") as archive:
        for name, data in entries.items():
            archive.writestr(f"{root}/{name}", data)
    return target


def _saved(value: object) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _edit_json(entries: Entries, name: str, edit: Callable[[dict], None]) -> None:
    document = json.loads(entries[name])
    edit(document)
    entries[name] = json.dumps(document).encode()


def _pickled_sample_inputs(entries: Entries, marker: Path) -> None:
    entries["data/sample_inputs/model.pt"] = _saved(Marker(marker))


def _pickled_weight(entries: Entries, marker: Path) -> None:
    def first_pickled(config: dict) -> None:
        payload = config["config"]["conv.weight"]
        payload["use_pickle"] = True
        entries[f"data/weights/{payload['path_name']}"] = _saved(Marker(marker))

    _edit_json(entries, "data/weights/model_weights_config.json", first_pickled)


def _shape_guard(entries: Entries, marker: Path) -> None:
    guard = f"__import__('pathlib').Path({str(marker)!r}).write_text('pwned') > 0"
    _edit_json(entries, "models/model.json", lambda program: program.update(guards_code=[guard]))


def _shape_expression(entries: Entries, marker: Path) -> None:
    code = f" + 0*__import__('pathlib').Path({str(marker)!r}).write_text('pwned')"
    text = entries["models/model.json"].decode()
    entries["models/model.json"] = re.sub(r'("expr_str": "Symbol\([^"]*\))"', rf'\1{code}"', text, count=1).encode()


def _parameter_name(entries: Entries, marker: Path) -> None:
    """FX writes a parameter's name into the generated forward() inside getattr(self, "..."): a quote ends it."""
    assert "." not in str(marker)  # the name is split at dots
    code = f'getattr(getattr(__import__("pathlib"),"Path")("{marker}"),"write_text")("pwned")'
    hostile = f'conv.w",0),{code},("'
    for name in ("models/model.json", "data/weights/model_weights_config.json"):
        entries[name] = entries[name].replace(b'"conv.weight"', json.dumps(hostile).encode())


HOSTILE: dict[str, Callable[[Entries, Path], None]] = {
    "pickled sample inputs": _pickled_sample_inputs,
    "pickled weight": _pickled_weight,
    "shape guard": _shape_guard,
    "shape expression": _shape_expression,
    "parameter name": _parameter_name,
}


def _hostile_archives(directory: Path) -> dict[str, tuple[Path, Path]]:
    """Each hostile archive, with the marker file its code would write."""
    plain = _plain(directory)
    archives = {}
    for index, (name, edit) in enumerate(HOSTILE.items()):
        marker = directory / f"marker{index}"
        archives[name] = (
            _edited(plain, directory / f"hostile{index}.pt2", lambda e, m=marker, f=edit: f(e, m)),
            marker,
        )
    return archives


@pytest.fixture(scope="module")
def hostile(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    return _hostile_archives(tmp_path_factory.mktemp("hostile"))


def test_plain_torch_runs_the_code_of_every_hostile_archive(tmp_path: Path) -> None:
    """The attacks are real: torch.export.load, then one forward pass, writes every marker (in a child process)."""
    archives = _hostile_archives(tmp_path)
    script = (
        "import sys, torch\n"
        "for path in sys.argv[1:]:\n"
        "    try:\n"
        "        torch.export.load(path).module()(torch.rand(2, 3, 16, 16))\n"
        "    except Exception:\n"
        "        pass\n"
    )
    subprocess.run([sys.executable, "-c", script, *(str(path) for path, _ in archives.values())], capture_output=True)
    assert {name: marker.exists() for name, (_, marker) in archives.items()} == dict.fromkeys(archives, True)


@pytest.mark.parametrize("name", list(HOSTILE))
def test_a_hostile_archive_is_refused_without_running_its_code(hostile: dict, name: str) -> None:
    path, marker = hostile[name]
    with pytest.raises(ModelLoadError, match="--trust-pickle") as refused:
        load_model(str(path))
    assert "\n" not in str(refused.value)
    assert not marker.exists()


def _opaque_constant(entries: Entries) -> None:
    entries["data/constants/opaque_obj_0"] = pickle.dumps(None)
    config = {"config": {"obj": {"path_name": "opaque_obj_0", "is_param": False, "use_pickle": True}}}
    entries["data/constants/model_constants_config.json"] = json.dumps(config).encode()


ODD_ENTRIES: dict[str, Callable[[Entries], None]] = {
    "compiled AOTInductor code": lambda entries: entries.update({"data/aotinductor/model/model.so": b"\x7fELF"}),
    "a pickled custom object": _opaque_constant,
    "a second model": lambda entries: entries.update({"models/other.json": entries["models/model.json"]}),
}


@pytest.mark.parametrize("name", list(ODD_ENTRIES))
def test_entries_a_plain_export_does_not_hold_are_refused(hostile: dict, tmp_path: Path, name: str) -> None:
    """Each is refused naming the flag that would load it: compiled native code needs --trust-native-code, which
    --trust-pickle does not stand in for."""
    plain = hostile["pickled sample inputs"][0].parent / "plain.pt2"
    path = _edited(plain, tmp_path / "odd.pt2", ODD_ENTRIES[name])
    native = name == "compiled AOTInductor code"
    with pytest.raises(ModelLoadError, match="--trust-native-code" if native else "--trust-pickle"):
        load_model(str(path), trust_pickle=native)


def test_the_server_refuses_a_pickled_pt2_at_start_in_one_line(tmp_path: Path) -> None:
    """The main process refuses it before any worker starts: exit 2, one line, and no process ran the pickle."""
    marker = tmp_path / "marker"
    path = _edited(_plain(tmp_path), tmp_path / "model.pt2", lambda entries: _pickled_sample_inputs(entries, marker))
    server = start_server({"model": str(path)}, tmp_path)
    try:
        deadline = time.monotonic() + 90
        while server.process.poll() is None and not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not marker.exists(), "a process of the server ran the model file's pickle"
        assert server.process.wait(timeout=5) == 2
    finally:
        stop_server(server)
    lines = [line for line in server.log().splitlines() if line.strip()]
    assert len(lines) == 1 and "imgserve: " in lines[0] and "--trust-pickle" in lines[0], lines
    assert not marker.exists()


def test_trust_pickle_loads_a_pickled_pt2_and_runs_its_code(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--trust-pickle is the operator's word that the author is trusted: the archive loads as torch loads it."""
    # torch 2.13 logs its fallback to a full unpickle with a malformed format string, which pytest's log capture
    # raises on; the server only prints "--- Logging error ---".
    monkeypatch.setattr(logging.getLogger("torch._export.serde.serialize"), "disabled", True)
    marker = tmp_path / "marker"
    path = _edited(_plain(tmp_path), tmp_path / "model.pt2", lambda entries: _pickled_sample_inputs(entries, marker))
    assert isinstance(load_model(str(path), trust_pickle=True), nn.Module)
    assert marker.exists()


def test_torchscript_refuses_python_objects_in_its_pickles(tmp_path: Path) -> None:
    """TorchScript's own unpickler resolves TorchScript types only: a Python object in data.pkl is an error."""
    marker = tmp_path / "marker"
    torch.jit.save(torch.jit.script(nn.Conv2d(3, 3, 3)), str(tmp_path / "plain.ts"))
    hostile = _edited(
        tmp_path / "plain.ts",
        tmp_path / "hostile.ts",
        lambda entries: entries.update({"data.pkl": pickle.dumps(Marker(marker), protocol=2)}),
    )
    with pytest.raises(RuntimeError, match="Unknown type name"):
        load_model(str(hostile))
    assert not marker.exists()
