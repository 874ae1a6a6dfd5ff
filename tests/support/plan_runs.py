"""Running `imgserve plan` in the tests and checking what it wrote."""

from __future__ import annotations

from pathlib import Path

from imgserve.cli import main


def run_plan(tmp_path: Path, capacity: Path, *extra: str) -> tuple[int, str]:
    """`imgserve plan` on `capacity` into tmp_path/out: its exit code and summary (empty when it refused)."""
    out = tmp_path / "out"
    code = main(["plan", "--capacity", str(capacity), "--out", str(out), "--startup-seconds", "45", *extra])
    return code, (out / "summary.md").read_text() if code != 2 else ""


def assert_plan_outputs(tmp_path: Path, summary: str, low: int, high: int) -> None:
    """The plot was written, the summary has every row, and the peak replica count is within [low, high]."""
    png = (tmp_path / "out" / "plan.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) < 200_000
    for row in (
        "Peak replicas",
        "GPU-minutes",
        "Time with shedding",
        "Shed requests",
        "p99-ish latency",
        "Oscillations",
        "Time to reach needed capacity",
    ):
        assert f"| {row} |" in summary
    peak = int(summary.split("| Peak replicas | ")[1].split()[0])
    assert low <= peak <= high
