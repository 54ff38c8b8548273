"""Faults a real-process test injects into a drafter, read once where the process starts.

The fault tests (tests/test_faults.py) run `dflash-ipc up` as a user does, so what they inject
travels in the environment; `run_drafter` reads it here, once, and hands the loop a plain
callable (`DrafterLoop(after_step=...)`), so the loop holds no test code:

    DFLASH_IPC_FAULT_STEP_SLEEP_S=8 DFLASH_IPC_FAULT_SLOW_STEPS=2   # the first 2 steps take 8 s longer

A slow step is alive all along (its beacon says "step"): the supervisor must not take it for
a hang, while a stopped process must still be found within `supervise.drafter_stall_s`.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Mapping

from dflash_ipc.errors import ConfigError

STEP_SLEEP_ENV = "DFLASH_IPC_FAULT_STEP_SLEEP_S"
SLOW_STEPS_ENV = "DFLASH_IPC_FAULT_SLOW_STEPS"


@dataclasses.dataclass(slots=True)
class SlowSteps:
    """Called after each optimizer step: sleeps `sleep_s` on the first `steps` calls (None: all)."""

    sleep_s: float
    """Extra seconds each slow step takes (> 0)."""
    steps: int | None = None
    """How many steps are slow, from the first; None: every step."""

    def __post_init__(self) -> None:
        if not self.sleep_s > 0:
            raise ConfigError(f"${STEP_SLEEP_ENV}: must be > 0 seconds, got {self.sleep_s}")
        if self.steps is not None and self.steps < 1:
            raise ConfigError(f"${SLOW_STEPS_ENV}: must be >= 1 (unset: every step), got {self.steps}")

    def __call__(self) -> None:
        if self.steps is None or self.steps > 0:
            time.sleep(self.sleep_s)
            self.steps = None if self.steps is None else self.steps - 1

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> "SlowSteps | None":
        """The slow steps `environ` asks for; None when it asks for none."""
        sleep = environ.get(STEP_SLEEP_ENV, "").strip()
        steps = environ.get(SLOW_STEPS_ENV, "").strip()
        if not sleep:
            if steps:
                raise ConfigError(f"${SLOW_STEPS_ENV}={steps} needs ${STEP_SLEEP_ENV} (seconds per slow step)")
            return None
        return cls(sleep_s=_number(STEP_SLEEP_ENV, sleep, float), steps=_number(SLOW_STEPS_ENV, steps, int)
                   if steps else None)


def _number(name: str, text: str, kind):
    try:
        return kind(text)
    except ValueError:
        raise ConfigError(f"${name}={text!r}: expected {'an integer' if kind is int else 'a number'}") from None
