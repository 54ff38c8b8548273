"""`dflash-ipc bench eval` at the tiny shape: every row runs, figures and table are consistent,
the command writes strict JSON; on a GPU (marked) the same at bf16 and a float32 lossless run."""

import json
import math
import os

import pytest
import torch
from click.testing import CliRunner

from dflash_ipc.bench.eval import run_eval_bench
from dflash_ipc.cli import main

torch.set_num_threads(1)

ROWS = {("legacy", "speculative", 1), ("legacy", "plain", 1), ("batched", "speculative", 1),
        ("batched", "plain", 1), ("batched", "speculative", 3), ("batched", "plain", 3)}


@pytest.fixture(scope="module")
def work_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("bench-eval"))


def test_every_row_runs_on_cpu(work_dir):
    lines = []
    f = run_eval_bench(device="cpu", shape="tiny", batch_sizes=(1, 3), max_new_tokens=10, prompt_len=(8, 20),
                       legacy_prompts=2, work_dir=work_dir, emit=lines.append)
    rows = {(r["impl"], r["mode"], r["batch_size"]): r for r in f["rows"]}
    assert set(rows) == ROWS and not any(r["error"] for r in rows.values())
    assert rows[("batched", "plain", 3)]["num_prompts"] == 6 and rows[("batched", "plain", 1)]["num_prompts"] == 2
    for r in rows.values():
        assert 0 < r["num_tokens"] <= 10 * r["num_prompts"] and r["tokens_per_s"] == pytest.approx(
            r["num_tokens"] / r["wall_s"])
    # greedy decoding of the same prompts: speculative rows generate exactly what plain rows do
    assert rows[("batched", "speculative", 3)]["num_tokens"] == rows[("batched", "plain", 3)]["num_tokens"]
    assert rows[("legacy", "speculative", 1)]["num_tokens"] == rows[("legacy", "plain", 1)]["num_tokens"]
    assert math.isnan(rows[("batched", "plain", 3)]["tau"]) and rows[("batched", "speculative", 3)]["tau"] >= 1
    s = f["summary"]["speculative"]
    best = max((rows[("batched", "speculative", b)] for b in (1, 3)), key=lambda r: r["tokens_per_s"])
    assert s["best_batch_size"] == best["batch_size"]
    assert s["vs_legacy"] == pytest.approx(best["tokens_per_s"] / rows[("legacy", "speculative", 1)]["tokens_per_s"])
    one, plain1, spec1 = f["summary"]["batch1"], rows[("batched", "plain", 1)], rows[("batched", "speculative", 1)]
    for r in rows.values():  # every target forward counted: a plain one commits a token per row, a cycle <= 16
        per_forward = r["batch_size"] * (1 if r["mode"] == "plain" else 16)
        assert r["num_forwards"] >= r["num_tokens"] / per_forward
        assert r["ms_per_forward"] == pytest.approx(1e3 * r["wall_s"] / r["num_forwards"])
    assert one["plain_ms_per_step"] == plain1["ms_per_forward"] and one["spec_ms_per_cycle"] == spec1["ms_per_forward"]
    assert one["bound_ms_per_step"] == pytest.approx(1e3 * f["weight_gib"] * 2**30 / 4.8e12)
    assert one["plain_of_bound"] == pytest.approx(one["bound_ms_per_step"] / one["plain_ms_per_step"])
    text = lines[0]
    assert "tiny-shaped random target" in text and "goal >= 20x" in text and text.count("\n  legacy ") == 2
    assert "batch 1: plain step" in text and "plain steps (speedup = tau / " in text
    assert os.path.isfile(os.path.join(work_dir, "target-tiny", "config.json"))  # kept for the next run


def test_repeated_runs_report_the_median_and_their_spread(work_dir):
    lines = []
    f = run_eval_bench(device="cpu", shape="tiny", batch_sizes=(1,), max_new_tokens=6, prompt_len=(8, 12),
                       legacy_prompts=0, work_dir=work_dir, repeats=3, emit=lines.append)
    assert f["repeats"] == 3
    for r in f["rows"]:
        assert len(r["ms_runs"]) == 3 and r["ms_per_forward"] == pytest.approx(sorted(r["ms_runs"])[1])
    one = f["summary"]["batch1"]
    assert one["plain_ms_runs"] and one["spec_ms_runs"]
    assert any(line.startswith("  batch 1, the median of 3 timed runs each: plain ") for line in lines[0].splitlines())
    # no legacy rows: the summary says so instead of printing nan ratios against them
    assert "(no legacy row to compare with)" in lines[0] and "nan" not in lines[0]


def test_the_median_run_is_the_lower_middle_one_and_a_failed_run_is_the_rows():
    from dflash_ipc.bench.eval import Row, _median_run
    runs = [Row(impl="batched", mode="plain", batch_size=1, wall_s=w, num_forwards=10) for w in (0.4, 0.1, 0.3, 0.2)]
    median = _median_run(runs)
    assert median.wall_s == 0.2 and median.ms_runs == pytest.approx([40.0, 10.0, 30.0, 20.0])
    runs[2].error = "out of GPU memory"
    assert _median_run(runs).error == "out of GPU memory"


def test_bench_command_writes_strict_json(work_dir, tmp_path):
    out = str(tmp_path / "bench.json")
    result = CliRunner().invoke(main, ["bench", "eval", "--device", "cpu", "--shape", "tiny", "--batch-sizes", "2",
                                       "--max-new-tokens", "4", "--prompt-len", "6,12", "--legacy-prompts", "1",
                                       "--work-dir", work_dir, "--json", out], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    with open(out) as f:
        figures = json.load(f, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))
    assert len(figures["rows"]) == 4 and figures["rows"][-1]["peak_gib"] is None
    assert "batched speculative:" in result.output


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_bench_and_float32_lossless_on_gpu(work_dir, tiny_cache):
    f = run_eval_bench(device="cuda:0", shape="tiny", batch_sizes=(1, 8), max_new_tokens=24, prompt_len=(8, 40),
                       work_dir=work_dir, emit=print)
    assert f["dtype"] == "bfloat16" and all(not r["error"] and r["peak_gib"] > 0 for r in f["rows"])
    from dflash_ipc.eval.speculative import evaluate
    from eval_helpers import eval_data, random_drafter
    target_dir = os.path.join(tiny_cache, "tiny-target")
    report = evaluate(target_dir, random_drafter(target_dir, block_size=8), eval_data(str(tiny_cache)), num_prompts=4,
                      max_new_tokens=24, device="cuda:0", dtype="float32", check_lossless=True, batch_size=3)
    assert report.num_lossless_checked == 4 and report.lossless_mismatches == [] and report.near_ties == []
