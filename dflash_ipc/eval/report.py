"""The report of an evaluation: one drafter on one prompt set, speculative against plain decoding.

Figures (acceptance.py defines tau and the per-position rates):

* tokens/s = generated tokens / wall time of the whole run (prefills included), for the
  speculative run and for the plain run of the same prompts with the same batch size;
  speedup = speculative tokens/s / plain tokens/s (the wall-time ratio when both generate
  the same tokens, as greedy lossless decoding does).
* lossless: per prompt (turn) identical, numerical near-tie or mismatch (lossless.py).

``to_dict`` is what ``dflash-ipc eval --json`` prints; ``format`` the text lines.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

from dflash_ipc.eval.acceptance import AcceptanceStats
from dflash_ipc.eval.lossless import LosslessCheck
from dflash_ipc.run.json_files import json_safe


@dataclass(kw_only=True, slots=True)
class SampleResult:
    """One prompt's (one turn's) speculative generation."""

    sample_id: int
    """Dataset sample id, or the prompt's line index in its file."""
    prompt_len: int
    output_ids: list[int]
    """Generated tokens only (the prompt excluded), stop token included if one came."""
    stats: AcceptanceStats
    stopped: bool
    """Ended on a stop token (else on the max_new_tokens budget)."""
    turn: int = 0
    """Turn of a multi-turn prompt (0 for single-turn sets)."""
    check: LosslessCheck | None = None
    """Against plain greedy decoding; None when not checked."""

    @property
    def lossless(self) -> bool | None:
        """Identical to plain greedy decoding; None when not checked."""
        return None if self.check is None else self.check.verdict == "identical"


@dataclass(kw_only=True, slots=True)
class PlainFigures:
    """The plain-decoding run of the same prompts."""

    num_generated: int
    wall_s: float

    @property
    def tokens_per_s(self) -> float:
        return self.num_generated / self.wall_s if self.wall_s > 0 else math.nan


