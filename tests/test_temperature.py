"""Temperature schedules hit their end points and shapes."""

import math

import pytest

from models.errors import DraftheadsError
from train.temperature import temperature_at


@pytest.mark.parametrize("schedule", ["linear", "cosine", "exp"])
def test_end_points(schedule):
    assert temperature_at(0, 4.0, 1.0, schedule, 100) == pytest.approx(4.0)
    assert temperature_at(100, 4.0, 1.0, schedule, 100) == pytest.approx(1.0)
    assert temperature_at(500, 4.0, 1.0, schedule, 100) == pytest.approx(1.0)  # stays at the end


def test_midpoints():
    assert temperature_at(50, 4.0, 1.0, "linear", 100) == pytest.approx(2.5)
    assert temperature_at(50, 4.0, 1.0, "cosine", 100) == pytest.approx(2.5)
    assert temperature_at(25, 4.0, 1.0, "cosine", 100) == pytest.approx(1 + 3 * 0.5 * (1 + math.cos(math.pi / 4)))
    assert temperature_at(50, 4.0, 1.0, "exp", 100) == pytest.approx(2.0)  # geometric mean
    assert temperature_at(70, 3.0, 1.0, "constant", 100) == 3.0


def test_bad_input_is_a_clear_error():
    with pytest.raises(DraftheadsError, match="schedule 'step'"):
        temperature_at(0, 1.0, 1.0, "step", 10)
    with pytest.raises(DraftheadsError, match="> 0"):
        temperature_at(0, 0.0, 1.0, "linear", 10)
