"""Load shapes for the Locust run: users as a function of progress (0..1 of --run-time) and the peak user count."""

from __future__ import annotations

from collections.abc import Callable


def step(progress: float, peak: int) -> int:
    """Five equal steps up to `peak`."""
    return max(1, round(peak * (min(int(progress * 5), 4) + 1) / 5))


def spike(progress: float, peak: int) -> int:
    """A tenth of `peak`, all of it for the middle fifth of the run, then a tenth again."""
    return peak if 0.4 <= progress < 0.6 else max(1, peak // 10)


def soak(progress: float, peak: int) -> int:
    """Ramp to `peak` over the first tenth, then hold it."""
    return max(1, round(peak * min(progress / 0.1, 1.0)))


SHAPES: dict[str, Callable[[float, int], int]] = {"step": step, "spike": spike, "soak": soak}
