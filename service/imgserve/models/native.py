"""AOTInductor packages: a .pt2 that `torch._inductor.aoti_compile_and_package` wrote, holding a shared object of
native code compiled for one device kind, with the weights inside it. Loading one runs its code as the server, so it
is served only with --trust-native-code (without it, `is_native_package` lets the loader refuse it in one line).

The compiled code takes its input in the layout of the example it was compiled from and, by default, checks neither
sizes nor strides: a batch in another layout gives wrong answers silently. The package is therefore loaded with its
run-time input checks on (AOTI_RUNTIME_CHECK_INPUTS), and fed NCHW batches (what `torch.rand` examples are).
"""

from __future__ import annotations

import os
import zipfile
from pathlib import Path

import torch

CODE_FOLDER = "data/aotinductor/"  # where a package keeps its compiled code, under the archive's root folder


def is_native_package(path: Path) -> bool:
    """Whether the .pt2 archive at `path` holds AOTInductor compiled code (not a torch.export program)."""
    if not zipfile.is_zipfile(path):
        return False
    with zipfile.ZipFile(path) as archive:
        return any(name.partition("/")[2].startswith(CODE_FOLDER) for name in archive.namelist())


class NativeModule(torch.nn.Module):
    """An AOTInductor package as a module: its compiled code called on the batch. It has no parameters of its own
    to share (the weights are in the package), so each worker holds its own copy."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        # Read once, when the package first runs: a batch whose sizes or strides differ from what was compiled
        # raises instead of being read wrongly.
        os.environ["AOTI_RUNTIME_CHECK_INPUTS"] = "1"
        self.package = torch._inductor.aoti_load_package(str(path))

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        output: torch.Tensor = self.package(batch)
        return output
