"""Acceptance arithmetic on constructed cases: prefix length, commit rule, tau, per-position rates."""

import json
import math
import random

import pytest
import torch

from dflash_ipc.errors import DataError
from dflash_ipc.eval.acceptance import (
    AcceptanceStats,
    Cycle,
    accepted_prefix_length,
    commit_block,
    verify_block,
)
from dflash_ipc.eval.lossless import LosslessCheck
from dflash_ipc.eval.report import EvalReport, PlainFigures, SampleResult, format_comparison


def stats_of(cycles: list[Cycle], *, block_size: int, prefill_tokens: list[int] | tuple = ()) -> AcceptanceStats:
    """An accumulator filled from cycle records (and prefills yielding the given token counts)."""
    stats = AcceptanceStats(block_size=block_size)
    for n in prefill_tokens:
        stats.add_prefill(n)
    for cycle in cycles:
        stats.add_cycle(cycle)
    return stats


def t(ids):
    return torch.tensor(ids, dtype=torch.long)


@pytest.mark.parametrize("drafted, target_next, want", [
    ([5, 6, 7], [5, 6, 7, 8], 3),
    ([5, 9, 7], [5, 6, 7, 8], 1),  # a later match after a miss does not count
    ([4, 6, 7], [5, 6, 7, 8], 0),
    ([], [5], 0),
    ([5, 6], [5, 6], 2),
])
def test_accepted_prefix_length(drafted, target_next, want):
    assert accepted_prefix_length(t(drafted), t(target_next)) == want


def test_accepted_prefix_length_needs_enough_target_tokens():
    with pytest.raises(DataError, match="fewer than the 3 drafted"):
        accepted_prefix_length(t([1, 2, 3]), t([1, 2]))


@pytest.mark.parametrize("drafted, remaining, stops, want_tokens, want_m, stopped", [
    ([5, 6, 7], 10, (), [5, 6, 7, 8], 3, False),  # all accepted + bonus
    ([5, 9, 7], 10, (), [5, 6], 1, False),  # first miss at k=2: the target's own token replaces it
    ([4, 6, 7], 10, (), [5], 0, False),  # nothing accepted: the bonus alone (plain decoding)
    ([5, 6, 7], 2, (), [5, 6], 3, False),  # budget cuts accepted tokens and the bonus
    ([5, 6, 7], 10, (6,), [5, 6], 3, True),  # stop token among the accepted drafts
    ([5, 9, 7], 10, (6,), [5, 6], 1, True),  # stop token as the bonus
    ([5, 6, 7], 10, (1, 2), [5, 6, 7, 8], 3, False),
])
def test_verify_block(drafted, remaining, stops, want_tokens, want_m, stopped):
    tokens, cycle = verify_block(t(drafted), t([5, 6, 7, 8]), remaining=remaining, stop_token_ids=stops)
    assert tokens == want_tokens
    assert cycle == Cycle(num_drafted=len(drafted), num_accepted=want_m, num_committed=len(want_tokens),
                          stopped=stopped)


def test_verify_block_rejects_bad_shapes():
    with pytest.raises(DataError, match="drafted\\+1 = 4"):
        verify_block(t([1, 2, 3]), t([1, 2, 3]), remaining=5)
    with pytest.raises(DataError, match="remaining=0"):
        verify_block(t([1]), t([1, 2]), remaining=0)


def test_verify_block_matches_naive_rule_on_random_blocks():
    """The commit rule written out as a loop, against the implementation, on random blocks."""
    rng = random.Random(0)
    for _ in range(300):
        d = rng.randint(0, 7)
        target_next = [rng.randint(0, 3) for _ in range(d + 1)]
        drafted = [tok if rng.random() < 0.7 else rng.randint(0, 3) for tok in target_next[:d]]
        remaining, stops = rng.randint(1, 9), {rng.randint(0, 6)}
        want = []
        for k in range(d + 1):  # accept drafts while they match, then take the target's token
            want.append(target_next[k])
            if k == d or drafted[k] != target_next[k]:
                break
        want = want[:remaining]
        cut = next((i + 1 for i, tok in enumerate(want) if tok in stops), len(want))
        tokens, cycle = verify_block(t(drafted), t(target_next), remaining=remaining, stop_token_ids=stops)
        assert tokens == want[:cut]
        assert cycle.stopped == any(tok in stops for tok in tokens)
        assert cycle.num_committed == len(tokens) <= cycle.num_accepted + 1


