"""The slow steps a fault test asks for in the environment, read once at the drafter's start."""

import pytest

from dflash_ipc.drafter.faults import SLOW_STEPS_ENV, STEP_SLEEP_ENV, SlowSteps
from dflash_ipc.errors import ConfigError


def test_nothing_asked_is_no_hook():
    assert SlowSteps.from_env({}) is None
    assert SlowSteps.from_env({STEP_SLEEP_ENV: " "}) is None


def test_the_first_n_steps_sleep_then_none(monkeypatch):
    slept = []
    monkeypatch.setattr("dflash_ipc.drafter.faults.time.sleep", slept.append)
    slow = SlowSteps.from_env({STEP_SLEEP_ENV: "8", SLOW_STEPS_ENV: "2"})
    assert slow == SlowSteps(sleep_s=8.0, steps=2)
    for _ in range(4):
        slow()
    assert slept == [8.0, 8.0]
    every = SlowSteps.from_env({STEP_SLEEP_ENV: "0.5"})
    for _ in range(3):
        every()
    assert every.steps is None and slept == [8.0, 8.0, 0.5, 0.5, 0.5]


@pytest.mark.parametrize("env, message", [
    ({STEP_SLEEP_ENV: "soon"}, r"\$DFLASH_IPC_FAULT_STEP_SLEEP_S='soon': expected a number"),
    ({STEP_SLEEP_ENV: "0"}, r"\$DFLASH_IPC_FAULT_STEP_SLEEP_S: must be > 0 seconds, got 0.0"),
    ({STEP_SLEEP_ENV: "1", SLOW_STEPS_ENV: "1.5"}, r"\$DFLASH_IPC_FAULT_SLOW_STEPS='1.5': expected an integer"),
    ({STEP_SLEEP_ENV: "1", SLOW_STEPS_ENV: "0"}, r"\$DFLASH_IPC_FAULT_SLOW_STEPS: must be >= 1"),
    ({SLOW_STEPS_ENV: "2"}, r"\$DFLASH_IPC_FAULT_SLOW_STEPS=2 needs \$DFLASH_IPC_FAULT_STEP_SLEEP_S"),
])
def test_bad_values_name_the_variable(env, message):
    with pytest.raises(ConfigError, match=message):
        SlowSteps.from_env(env)