@dataclass(kw_only=True, slots=True)
class EvalReport:
    """Speculative decoding of one prompt set with one drafter."""

    label: str
    """What was evaluated, e.g. 'trained (runs/default/checkpoints/step_00000060)'."""
    stats: AcceptanceStats
    samples: list[SampleResult]
    max_new_tokens: int
    wall_s: float
    """Wall time of the speculative run."""
    prompt_set: str = "held-out"
    batch_size: int = 1
    sampling: dict = field(default_factory=lambda: {"temperature": 0.0, "top_p": 1.0, "seed": 0})
    dtype: str = ""
    device: str = ""
    """The hardware the timings are of, e.g. 'NVIDIA H200' or 'cpu (x86_64, 2 threads)'."""
    plain: PlainFigures | None = None
    speedups: list[float] = field(default_factory=list)
    """One speedup per interleaved (plain, speculative) pair of timed runs; `speedup` is their median."""

    @property
    def tau(self) -> float:
        return self.stats.tau

    @property
    def sample_ids(self) -> list[int]:
        return list(dict.fromkeys(s.sample_id for s in self.samples))

    @property
    def tokens_per_s(self) -> float:
        return self.stats.num_generated / self.wall_s if self.wall_s > 0 else math.nan

    @property
    def speedup(self) -> float:
        """The median speedup of the interleaved pairs (the first pair alone when nothing repeated):
        plain and speculative runs timed next to each other, so that a change of clocks or load
        between them is not read as a speedup."""
        if self.speedups:
            return statistics.median(self.speedups)
        return self.tokens_per_s / self.plain.tokens_per_s if self.plain and self.plain.tokens_per_s else math.nan

    @property
    def num_lossless_checked(self) -> int:
        return sum(s.check is not None for s in self.samples)

    def _with(self, verdict: str) -> list[int]:
        return list(dict.fromkeys(s.sample_id for s in self.samples if s.check and s.check.verdict == verdict))

    @property
    def lossless_mismatches(self) -> list[int]:
        """Sample ids whose output differs from plain greedy decoding where no tie explains it."""
        return self._with("mismatch")

    @property
    def near_ties(self) -> list[int]:
        """Sample ids whose output differs from plain greedy decoding at a numerical near-tie."""
        return self._with("near_tie")

    def to_dict(self) -> dict:
        """JSON-ready (per-sample token ids left out); nan (nothing measured) becomes None."""
        s = self.stats
        return json_safe({
            "label": self.label, "prompt_set": self.prompt_set, "block_size": s.block_size,
            "num_prompts": len(self.sample_ids), "num_turns": len(self.samples), "sample_ids": self.sample_ids,
            "max_new_tokens": self.max_new_tokens, "batch_size": self.batch_size, "sampling": dict(self.sampling),
            "dtype": self.dtype, "device": self.device, "tau": s.tau, "acceptance_per_position": s.acceptance_per_position,
            "target_forwards_per_token": s.target_forwards_per_token,
            "decode_forwards_per_token": s.decode_forwards_per_token, "num_generated_tokens": s.num_generated,
            "num_target_forwards": s.num_target_forwards, "num_cycles": s.num_cycles,
            "committed_hist": list(s.committed_hist), "wall_s": self.wall_s, "tokens_per_s": self.tokens_per_s,
            "plain": None if self.plain is None else {"num_generated_tokens": self.plain.num_generated,
                                                      "wall_s": self.plain.wall_s,
                                                      "tokens_per_s": self.plain.tokens_per_s},
            "speedup": self.speedup, "speedups": list(self.speedups), "num_lossless_checked": self.num_lossless_checked,
            "lossless_mismatches": self.lossless_mismatches, "near_ties": self.near_ties,
            "lossless": [dict(sample_id=r.sample_id, turn=r.turn, **r.check.to_dict())
                         for r in self.samples if r.check is not None and r.check.verdict != "identical"],
        })

    def format(self) -> str:
        """A few human-readable lines."""
        s = self.stats
        turns = f", {len(self.samples)} turns" if len(self.samples) != len(self.sample_ids) else ""
        lines = [
            f"{self.label} [{self.prompt_set}]: tau {s.tau:.2f} over {s.num_cycles} cycles, {len(self.sample_ids)} "
            f"prompts{turns}, {s.num_generated} tokens ({s.target_forwards_per_token:.3f} target forwards/token, "
            f"{s.decode_forwards_per_token:.3f} without prefill), {self.wall_s:.1f}s",
            "  acceptance by block position: " + format_positions(s.acceptance_per_position),
            "  " + self._speed_line(),
        ]
        if self.num_lossless_checked:
            lines.append("  " + self._lossless_line())
        return "\n".join(lines)

    def _speed_line(self) -> str:
        how = "greedy" if not self.sampling.get("temperature") else \
            f"temperature {self.sampling['temperature']:g}, top-p {self.sampling.get('top_p', 1.0):g}"
        line = f"speculative {self.tokens_per_s:,.1f} tok/s (batch {self.batch_size}, {how}"
        line += "".join(f", {x}" for x in (self.dtype, self.device) if x) + ")"
        if self.plain is not None:
            line += (f"; plain {self.plain.tokens_per_s:,.1f} tok/s ({self.plain.num_generated} tokens, "
                     f"{self.plain.wall_s:.1f}s); speedup {self.speedup:.2f}x")
            if len(self.speedups) > 1:
                line += (f" (median of {len(self.speedups)} interleaved pairs, "
                         f"{min(self.speedups):.2f}-{max(self.speedups):.2f}x)")
        return line

    def _lossless_line(self) -> str:
        bad, ties = self.lossless_mismatches, self.near_ties
        parts = [] if bad or ties else ["identical"]
        if ties:
            first = next(r.check for r in self.samples if r.check and r.check.verdict == "near_tie")
            parts.append(f"{len(ties)} numerical near-ties in {self.dtype or 'this dtype'} on samples {ties} (first: "
                         f"token {first.position}, margins {first.speculative_margin:.3g}/{first.plain_margin:.3g} "
                         f"<= {first.tolerance:.3g})")
        if bad:
            parts.append(f"DIFFERENT on samples {bad}")
        n, what = self.num_lossless_checked, "prompts" if len(self.samples) == len(self.sample_ids) else "turns"
        return f"vs plain greedy on {n} {what}: " + "; ".join(parts)


def format_positions(rates: Sequence[float]) -> str:
    """``k=1 0.83 | 2 0.61 | ...``; positions never drafted print as '-'."""
    cells = ["-" if math.isnan(r) else f"{r:.2f}" for r in rates]
    return " | ".join(f"{'k=' if k == 1 else ''}{k} {c}" for k, c in enumerate(cells, start=1))


def format_comparison(untrained: EvalReport, trained: EvalReport) -> str:
    """The embedded default's last lines: tau of the trained drafter next to an untrained one."""
    gain = trained.tau / untrained.tau if untrained.tau and not math.isnan(untrained.tau) else math.nan
    return "\n".join([
        f"acceptance length tau on {len(trained.sample_ids)} {trained.prompt_set} prompts "
        f"(block {trained.stats.block_size}, up to {trained.max_new_tokens} new tokens): "
        f"untrained {untrained.tau:.2f} -> trained {trained.tau:.2f} ({gain:.2f}x)",
        "  " + untrained.format().replace("\n", "\n  "),
        "  " + trained.format().replace("\n", "\n  "),
    ])