def constructed_stats() -> AcceptanceStats:
    # Block size 4 (3 drafted positions), two prompts whose prefills gave one token each.
    cycles = [
        Cycle(num_drafted=3, num_accepted=3, num_committed=4),
        Cycle(num_drafted=3, num_accepted=1, num_committed=2),
        Cycle(num_drafted=3, num_accepted=0, num_committed=1),
        Cycle(num_drafted=2, num_accepted=2, num_committed=2),  # end of budget: 2 drafted, bonus cut
    ]
    return stats_of(cycles, block_size=4, prefill_tokens=[1, 1])


def test_tau_and_rates_on_constructed_cycles():
    s = constructed_stats()
    assert s.num_cycles == 4 and s.num_committed == 9
    assert s.tau == pytest.approx(9 / 4)
    # Position k: cycles that drafted k and accepted it (m >= k) / cycles that drafted k.
    assert s.drafted_at == [4, 4, 3] and s.accepted_at == [3, 2, 1]
    assert s.acceptance_per_position == pytest.approx([3 / 4, 2 / 4, 1 / 3])
    assert s.num_generated == 11 and s.num_target_forwards == 6
    assert s.target_forwards_per_token == pytest.approx(6 / 11)
    assert s.decode_forwards_per_token == pytest.approx(1 / s.tau)
    assert s.committed_hist == [0, 1, 2, 0, 1]


def test_plain_decoding_and_perfect_drafting_extremes():
    plain = stats_of([Cycle(num_drafted=15, num_accepted=0, num_committed=1)] * 5, block_size=16)
    assert plain.tau == 1.0 and plain.acceptance_per_position == [0.0] * 15
    perfect = stats_of([Cycle(num_drafted=15, num_accepted=15, num_committed=16)] * 3, block_size=16,
                       prefill_tokens=[1])
    assert perfect.tau == 16.0 and perfect.acceptance_per_position == [1.0] * 15
    assert perfect.target_forwards_per_token == pytest.approx(4 / 49)


def test_merge_equals_one_accumulator():
    a = constructed_stats()
    b = stats_of([Cycle(num_drafted=3, num_accepted=2, num_committed=3)], block_size=4, prefill_tokens=[0])
    merged = constructed_stats()
    merged.merge(b)
    together = stats_of([Cycle(num_drafted=3, num_accepted=3, num_committed=4),
                         Cycle(num_drafted=3, num_accepted=1, num_committed=2),
                         Cycle(num_drafted=3, num_accepted=0, num_committed=1),
                         Cycle(num_drafted=2, num_accepted=2, num_committed=2),
                         Cycle(num_drafted=3, num_accepted=2, num_committed=3)],
                        block_size=4, prefill_tokens=[1, 1, 0])
    assert merged == together != a
    with pytest.raises(DataError, match="block_size 16"):
        merged.merge(AcceptanceStats(block_size=16))


def test_empty_stats_are_nan_not_errors():
    s = AcceptanceStats(block_size=4)
    assert math.isnan(s.tau) and math.isnan(s.target_forwards_per_token)
    assert all(math.isnan(r) for r in s.acceptance_per_position)


@pytest.mark.parametrize("cycle", [
    Cycle(num_drafted=4, num_accepted=0, num_committed=1),  # more drafted than bs-1
    Cycle(num_drafted=2, num_accepted=3, num_committed=1),  # accepted > drafted
    Cycle(num_drafted=3, num_accepted=1, num_committed=3),  # committed > accepted + 1
])
def test_add_cycle_rejects_impossible_cycles(cycle):
    with pytest.raises(DataError):
        AcceptanceStats(block_size=4).add_cycle(cycle)


def report(label, stats, verdicts=(None,), plain=None):
    checks = [None if v is None else LosslessCheck(verdict=v, position=None if v == "identical" else 3,
                                                    speculative_margin=0.01, plain_margin=0.02, tolerance=0.05)
              for v in verdicts]
    samples = [SampleResult(sample_id=i, prompt_len=5, output_ids=[1, 2], stats=stats, stopped=False, check=c)
               for i, c in enumerate(checks)]
    return EvalReport(label=label, stats=stats, samples=samples, max_new_tokens=24, wall_s=0.5, plain=plain)


