"""Acceptance arithmetic of speculative decoding: the commit rule and the counters behind every figure.

One *cycle* = one drafter pass + one target verification pass. With the newest committed
token (the anchor) at position ``s``, the drafter proposes ``d`` tokens for positions
``s+1 .. s+d``; the target, run on ``[anchor, drafted...]``, gives its greedy token for
each of the positions ``s+1 .. s+d+1`` (``target_next``, ``d+1`` entries). Then

    m         = longest prefix with drafted[j] == target_next[j]      (accepted drafts)
    committed = drafted[:m] + [target_next[m]]                        (+ the "bonus" token)

cut at the generation budget and after the first stop token (:func:`commit_block`; under
sampling, m comes from rejection sampling instead, see sampling.py). Definitions reported
(as in the DFlash paper and z-lab's ``dflash_generate``):

* ``tau`` (mean acceptance length) = committed tokens / cycles, pooled over all cycles of
  all prompts: the tokens one target forward produces. Plain decoding has tau = 1; a
  perfect drafter with block size ``bs`` has tau = bs. The prefill forward (which yields
  the first token) is not a cycle and is not in tau.
* acceptance at block position ``k`` (1 .. bs-1) = fraction of the cycles that drafted
  position ``k`` in which it was accepted (``m >= k``). Cycles near the end of the budget
  draft fewer positions, so they only count for the positions they drafted.
* target forwards per generated token = (cycles + prefills) / (all generated tokens);
  without the prefills it is exactly ``1 / tau``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from torch import Tensor

from dflash_ipc.errors import DataError

logger = logging.getLogger(__name__)


def accepted_prefix_length(drafted: Tensor, target_next: Tensor) -> int:
    """Length of the longest prefix of ``drafted`` ``[d]`` equal to ``target_next[:d]``.

    ``target_next`` holds at least ``d`` entries (usually ``d+1``: the last is the bonus).
    """
    d = int(drafted.numel())
    if target_next.numel() < d:
        raise DataError(f"target_next has {target_next.numel()} tokens, fewer than the {d} drafted")
    if d == 0:
        return 0
    same = (drafted.reshape(-1).cpu() == target_next.reshape(-1)[:d].cpu()).long()  # [d]
    return int(same.cumprod(0).sum())


@dataclass(kw_only=True, slots=True)
class Cycle:
    """What one draft + verify cycle did."""

    num_drafted: int
    """Drafted tokens verified (bs-1, fewer near the end of the budget)."""
    num_accepted: int
    """Longest matching prefix of the drafted tokens (before any cut)."""
    num_committed: int
    """Tokens appended to the output: accepted + bonus, cut at the budget and stop token."""
    stopped: bool = False
    """A stop token was committed in this cycle."""


def verify_block(
    drafted: Tensor,
    target_next: Tensor,
    *,
    remaining: int,
    stop_token_ids: Iterable[int] = (),
) -> tuple[list[int], Cycle]:
    """Greedy verification of one drafted block: the tokens to append and the cycle record.

    drafted ``[d]`` proposals for positions s+1..s+d; target_next ``[d+1]`` the target's
    greedy tokens for s+1..s+d+1; ``remaining`` >= 1 tokens left in the budget.
    """
    d = int(drafted.numel())
    if target_next.numel() != d + 1:
        raise DataError(f"target_next must hold drafted+1 = {d + 1} tokens, got {target_next.numel()}")
    if remaining < 1:
        raise DataError(f"remaining={remaining}: verify_block needs at least one token of budget")
    m = accepted_prefix_length(drafted, target_next)
    # Greedy: the accepted drafts equal the target's own tokens, so target_next[:m+1] is the commit.
    return commit_block(target_next.reshape(-1).tolist(), num_drafted=d, num_accepted=m, remaining=remaining,
                        stop_token_ids=stop_token_ids)


def commit_block(tokens: Sequence[int], *, num_drafted: int, num_accepted: int, remaining: int,
                 stop_token_ids: Iterable[int] = ()) -> tuple[list[int], Cycle]:
    """The commit rule: ``tokens[:accepted+1]`` (accepted drafts, then the target's token), cut at
    the budget and after the first stop token. ``tokens`` holds at least accepted+1 entries;
    ``num_accepted`` may exceed ``num_drafted`` (a fixed-shape batch verifies full blocks near
    the end of the budget) and is then clamped to it."""
    if remaining < 1:
        raise DataError(f"remaining={remaining}: a cycle needs at least one token of budget")
    m = min(num_accepted, num_drafted)
    committed = [int(t) for t in tokens[: m + 1]][:remaining]
    stops = stop_token_ids if isinstance(stop_token_ids, (set, frozenset)) else set(stop_token_ids)
    stopped = False
    for i, tok in enumerate(committed):
        if tok in stops:
            committed, stopped = committed[: i + 1], True
            break
    return committed, Cycle(num_drafted=num_drafted, num_accepted=m, num_committed=len(committed), stopped=stopped)


@dataclass(kw_only=True, slots=True)
class AcceptanceStats:
    """Counters of many cycles and prefills; every figure of the report derives from them."""

    block_size: int
    num_cycles: int = 0
    num_committed: int = 0
    """Tokens committed by cycles (prefill tokens excluded)."""
    num_prefills: int = 0
    num_prefill_tokens: int = 0
    drafted_at: list[int] = field(default_factory=list)
    """[bs-1]: cycles that drafted block position k = index + 1."""
    accepted_at: list[int] = field(default_factory=list)
    """[bs-1]: cycles that accepted block position k = index + 1."""
    committed_hist: list[int] = field(default_factory=list)
    """[bs+1]: cycles by number of committed tokens (0..bs)."""

    def __post_init__(self) -> None:
        if self.block_size < 2:
            raise DataError(f"AcceptanceStats.block_size={self.block_size} must be >= 2")
        n = self.block_size - 1
        self.drafted_at = list(self.drafted_at) or [0] * n
        self.accepted_at = list(self.accepted_at) or [0] * n
        self.committed_hist = list(self.committed_hist) or [0] * (self.block_size + 1)

    def add_prefill(self, num_tokens: int = 1) -> None:
        """One target forward over the prompt that produced ``num_tokens`` (0 or 1) tokens."""
        self.num_prefills += 1
        self.num_prefill_tokens += num_tokens

    def add_cycle(self, cycle: Cycle) -> None:
        bs = self.block_size
        if not 0 <= cycle.num_accepted <= cycle.num_drafted <= bs - 1:
            raise DataError(f"cycle {cycle}: need 0 <= accepted <= drafted <= block_size-1 = {bs - 1}")
        if not 0 <= cycle.num_committed <= cycle.num_accepted + 1:
            raise DataError(f"cycle {cycle}: committed must be in [0, accepted+1]")
        self.num_cycles += 1
        self.num_committed += cycle.num_committed
        for k in range(cycle.num_drafted):
            self.drafted_at[k] += 1
            self.accepted_at[k] += k < cycle.num_accepted
        self.committed_hist[cycle.num_committed] += 1

    def merge(self, other: "AcceptanceStats") -> None:
        """Add another accumulator's counts (same block size) into this one."""
        if other.block_size != self.block_size:
            raise DataError(f"cannot merge block_size {other.block_size} into {self.block_size}")
        self.num_cycles += other.num_cycles
        self.num_committed += other.num_committed
        self.num_prefills += other.num_prefills
        self.num_prefill_tokens += other.num_prefill_tokens
        for mine, theirs in ((self.drafted_at, other.drafted_at), (self.accepted_at, other.accepted_at),
                             (self.committed_hist, other.committed_hist)):
            for i, v in enumerate(theirs):
                mine[i] += v

    @property
    def tau(self) -> float:
        """Mean acceptance length: committed tokens per verification forward (nan: no cycle)."""
        return self.num_committed / self.num_cycles if self.num_cycles else math.nan

    @property
    def acceptance_per_position(self) -> list[float]:
        """[bs-1]: P(position k accepted | position k drafted), k = 1..bs-1 (nan: never drafted)."""
        return [a / d if d else math.nan for a, d in zip(self.accepted_at, self.drafted_at)]

    @property
    def num_generated(self) -> int:
        return self.num_committed + self.num_prefill_tokens

    @property
    def num_target_forwards(self) -> int:
        return self.num_cycles + self.num_prefills

    @property
    def target_forwards_per_token(self) -> float:
        """All target forwards (prefills included) per generated token; plain decoding: 1."""
        return self.num_target_forwards / self.num_generated if self.num_generated else math.nan

    @property
    def decode_forwards_per_token(self) -> float:
        """Verification forwards per token they committed: exactly 1 / tau."""
        return self.num_cycles / self.num_committed if self.num_committed else math.nan
