"""The benchmarks of issue 22 on CPU: MoE target capacity next to a dense target
(`bench target`, with the random-weight assets of `bench.assets`), and the drafter step's
sequence-length flags (`bench drafter --seq-len --num-seqs --anchors-per-seq`)."""

import json

import pytest
from click.testing import CliRunner

from dflash_ipc.bench.assets import build_random_dataset, build_random_target
from dflash_ipc.bench.targets import _shape_of
from dflash_ipc.cli import main
from dflash_ipc.errors import DataError


def test_moe_capacity_next_to_a_dense_target(tmp_path):
    dense = build_random_target(str(tmp_path / "dense"), shape="tiny", dtype="float32")
    moe = build_random_target(str(tmp_path / "moe"), shape="tiny-moe", dtype="float32", num_layers=3)
    data = build_random_dataset(dense, str(tmp_path / "data"), num_samples=24, min_len=32, max_len=256)
    out = tmp_path / "bench.json"
    result = CliRunner().invoke(main, [
        "bench", "target", "-o", f"data.path={data}", "-o", "data.bucket_boundaries=[64,128,256]",
        "-o", "data.token_budget=1024", "-o", "target.dtype=float32", "-o", "model.num_layers=2",
        "--target", dense, "--target", moe, "--seconds", "0.3", "--warmup-s", "0", "--json", str(out)])
    assert result.exit_code == 0, result.output
    dense_row, moe_row = json.loads(out.read_text())
    assert dense_row["experts"] is None and (moe_row["experts"], moe_row["active_experts"]) == (8, 2)
    # 3 of the MoE shape's 4 layers were built; ids derived per target, scaled to the shape's depth
    assert moe_row["num_layers"] == 3 and moe_row["shape_num_layers"] == 4 and moe_row["layer_ids"] == [0, 1]
    assert moe_row["layers_run"] == 2 and moe_row["layers_run_at_shape_depth"] == 3
    assert moe_row["tok_per_s_at_shape_depth"] == moe_row["tok_per_s"] * 2 / 3
    assert dense_row["layer_ids"] == [1, 2] and dense_row["tok_per_s"] > 0 and moe_row["batches"] >= 1
    assert "tiny-moe / tiny:" in result.stdout and "at shape depth" in result.stdout


def test_a_broken_shape_file_is_a_data_error_naming_it(tmp_path):
    assert _shape_of(str(tmp_path)) == {}  # a target not built by bench.assets
    (tmp_path / "dflash_bench.json").write_text('{"shape": "tiny",')
    with pytest.raises(DataError, match=r"dflash_bench\.json: the shape file .* is not valid JSON \(line 1"):
        _shape_of(str(tmp_path))
    (tmp_path / "dflash_bench.json").write_text('["tiny"]')
    with pytest.raises(DataError, match=r"dflash_bench\.json: the shape file"):
        _shape_of(str(tmp_path))


def test_drafter_bench_takes_sequence_length_and_sequences_per_step():
    result = CliRunner().invoke(main, ["bench", "drafter", "--device", "cpu", "--shape", "tiny", "--steps", "1",
                                       "--warmup", "0", "--seq-len", "512", "--seq-len", "1536", "--num-seqs", "2",
                                       "--anchors-per-seq", "8"])
    assert result.exit_code == 0, result.output
    assert "2 seqs x 512 tokens, 8 anchors/seq, block 16: 256 query tokens, 1,024 context tokens" in result.stdout
    assert "2 seqs x 1536 tokens, 8 anchors/seq, block 16: 256 query tokens, 3,072 context tokens" in result.stdout
    assert "MFU" in result.stdout and "peak memory" in result.stdout


def test_a_sharpened_random_head_has_logits_of_the_asked_spread(tmp_path):
    """bench precision's target: rows of ids the tokenizer can write scaled to logits of std 4
    for a unit-RMS hidden state, the others zero (text only); the spread is what it says."""
    import torch
    from transformers import AutoModelForCausalLM

    from dflash_ipc.builtin.tiny import build_tiny_tokenizer
    path = build_random_target(str(tmp_path / "t"), shape="tiny", dtype="float32", text_only=True, logit_std=4.0)
    head = AutoModelForCausalLM.from_pretrained(path).get_output_embeddings().weight.detach()
    n = len(build_tiny_tokenizer())
    hidden = torch.randn(4096, head.shape[1], generator=torch.Generator().manual_seed(0))  # unit RMS
    logits = hidden @ head[:n].T
    assert 3.8 < float(logits.std()) < 4.2
    assert not head[n:].any()
    assert json.loads((tmp_path / "t" / "dflash_bench.json").read_text())["logit_std"] == 4.0