def test_report_dict_and_text():
    plain = PlainFigures(num_generated=11, wall_s=1.1)
    r = report("trained", constructed_stats(), verdicts=("identical", "mismatch", None, "near_tie"), plain=plain)
    d = r.to_dict()
    assert d["tau"] == pytest.approx(2.25) and d["num_prompts"] == 4 and d["sample_ids"] == [0, 1, 2, 3]
    assert d["acceptance_per_position"] == pytest.approx([0.75, 0.5, 1 / 3])
    assert d["num_lossless_checked"] == 3 and d["lossless_mismatches"] == [1] and d["near_ties"] == [3]
    assert [c["sample_id"] for c in d["lossless"]] == [1, 3] and d["lossless"][1]["verdict"] == "near_tie"
    # 11 tokens in 0.5 s speculative against 11 in 1.1 s plain
    assert d["tokens_per_s"] == pytest.approx(22.0) and d["plain"]["tokens_per_s"] == pytest.approx(10.0)
    assert d["speedup"] == pytest.approx(2.2)
    text = r.format()
    assert "tau 2.25" in text and "k=1 0.75 | 2 0.50 | 3 0.33" in text
    assert "DIFFERENT on samples [1]" in text and "1 numerical near-ties" in text and "speedup 2.20x" in text
    empty = report("untrained", AcceptanceStats(block_size=4))
    assert "k=1 - | 2 - | 3 -" in empty.format()
    assert empty.to_dict()["tau"] is None and empty.to_dict()["acceptance_per_position"] == [None] * 3
    assert empty.to_dict()["speedup"] is None
    json.dumps(empty.to_dict(), allow_nan=False)


def test_format_comparison_puts_both_taus_on_one_line():
    untrained = report("untrained", stats_of([Cycle(num_drafted=3, num_accepted=0, num_committed=1)] * 4,
                                             block_size=4))
    trained = report("trained", constructed_stats())
    first = format_comparison(untrained, trained).splitlines()[0]
    assert "untrained 1.00 -> trained 2.25 (2.25x)" in first and "block 4" in first


@pytest.mark.parametrize("tokens, drafted, accepted, remaining, stops, want, want_m", [
    ([5, 6, 7, 8], 3, 3, 10, (), [5, 6, 7, 8], 3),
    ([5, 6, 7, 8], 3, 1, 10, (), [5, 6], 1),
    ([5, 6, 7, 8], 2, 3, 2, (), [5, 6], 2),  # a full block verified near the end of the budget: clamped
    ([5, 6, 7, 8], 3, 3, 10, (6,), [5, 6], 3),
])
def test_commit_block(tokens, drafted, accepted, remaining, stops, want, want_m):
    committed, cycle = commit_block(tokens, num_drafted=drafted, num_accepted=accepted, remaining=remaining,
                                    stop_token_ids=stops)
    assert committed == want and cycle.num_accepted == want_m and cycle.num_committed == len(want)
    assert cycle.stopped == bool(set(want) & set(stops))


@pytest.mark.parametrize("overrides, shown", [([], True), (["-o", "target.path=/models/other"], False)])
def test_up_ends_with_the_comparison_for_the_embedded_default_only(monkeypatch, tmp_path, overrides, shown):
    """`up` of the embedded default (tiny target, synthetic data) prints tau of the trained drafter
    next to an untrained one once the job exits 0; any other job prints nothing of the kind."""
    from click.testing import CliRunner

    import dflash_ipc.builtin.assets as assets
    import dflash_ipc.eval.speculative as speculative
    import dflash_ipc.target.resolve as resolve
    import dflash_ipc.supervise.supervisor as supervisor
    from dflash_ipc.cli import main

    class FinishedJob:
        def __init__(self, cfg, run_lock=None):  # `up` claimed the run directory before it resolved the job
            self.run_lock = run_lock

        def run(self):
            return 0

    asked = []
    untrained = report("untrained", stats_of([Cycle(num_drafted=3, num_accepted=0, num_committed=1)] * 4,
                                             block_size=4))
    monkeypatch.setattr(assets, "materialize", lambda cfg: cfg)
    monkeypatch.setattr(resolve, "resolve_job", lambda cfg: cfg)
    monkeypatch.setattr(supervisor, "Supervisor", FinishedJob)
    monkeypatch.setattr(speculative, "untrained_vs_trained",
                        lambda *a, **k: asked.append(a) or (untrained, report("trained", constructed_stats())))
    result = CliRunner().invoke(main, ["up", "-o", f"run.run_dir={tmp_path}", *overrides])
    assert result.exit_code == 0, result.output
    assert ("untrained 1.00 -> trained 2.25" in result.output) == shown and len(asked) == int(shown)
    if shown:
        assert asked[0][1] == str(tmp_path / "checkpoints") and asked[0][2] == "builtin:synthetic"
