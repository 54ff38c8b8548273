"""Is speculative output the target's own greedy output? Identical, a numerical near-tie, or a mismatch.

Greedy speculative decoding commits only tokens the target itself chose, so in exact
arithmetic it reproduces plain greedy decoding. In bf16 it need not: the verify pass runs
16 tokens through kernels other than a one-token decode step, the rounding differs, and
where the target's two best logits are closer than that rounding the argmax can flip.
From that token on the two outputs continue from different prefixes.

So at the first differing position i both decoders' margins are looked at (top-1 minus
top-2 logit of the target where each chose token i, recorded while decoding):

    tolerance = near_tie_ulps x ulp(top-1 logit) in the compute dtype
    near_tie  if both margins <= tolerance: both passes saw the two tokens as tied within
              what the dtype resolves
    mismatch  otherwise: one pass had a clear winner the other did not choose (a bug)

float32 resolves ties 2**16 times finer than bf16; there the outputs are expected to be
identical (tests/test_eval_batched.py keeps that).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from dflash_ipc.decode.requests import Generation

VERDICTS = ("identical", "near_tie", "mismatch")
NEAR_TIE_ULPS = 4.0
"""Default tolerance, in units in the last place of the top logit."""


@dataclass(kw_only=True, slots=True)
class LosslessCheck:
    """Speculative against plain output of one prompt (turn)."""

    verdict: str
    """One of VERDICTS."""
    position: int | None = None
    """First generated-token index where they differ."""
    speculative_token: int | None = None
    plain_token: int | None = None
    speculative_margin: float | None = None
    """The target's top-1 minus top-2 logit where speculative decoding chose its token there."""
    plain_margin: float | None = None
    tolerance: float | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def ulp(value: float, dtype: torch.dtype) -> float:
    """Spacing of ``dtype`` numbers at ``|value|`` (that of 1.0 below 1)."""
    exponent = math.floor(math.log2(abs(value))) if abs(value) >= 1 else 0
    return torch.finfo(dtype).eps * 2.0**exponent


def compare(speculative: Generation, plain: Generation, *, dtype: torch.dtype,
            near_tie_ulps: float = NEAR_TIE_ULPS) -> LosslessCheck:
    """The verdict for two greedy generations of the same prompt."""
    a, b = speculative.tokens, plain.tokens
    i = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if i is None:
        if len(a) == len(b):
            return LosslessCheck(verdict="identical")
        # Equal prefixes of different lengths: one stopped where the other went on (no margins to judge).
        return LosslessCheck(verdict="mismatch", position=min(len(a), len(b)))
    margins = (_at(speculative.margins, i), _at(plain.margins, i))
    tops = [t for t in (_at(speculative.top_logits, i), _at(plain.top_logits, i)) if t is not None]
    check = LosslessCheck(verdict="mismatch", position=i, speculative_token=a[i], plain_token=b[i],
                          speculative_margin=margins[0], plain_margin=margins[1])
    if None in margins or not tops:
        return check
    check.tolerance = near_tie_ulps * ulp(max(abs(t) for t in tops), dtype)
    if max(margins) <= check.tolerance:
        check.verdict = "near_tie"
    return check


def _at(values: list[float], i: int) -> float | None:
    return float(values[i]) if i < len(values) and not math.isnan(values[i]) else None
