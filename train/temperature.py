"""Distillation temperature schedule: T goes from `start` to `end` over `steps` (then stays at `end`)."""

from __future__ import annotations

import math

from models.errors import DraftheadsError

SCHEDULES = ("constant", "linear", "cosine", "exp")


def temperature_at(step: int, start: float, end: float, schedule: str, steps: int) -> float:
    if schedule not in SCHEDULES:
        raise DraftheadsError(f"train.temperature.schedule '{schedule}' is not one of {list(SCHEDULES)}")
    if start <= 0 or end <= 0:
        raise DraftheadsError(f"distillation temperatures must be > 0 (got start={start}, end={end})")
    if schedule == "constant" or steps <= 0:
        return float(start)
    x = min(max(step / steps, 0.0), 1.0)
    if schedule == "linear":
        return start + (end - start) * x
    if schedule == "cosine":
        return end + (start - end) * 0.5 * (1 + math.cos(math.pi * x))
    return start * (end / start) ** x  # exp: geometric interpolation
