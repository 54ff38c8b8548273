"""One support-table row as a real job: a tiny Qwen3-MoE target through `dflash-ipc up`.

prepare (chat template) -> `dflash-ipc up` (real processes: dispatcher, 1 target, 1 drafter;
layer ids and mask token derived from the target) -> `dflash-ipc export` -> `dflash-ipc eval
--check-lossless`. The other rows run the same components in one process
(tests/test_support_table.py).
"""

import json

import pytest
from click.testing import CliRunner

from dflash_ipc.cli import main
from dflash_ipc.config.load import load_config
from dflash_ipc.data.prepare import prepare_dataset
from dflash_ipc.dispatch.ledger_file import load_ledger
from architectures import ARCHITECTURES, build_tiny_target_of
from supervised_job import SupervisedJob
from test_support_table import write_chats

TIMEOUT_S = 300


@pytest.mark.slow
def test_qwen3_moe_row_through_a_real_job(tmp_path, tiny_cache):
    target = build_tiny_target_of(ARCHITECTURES["qwen3_moe"], str(tmp_path / "target"))
    data = str(tmp_path / "data")
    prepare_dataset(target, write_chats(tmp_path / "chats.jsonl", num_chats=24), data, max_length=128, progress=False)
    run_dir = tmp_path / "run"
    job = SupervisedJob(run_dir, tmp_path / "up.log", tiny_cache, [
        f"target.path={target}", f"data.path={data}", "data.bucket_boundaries=[64,128]", "data.token_budget=512",
        "data.num_epochs=2", "target.num_workers=1", "target.num_slots=2", "target.prefetch=1",
        "target.dtype=float32", "drafter.num_workers=1", "drafter.dtype=float32", "drafter.fifo_sequences=16",
        "model.num_layers=2", "model.block_size=4", "objective.max_anchors_per_seq=8",
        "objective.anchors_per_step=32", "optimizer.lr=3e-3", "checkpoint.every_steps=5",
        "dispatch.status_interval_s=2"])
    try:
        code = job.wait(TIMEOUT_S, during=job.processes)
        assert code == 0, job.output()[-5000:]
    finally:
        job.kill_all()
    cfg = load_config(str(run_dir / "config.yaml"))
    assert cfg.model.target_layer_ids == [1, 2] and cfg.model.mask_token_id == 3  # derived from the target
    assert load_ledger(str(run_dir / "ledger.npz")).all_committed()
    log = (run_dir / "logs" / "target-0.log").read_text()
    assert "Qwen3MoeModel" in log and "loaded 3 of 4 layers" in log, log[-3000:]
    assert "LOAD REPORT" not in log and "UNEXPECTED" not in log  # one line, not transformers' table

    runner = CliRunner()
    latest = json.loads((run_dir / "checkpoints" / "latest.json").read_text())["path"]
    exported = str(tmp_path / "export")
    result = runner.invoke(main, ["export", str(run_dir / "checkpoints" / latest), exported])
    assert result.exit_code == 0, result.output
    result = runner.invoke(main, ["eval", "--target", target, "--drafter", exported, "--data", data,
                                  "--num-prompts", "3", "--max-new-tokens", "12", "--check-lossless", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)[0]
    assert report["num_lossless_checked"] == 3 and report["lossless_mismatches"] == [], report
