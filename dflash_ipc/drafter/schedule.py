"""Learning-rate schedules of the drafter: the factor of optimizer.lr at each step.

Both start with a linear warmup over ``warmup = round(total * warmup_ratio)`` steps (at least
one when warmup_ratio > 0), factor ``(step + 1) / warmup``, and end at ``min_lr_ratio``:

    cosine  after the warmup: min + (1 - min) * (1 + cos(pi * p)) / 2,
            p = (step - warmup) / (total - warmup), from 1 down to min over the rest
    wsd     warmup-stable-decay: 1 until the last ``decay = round(total * decay_ratio)``
            steps (at least one), then from 1 down to min over them, p = progress in the decay:
              linear  1 - p
              cosine  (1 + cos(pi * p)) / 2
              sqrt    1 - sqrt(p)            (the "1-sqrt" cooldown of WSD papers)
            as min + (1 - min) * shape(p)

A step past the planned ``total`` keeps the last factor (min): a run longer than planned
(more epochs of data than estimated) continues at the floor instead of climbing again. WSD's
point is the stable phase: a run can be extended or stopped at any checkpoint of it and
decayed then, and its checkpoints before the decay are all alike.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from dflash_ipc.config.schema import ScheduleConfig
from dflash_ipc.errors import ConfigError

DECAY_SHAPES: dict[str, Callable[[float], float]] = {
    "linear": lambda p: 1.0 - p,
    "cosine": lambda p: 0.5 * (1.0 + math.cos(math.pi * p)),
    "sqrt": lambda p: 1.0 - math.sqrt(p),
}


def _warmup_steps(total_steps: int, warmup_ratio: float) -> int:
    return max(1, round(total_steps * warmup_ratio)) if warmup_ratio > 0 else 0


def lr_lambda(total_steps: int, warmup_ratio: float, min_lr_ratio: float) -> Callable[[int], float]:
    """Linear warmup, then cosine from 1 to min_lr_ratio, flat after the last planned step."""
    warmup = _warmup_steps(total_steps, warmup_ratio)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return factor


def wsd_lambda(total_steps: int, warmup_ratio: float, min_lr_ratio: float, decay_ratio: float,
               decay_shape: str = "linear") -> Callable[[int], float]:
    """Linear warmup, stable at 1, then ``decay_shape`` from 1 to min_lr_ratio over the last
    ``decay_ratio`` of the planned steps; flat after them."""
    if decay_shape not in DECAY_SHAPES:
        raise ConfigError(f"schedule.decay_shape: {decay_shape!r} not allowed; allowed: {', '.join(DECAY_SHAPES)}")
    shape = DECAY_SHAPES[decay_shape]
    warmup = _warmup_steps(total_steps, warmup_ratio)
    decay = max(1, round(total_steps * decay_ratio))
    decay_start = max(warmup, total_steps - decay)  # a short run: the decay starts after the warmup

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if step < decay_start:
            return 1.0
        progress = min(1.0, (step - decay_start) / max(1, total_steps - decay_start))
        return min_lr_ratio + (1 - min_lr_ratio) * shape(progress)
    return factor


def schedule_lambda(cfg: ScheduleConfig, total_steps: int) -> Callable[[int], float]:
    """The factor function of ``cfg.name`` (LambdaLR's ``lr_lambda``) for a run of ``total_steps``."""
    if total_steps < 1:
        raise ConfigError(f"schedule: total_steps={total_steps} must be >= 1")
    if cfg.name == "cosine":
        return lr_lambda(total_steps, cfg.warmup_ratio, cfg.min_lr_ratio)
    if cfg.name == "wsd":
        return wsd_lambda(total_steps, cfg.warmup_ratio, cfg.min_lr_ratio, cfg.decay_ratio, cfg.decay_shape)
    raise ConfigError(f"schedule.name: {cfg.name!r} not allowed; allowed: cosine, wsd")
