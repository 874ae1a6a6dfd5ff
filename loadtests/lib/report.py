"""What every benchmark report shares: the machine it ran on, the failures it saw, and writing it out."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import psutil


def machine() -> str:
    """CPU count and model, RAM, and the GPU if torch sees one."""
    model = "unknown CPU"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as cpuinfo:
        model = next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), model)
    ram = psutil.virtual_memory().total / 2**30
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return f"{os.cpu_count()} CPUs ({model}), {ram:.0f} GiB RAM, {gpu}"


def failures_seen(cells: list) -> list[str]:
    """The report's list of the distinct failures any cell saw (none: no lines)."""
    errors = sorted({e for c in cells for e in c.result.errors()})
    return ["", "Failures seen:", *(f"- `{e}`" for e in errors[:10])] if errors else []


def publish(report: str, out: Path) -> int:
    """Write the markdown report to `out` and print it; the command's exit status."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(report)
    print(report)
    return 0
