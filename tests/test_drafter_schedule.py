"""Learning-rate schedules: cosine as before, WSD's three phases and decay shapes."""

import math

import pytest

from dflash_ipc.config.schema import ScheduleConfig
from dflash_ipc.config.load import load_config
from dflash_ipc.drafter.schedule import lr_lambda, schedule_lambda, wsd_lambda
from dflash_ipc.errors import ConfigError


def test_cosine_warms_up_then_follows_the_cosine_to_the_floor():
    f = lr_lambda(total_steps=100, warmup_ratio=0.1, min_lr_ratio=0.1)
    assert [f(s) for s in (0, 4, 9)] == pytest.approx([0.1, 0.5, 1.0])
    assert f(10) == pytest.approx(1.0)
    assert f(55) == pytest.approx(0.1 + 0.9 * 0.5)  # halfway through the 90 cosine steps
    assert f(100) == pytest.approx(0.1) and f(500) == pytest.approx(0.1)
    assert schedule_lambda(ScheduleConfig(name="cosine"), 100)(55) == lr_lambda(100, 0.04, 0.0)(55)


@pytest.mark.parametrize("shape, at_quarter", [("linear", 0.75), ("cosine", (1 + math.cos(math.pi / 4)) / 2),
                                                ("sqrt", 0.5)])
def test_wsd_warms_up_holds_the_peak_then_decays_over_the_last_fraction(shape, at_quarter):
    f = wsd_lambda(total_steps=100, warmup_ratio=0.1, min_lr_ratio=0.0, decay_ratio=0.2, decay_shape=shape)
    assert [f(s) for s in (0, 9)] == pytest.approx([0.1, 1.0])
    assert all(f(s) == 1.0 for s in range(10, 80))  # stable: the peak, step 10 to 79
    assert f(80) == pytest.approx(1.0)  # the decay starts at 1 (p = 0) ...
    assert f(85) == pytest.approx(at_quarter)  # ... p = 5/20 a quarter in ...
    assert f(100) == pytest.approx(0.0) and f(130) == pytest.approx(0.0)  # ... and ends at the floor
    values = [f(s) for s in range(80, 101)]
    assert all(a >= b for a, b in zip(values, values[1:]))  # monotone


def test_wsd_floor_no_warmup_and_a_run_too_short_for_both_phases():
    f = wsd_lambda(total_steps=10, warmup_ratio=0.0, min_lr_ratio=0.2, decay_ratio=0.5)
    assert f(0) == 1.0 and f(4) == 1.0 and f(5) == pytest.approx(1.0)
    assert f(10) == pytest.approx(0.2) and f(7) == pytest.approx(0.2 + 0.8 * (1 - 2 / 5))
    g = wsd_lambda(total_steps=4, warmup_ratio=0.5, min_lr_ratio=0.0, decay_ratio=1.0)
    assert [g(s) for s in range(5)] == pytest.approx([0.5, 1.0, 1.0, 0.5, 0.0])  # decay begins after warmup


def test_the_config_picks_wsd_and_checks_its_fields():
    cfg = load_config(None, ["schedule.name=wsd", "schedule.decay_ratio=0.5", "schedule.decay_shape=sqrt",
                             "schedule.warmup_ratio=0"]).schedule
    assert schedule_lambda(cfg, 8)(6) == pytest.approx(1 - math.sqrt(2 / 4))
    with pytest.raises(ConfigError, match="schedule.decay_ratio: must be in"):
        load_config(None, ["schedule.decay_ratio=0"])
    with pytest.raises(ConfigError, match="warmup_ratio \\+ decay_ratio = 1.1 exceeds 1"):
        load_config(None, ["schedule.name=wsd", "schedule.warmup_ratio=0.3", "schedule.decay_ratio=0.8"])
    with pytest.raises(ConfigError, match="schedule.decay_shape: 'exp' not allowed"):
        load_config(None, ["schedule.decay_shape=exp"])
