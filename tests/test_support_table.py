"""One test per row of the target support table (docs/targets.md), through the real components.

Each row's tiny random-weight target (tests/architectures.py) goes through the
user's path in one process: `prepare` with its chat template, `resolve_job` (derived layer
ids and mask token), the target worker's `produce` into a real shared-memory slot pool, the
features checked against the full model's HF `hidden_states[id + 1]` (the convention SGLang
and vLLM read `target_layer_ids` with: a mismatch would collapse acceptance silently), the
drafter's copy of the slot into its sequence queue, training steps, checkpoint, `export`, and
`dflash-ipc eval --check-lossless`. A row the installed transformers lacks is skipped with that
reason (pytest -rs lists it); docs/targets.md must list every row. One row also runs as a real
`dflash-ipc up` job: tests/test_target_up.py.
"""

import json
import os
import re

import pytest
import torch
from click.testing import CliRunner

from dflash_ipc.wire import protocol as p
from dflash_ipc.cli import main
from dflash_ipc.config.load import config_from_dict
from dflash_ipc.data.dataset import TokenDataset
from dflash_ipc.data.prepare import prepare_dataset
from dflash_ipc.builtin.tiny import TINY_VOCAB_WORDS
from dflash_ipc.drafter.inference_format import export_training_checkpoint
from dflash_ipc.drafter.model import DFlashConfig
from dflash_ipc.hf.target_head import FrozenTargetHead
from dflash_ipc.drafter.trainer import DrafterTrainer
from dflash_ipc.run.checkpoints import CheckpointStore
from dflash_ipc.drafter.sequence_queue import SequenceQueue
from dflash_ipc.target.resolve import resolve_job
from architectures import ARCHITECTURES, UNSUPPORTED, build_tiny_target_of, missing_reason
from dflash_ipc.hf.target_config import load_target_config
from dflash_ipc.target.capture import FeatureCapture
from dflash_ipc.hf.text_stack import load_causal_lm, text_config
from dflash_ipc.target.worker import TargetWorker
from dflash_ipc.transport.backends import ReaderCache, create_pool
from dflash_ipc.transport.slots import SlotLayout

torch.set_num_threads(1)

DOCS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "targets.md")
NUM_CHATS = 8
TRAIN_STEPS = 6


def write_chats(path, *, num_chats=NUM_CHATS, seed=0) -> str:
    """OpenAI-style conversations over the tiny vocabulary: system, user, assistant turns."""
    g = torch.Generator().manual_seed(seed)

    def words(n):
        return " ".join(TINY_VOCAB_WORDS[i] for i in torch.randint(0, len(TINY_VOCAB_WORDS), (n,), generator=g))
    with open(path, "w") as f:
        for i in range(num_chats):
            f.write(json.dumps({"messages": [{"role": "system", "content": words(3)},
                                             {"role": "user", "content": words(6 + i % 5)},
                                             {"role": "assistant", "content": words(18 + 3 * i)}]}) + "\n")
    return str(path)


