"""What `pip install imgserve` installs, built as a real wheel."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

from serving import REPO


def test_the_wheel_installs_imgserve_and_nothing_named_service(tmp_path: Path) -> None:
    """What `pip install imgserve` puts in site-packages: the `imgserve` package (weights included), no `service`."""
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path), str(REPO)],
        check=True,
        timeout=240,
        cwd=tmp_path,
    )
    (wheel,) = tmp_path.glob("imgserve-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {name.split("/")[0] for name in names if not name.startswith("imgserve-")} == {"imgserve"}
    assert "imgserve/models/denoiser.safetensors" in names and "imgserve/__main__.py" in names
