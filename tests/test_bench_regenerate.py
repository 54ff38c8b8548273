"""bench regenerate on CPU at the tiny shape: the figures it prints are the ones it measured."""

from dflash_ipc.bench.regenerate import format_table, run_regenerate_bench


def test_bench_regenerate_tiny_on_cpu():
    result = run_regenerate_bench(shape="tiny", device="cpu", num_prompts=12, num_single=2, min_prompt=16,
                                  max_prompt=40, max_new_tokens=6, caches=("static", "dynamic"), dtype="float32",
                                  token_budget=200, max_batch_size=4)
    single, static, dynamic = result["phases"]
    assert (single["prompts"], single["new_tokens"], single["batches"]) == (2, 12, 2)
    for p in (static, dynamic):
        assert p["prompts"] == 12 and p["new_tokens"] == 12 * 6  # no stop token: every prompt runs to the end
        assert 12 / 4 <= p["batches"] <= 12 and 0 <= p["prompt_padding_share"] < 0.5
        assert p["padding_share"] <= p["prompt_padding_share"] and p["tokens_per_s"] > 0
    assert result["speedup"]["batched static"] == static["tokens_per_s"] / single["tokens_per_s"]
    table = format_table(result)
    assert "random tiny on cpu (float32), 12 prompts of 16..40 tokens" in table
    assert "speedup batched dynamic / one at a time" in table and len(table.splitlines()) == 7
