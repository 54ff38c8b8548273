"""bench regenerate on CPU at the tiny shape: the figures it prints are the ones it measured."""

import pytest

from dflash_ipc.bench.regenerate import PHASES, format_table, run_regenerate_bench


def test_bench_regenerate_tiny_on_cpu():
    result = run_regenerate_bench(shape="tiny", device="cpu", num_prompts=12, num_single=2, min_prompt=16,
                                  max_prompt=40, min_new_tokens=2, max_new_tokens=12, phases=PHASES,
                                  dtype="float32", max_batch_size=4, check_every=4)
    single, static, dynamic, batches, continuous, refill_each, compiled = result["phases"]
    budgets = static["new_tokens"]
    assert (single["prompts"], single["batches"]) == (2, 2) and single["rows_per_step"] == 1
    for p in (static, dynamic, batches, continuous, refill_each, compiled):
        assert p["prompts"] == 12 and p["new_tokens"] == budgets  # no stop token: every reply runs to its budget
        assert 0 <= p["prompt_padding_share"] < 0.5 and p["tokens_per_s"] > 0
        assert 0 < p["bound_ratio"] < 1
        assert p["bound_tokens_per_s"] * p["bound_ratio"] == pytest.approx(p["new_tokens"] / p["seconds"])
    assert batches["warmup_seconds"] > 0 and continuous["captures"] == 0  # CPU: eager, nothing to capture
    assert static["bound_ratio_with_kv"] is None and continuous["bound_ratio_with_kv"] > continuous["bound_ratio"]
    # Mixed budgets: refilling rows runs fewer steps, each over more busy rows, than static batches.
    assert continuous["steps"] < batches["steps"] and continuous["padding_share"] < batches["padding_share"]
    assert result["speedup"]["engine-continuous / generate-static"] == \
        continuous["tokens_per_s"] / static["tokens_per_s"]
    table = format_table(result)
    assert "random tiny on cpu (float32), 12 prompts of 16..40 tokens, replies of 2..12 tokens" in table
    assert "engine-continuous / engine-batches (continuous batching)" in table
    assert "engine-continuous / engine-refill-each (a refill per several free rows)" in table
    assert "engine-compiled / engine-continuous (torch.compile of the decode forward)" in table
    # CPU: compile auto is off (no CUDA graphs), so the compiled phase steps as engine-continuous does
    assert compiled["steps"] == continuous["steps"] and compiled["new_tokens"] == continuous["new_tokens"]
    assert len(table.splitlines()) == 2 + 7 + 4 + 10  # head, phases, warm-ups, speedups
