"""What names compiled code in the cache (models/compiled.py `warm_key`): a package is machine code and oneDNN weight
layouts for one processor, so pods on other processors that share the cache (a PersistentVolumeClaim) never load
each other's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from imgserve.config import BuiltinModel
from imgserve.models import compiled

CPU = torch.device("cpu")


def cpuinfo(folder: Path, name: str, model: str, flags: str) -> str:
    """A /proc/cpuinfo of two processors of `model` with `flags` (another machine's CPU: none other exists here)."""
    processor = f"processor\t: {{}}\nvendor_id\t: GenuineIntel\nmodel name\t: {model}\nflags\t\t: {flags}\n\n"
    path = folder / name
    path.write_text(processor.format(0) + processor.format(1))
    return str(path)


def test_another_cpu_model_or_instruction_set_names_other_code(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    settings = BuiltinModel(model=["builtin:denoiser"], input_size=64)
    avx512 = "fpu sse2 avx avx2 fma avx512f avx512bw avx512vl"
    keys = {}
    for name, model, flags in [
        ("sapphire", "Intel(R) Xeon(R) Platinum 8480+", avx512),
        ("sapphire-again", "Intel(R) Xeon(R) Platinum 8480+", avx512),
        ("sapphire-without-avx512", "Intel(R) Xeon(R) Platinum 8480+", "fpu sse2 avx avx2 fma"),
        ("milan", "AMD EPYC 7763 64-Core Processor", "fpu sse2 avx avx2 fma"),
    ]:
        monkeypatch.setattr(compiled, "CPU_FACTS", cpuinfo(tmp_path, name, model, flags))
        keys[name] = compiled.warm_key(settings, 8, CPU)
    assert keys["sapphire"] == keys["sapphire-again"]
    assert len({keys["sapphire"], keys["sapphire-without-avx512"], keys["milan"]}) == 3, keys
