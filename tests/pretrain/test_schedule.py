"""Learning-rate schedules: values at known steps."""
import itertools
import math

import pytest

from kiln.pretrain.schedule import lr_at


def test_warmup_rises_linearly_to_peak():
    assert [lr_at(s, 100, 1.0, warmup=4) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]


def test_cosine_from_peak_to_floor():
    lr = [lr_at(s, 101, 2.0, warmup=0, min_ratio=0.1) for s in range(101)]
    assert lr[0] == 2.0
    assert lr[50] == pytest.approx(1.1)  # halfway: the mean of peak and floor
    assert lr[25] == pytest.approx(0.2 + 1.8 * 0.5 * (1 + math.cos(math.pi / 4)))
    assert lr[100] == pytest.approx(0.2)  # the last step reaches min_ratio x peak
    assert all(a >= b for a, b in itertools.pairwise(lr))


def test_cosine_starts_after_warmup():
    assert lr_at(10, 110, 1.0, warmup=10) == 1.0
    assert lr_at(60, 111, 1.0, warmup=10, min_ratio=0.0) == pytest.approx(0.5)


def test_wsd_stable_then_linear_decay():
    lr = [lr_at(s, 10, 1.0, warmup=2, min_ratio=0.0, kind="wsd", decay_frac=0.4) for s in range(10)]
    assert lr == pytest.approx([0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 0.75, 0.5, 0.25, 0.0])


def test_wsd_without_decay_stays_at_peak():
    assert {lr_at(s, 10, 3e-4, kind="wsd", decay_frac=0.0) for s in range(10)} == {3e-4}


def test_bad_inputs_say_what_is_wrong():
    with pytest.raises(ValueError, match="'cosine' or 'wsd'"):
        lr_at(0, 10, 1.0, kind="linear")
    with pytest.raises(ValueError, match="outside the phase's 10 steps"):
        lr_at(10, 10, 1.0)