def write_token_rows(path, *, num_rows=NUM_CHATS, seed=0) -> str:
    """Pre-tokenized rows (ids of the tiny vocabulary), the second half of each trained."""
    g = torch.Generator().manual_seed(seed)
    with open(path, "w") as f:
        for i in range(num_rows):
            n = 30 + 3 * i
            ids = torch.randint(10, 1000, (n,), generator=g).tolist()
            f.write(json.dumps({"input_ids": ids, "loss_mask": [0] * (n // 2) + [1] * (n - n // 2)}) + "\n")
    return str(path)


def row_job(target_dir, data_dir, run_dir, **model):
    """A resolved one-target, one-drafter CPU job on the row's target and data."""
    cfg = config_from_dict({
        "run": {"run_dir": str(run_dir)},
        "data": {"path": str(data_dir), "bucket_boundaries": [64, 128], "token_budget": 512},
        "target": {"path": str(target_dir), "dtype": "float32", "num_workers": 1, "num_slots": 1, "prefetch": 1},
        "drafter": {"num_workers": 1, "dtype": "float32", "fifo_sequences": 64},
        "model": {"num_layers": 1, "block_size": 4, **model},
        "optimizer": {"lr": 3e-3},
        "objective": {"max_anchors_per_seq": 8, "anchors_per_step": 16}})
    return resolve_job(cfg)


def captured_vs_hidden_states(target_dir, dataset, features, layer_ids) -> float:
    """Largest gap between the slot's packed features and HF `hidden_states[id + 1]` of the
    FULL model, each sample run alone."""
    full = load_causal_lm(target_dir, dtype=torch.float32).eval()
    worst, offset = 0.0, 0
    with torch.no_grad():
        for i in range(len(dataset)):
            ids, _ = dataset.sample(i)
            states = full(input_ids=torch.from_numpy(ids.astype("int64"))[None], output_hidden_states=True).hidden_states
            want = torch.cat([states[j + 1][0] for j in layer_ids], dim=-1)  # [L, F]
            worst = max(worst, float((features[offset:offset + len(ids)] - want).abs().max()))
            offset += len(ids)
    return worst


@pytest.mark.parametrize("key", list(ARCHITECTURES))
def test_row_captures_trains_exports_and_decodes_losslessly(key, tmp_path):
    arch = ARCHITECTURES[key]
    reason = missing_reason(arch)
    if reason:
        pytest.skip(f"{arch.name}: {reason} (docs/targets.md reports the row as untested here)")
    target = build_tiny_target_of(arch, str(tmp_path / "target"))
    data = str(tmp_path / "data")
    rows = (write_chats if arch.chat_data else write_token_rows)(tmp_path / "rows.jsonl")
    report = prepare_dataset(target, rows, data, max_length=128, progress=False)
    assert report.num_samples == NUM_CHATS and report.num_rejected == 0
    cfg = row_job(target, data, tmp_path / "run", target_layer_ids=list(arch.layer_ids))
    assert cfg.model.mask_token_id == 3 or not arch.chat_data  # the tiny tokenizer's <|mask|>
    dataset = TokenDataset(data)

    # target: the worker's produce into a real shared-memory slot pool
    capture = FeatureCapture(target, layer_ids=cfg.model.target_layer_ids, dtype="float32",
                             attn_implementation=cfg.target.attn_implementation, device="cpu")
    layout = SlotLayout(num_slots=1, max_tokens=cfg.data.token_budget, feature_dim=capture.feature_dim,
                        dtype="float32")
    sample_ids = list(range(len(dataset)))
    padded = int(dataset.lengths.max())
    pool = create_pool(layout, "cpu", name=f"{cfg.files.pool_name(0)}-{key}")
    readers = ReaderCache("cpu")
    try:
        produced = TargetWorker(capture, dataset, pool).produce(
            p.Batch(batch_id=0, epoch=0, slot=0, sample_ids=sample_ids, padded_len=padded))
        assert produced.num_tokens == int(dataset.lengths.sum())
        features = readers.get(pool.descriptor()).read(0, produced.num_tokens)
        # batched and padded against each sample alone: float32 rounding only
        assert captured_vs_hidden_states(target, dataset, features, cfg.model.target_layer_ids) < 1e-4

        # drafter: the worker's accept of the slot, then training steps on the captured features
        model_config = DFlashConfig.from_target_config(
            load_target_config(target), num_draft_layers=cfg.model.num_layers, block_size=cfg.model.block_size,
            mask_token_id=cfg.model.mask_token_id, target_layer_ids=cfg.model.target_layer_ids)
        head = FrozenTargetHead.from_pretrained(target, dtype=torch.float32, device="cpu")
        trainer = DrafterTrainer(cfg, model_config, head, device="cpu", total_steps=TRAIN_STEPS)
        queue = SequenceQueue(dataset, max_anchors_per_seq=cfg.objective.max_anchors_per_seq)
        losses = []
        for step in range(TRAIN_STEPS):  # the slot copied and split into sequences, as a drafter does
            queue.add_copy(step, 1, 0, sample_ids, readers.get(pool.descriptor()).read(0, produced.num_tokens))
            losses.append(trainer.step(queue.take(cfg.objective.anchors_per_step))["loss"])
            queue.fifo.clear()
            queue.anchors = 0
    finally:
        readers.close()
        pool.close()
    assert all(map(torch.isfinite, torch.tensor(losses))) and losses[-1] < losses[0], losses
    checkpoint = trainer.save_checkpoint(CheckpointStore(cfg.files.checkpoints), extra={})
    exported = export_training_checkpoint(checkpoint, str(tmp_path / "export"))
    with open(os.path.join(exported, "config.json")) as f:
        served = json.load(f)  # the drafter is sized from the text config, whatever the model's kind
    text = text_config(load_target_config(target))
    assert (served["hidden_size"], served["vocab_size"], served["num_target_layers"]) == (
        text.hidden_size, text.vocab_size, text.num_hidden_layers)
    if arch.key == "llama":  # its RoPE scaling goes into the drafter the servers build
        assert served["rope_scaling"]["rope_type"] == "llama3" and served["rope_scaling"]["factor"] == 8.0

    result = CliRunner().invoke(main, ["eval", "--target", target, "--drafter", exported, "--data", data,
                                       "--num-prompts", "2", "--max-new-tokens", "10", "--check-lossless", "--json"])
    assert result.exit_code == 0, result.output
    reports = json.loads(result.stdout)
    assert reports[0]["num_lossless_checked"] == 2 and reports[0]["lossless_mismatches"] == [], reports[0]
    assert reports[0]["num_generated_tokens"] >= 2


def test_a_wrong_layer_convention_is_caught(tmp_path):
    """The check above fails when features are one layer off (what a server reading
    `hidden_states[id]` instead of `[id + 1]` would see)."""
    arch = ARCHITECTURES["qwen3_moe"]
    target = build_tiny_target_of(arch, str(tmp_path / "target"))
    data = str(tmp_path / "data")
    prepare_dataset(target, write_chats(tmp_path / "chats.jsonl", num_chats=2), data, max_length=128, progress=False)
    dataset = TokenDataset(data)
    capture = FeatureCapture(target, layer_ids=[0, 1], dtype="float32", attn_implementation="sdpa", device="cpu")
    out = torch.empty(int(dataset.lengths.sum()), capture.feature_dim)
    worker = TargetWorker(capture, dataset, pool=None)
    ids, lengths = worker.batch_tokens([0, 1], int(dataset.lengths.max()))
    capture.forward_into(ids, lengths, out)
    assert captured_vs_hidden_states(target, dataset, out, [0, 1]) < 1e-4
    assert captured_vs_hidden_states(target, dataset, out, [1, 2]) > 1e-2  # one layer off


def _doc_rows() -> dict[str, str]:
    """First cell -> status cell of every row of the support table in docs/targets.md."""
    rows = {}
    for line in open(DOCS, encoding="utf-8"):
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) >= 3 and not set(cells[0]) <= {"-", " "}:
            rows[re.sub(r"\*", "", cells[0])] = cells[1]
    return rows


def test_docs_support_table_has_every_row():
    rows = _doc_rows()
    for arch in ARCHITECTURES.values():
        assert arch.name in rows, f"docs/targets.md lacks the row {arch.name!r}"
        assert rows[arch.name].startswith("tested"), (arch.name, rows[arch.name])
    for name in UNSUPPORTED:
        assert name in rows, f"docs/targets.md lacks the row {name!r}"
        assert rows[name].startswith("not supported"), (name, rows[name])
