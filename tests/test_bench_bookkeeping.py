"""The bookkeeping bench at tiny sizes, in-process: every figure present, positive, consistent.
Two single-worker prepares keep it fast (a pool's start costs seconds); test_data_prepare shows
that 2 workers give the same bytes as 1."""

from __future__ import annotations

import json
import shutil

from benchmarks.bookkeeping import _same_output, bench_prepare, parse_args, run, write_chats
from dflash_ipc.data.dataset import TOKENS_FILE


def test_bench_prints_and_writes_consistent_figures(tmp_path):
    lines: list[str] = []
    out = tmp_path / "bk.json"
    result = run(parse_args(["--samples", "3000", "--epochs", "2", "--rows", "40", "--workers", "1,1",
                             "--repeats", "2", "--json", str(out)]), print_fn=lines.append)
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    text = "\n".join(lines)
    assert "3,000 samples" in text and "40 multi-turn rows" in text and "identical output" in text

    plan = result["plan"]
    assert 0 < plan["min_s"] <= plan["median_s"] <= plan["max_s"]
    assert 0 <= plan["padding_fraction"] < plan["padding_fraction_unsorted"] < 1
    assert 0 < plan["num_batches"] < plan["num_samples"]

    ledger = result["ledger"]
    assert ledger["num_batches"] == ledger["num_commit_records"] == 2 * plan["num_batches"]
    assert ledger["num_sample_ids"] == 2 * 3000
    assert ledger["file_bytes"] > 4 * ledger["num_sample_ids"]  # ids in the batches and in the history
    assert ledger["save"]["min_s"] > 0 and ledger["load"]["min_s"] > 0 and ledger["loaded_same_counts"]

    prepare = result["prepare"]
    assert prepare["identical"] is True and prepare["input_bytes"] > 0
    assert [r["workers"] for r in prepare["runs"]] == [1, 1]
    for r in prepare["runs"]:
        assert r["num_samples"] == 40 and r["num_rejected"] == 0 and r["samples_per_s"] > 0


def test_chats_are_openai_messages_of_whole_turns(tmp_path):
    path = tmp_path / "c.jsonl"
    assert write_chats(str(path), 5) == path.stat().st_size
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 5
    for row in rows:
        roles = [m["role"] for m in row["messages"]]
        assert roles == ["user", "assistant"] * (len(roles) // 2) and 2 <= len(roles) <= 8


def test_output_comparison_sees_one_changed_token(tmp_path):
    assert bench_prepare(8, [1], str(tmp_path))["identical"] is None
    (out,) = tmp_path.glob("prepared-*")
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    assert _same_output(str(out), str(copy))
    tokens = bytearray((copy / TOKENS_FILE).read_bytes())
    tokens[0] ^= 1
    (copy / TOKENS_FILE).write_bytes(bytes(tokens))
    assert not _same_output(str(out), str(copy))
