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


def test_scale_loss_multiplies_the_distillation_term_by_t_squared(tiny_target):
    """train.temperature.scale_loss: the soft-label term at T counts T^2 times (Hinton et al.), nothing else moves."""
    import torch

    from models.peagle import peagle_for_target
    from tests.test_trainer import make_cfg, tiny_features
    from train.trainer import soft_label_loss

    torch.manual_seed(0)
    head = peagle_for_target(tiny_target, k=3)
    items = tiny_features(tiny_target, n=2)
    tc = make_cfg("unused", ce_weight=0.0).train
    plain = soft_label_loss(tiny_target, tc, 3, "peagle", tiny_target.device)(head, items, 0, 2.0)[0]
    tc.temperature.scale_loss = True
    scaled = soft_label_loss(tiny_target, tc, 3, "peagle", tiny_target.device)(head, items, 0, 2.0)[0]
    assert float(scaled.detach()) == pytest.approx(4 * float(plain.detach()), rel=1e-5)
