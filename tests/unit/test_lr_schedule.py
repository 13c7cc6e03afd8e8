"""The learning-rate schedule (trainer/loop.py: lr_factor): linear warm-up, then cosine decay to the floor."""

import itertools

import pytest

from trainer.loop import lr_factor


def test_lr_schedule_warms_up_then_decays_to_the_floor():
    factors = [lr_factor(step, 20, 5, 0.1) for step in range(21)]
    assert factors[0] == pytest.approx(0.2) and factors[4] == pytest.approx(1.0)
    assert factors[5] == pytest.approx(1.0)
    assert all(a >= b for a, b in itertools.pairwise(factors[5:]))
    assert factors[20] == pytest.approx(0.1)
