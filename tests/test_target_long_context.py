"""Long sequences: a 32,768-token conversation through prepare, buckets, slots and the
drafter's attention, the 8-GPU config at 8,192 tokens, and the start-up memory checks."""

import json
import logging
import os

import numpy as np
import pytest
import torch

from dflash_ipc.config.device_memory import GIB, USABLE
from dflash_ipc.drafter import fit as drafter_fit
from dflash_ipc.target import fit as target_fit
from dflash_ipc.config.load import config_from_dict, load_config
from dflash_ipc.data.dataset import TokenDataset
from dflash_ipc.data.prepare import prepare_dataset
from dflash_ipc.builtin.tiny import TINY_VOCAB_WORDS
from dflash_ipc.dispatch.proc import plan_job
from dflash_ipc.drafter.model import DFlashConfig
from dflash_ipc.hf.target_head import FrozenTargetHead
from dflash_ipc.drafter.trainer import DrafterTrainer, Sequence, eligible_anchor_count
from dflash_ipc.errors import ConfigError
from dflash_ipc.hf.target_config import load_target_config
from dflash_ipc.target.capture import FeatureCapture
from dflash_ipc.transport.slots import SlotLayout

torch.set_num_threads(1)

LONG = 32768
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def long_data(tiny_cache, tmp_path_factory):
    """One conversation of ~32K tokens (its reply cut at the limit) among short ones."""
    target = os.path.join(tiny_cache, "tiny-target")
    out = tmp_path_factory.mktemp("long")
    words = [TINY_VOCAB_WORDS[i % len(TINY_VOCAB_WORDS)] for i in range(LONG + 500)]
    with open(out / "chats.jsonl", "w") as f:
        f.write(json.dumps({"messages": [{"role": "user", "content": "baba"},
                                         {"role": "assistant", "content": " ".join(words)}]}) + "\n")
        for n in (20, 40, 60):
            f.write(json.dumps({"messages": [{"role": "user", "content": " ".join(words[:5])},
                                             {"role": "assistant", "content": " ".join(words[:n])}]}) + "\n")
    report = prepare_dataset(target, str(out / "chats.jsonl"), str(out / "data"), max_length=LONG, progress=False)
    assert report.num_samples == 4 and report.num_truncated == 1
    return target, str(out / "data")


def long_job(target_dir, data, **sections):
    base = {"data": {"path": data, "bucket_boundaries": [128, LONG], "token_budget": LONG},
            "target": {"path": target_dir, "dtype": "float32"},
            "drafter": {"num_workers": 1, "dtype": "float32"},
            "model": {"num_layers": 1, "target_layer_ids": [1, 2], "mask_token_id": 3},
            "objective": {"max_anchors_per_seq": 32, "anchors_per_step": 32}}
    for name, values in sections.items():
        base[name] = {**base.get(name, {}), **values}
    return config_from_dict(base)


def test_a_32k_sequence_is_planned_alone_and_fits_a_slot(long_data):
    target, data = long_data
    dataset = TokenDataset(data)
    assert int(dataset.lengths.max()) == LONG
    cfg = long_job(target, data)
    [batches] = plan_job(cfg, dataset.lengths)
    long_id = int(np.argmax(dataset.lengths))
    [alone] = [b for b in batches if long_id in b.sample_ids]
    assert list(alone.sample_ids) == [long_id] and alone.padded_len == LONG  # one long sequence per batch
    assert len(batches) == 2  # the three short ones share one batch
    layout = SlotLayout(num_slots=2, max_tokens=SlotLayout.required_max_tokens(cfg.data.token_budget),
                        feature_dim=256, dtype="bfloat16")
    assert layout.max_tokens >= LONG and layout.pool_bytes == 2 * LONG * 256 * 2
    assert target_fit.heaviest_target_batch(cfg.data) == (1, LONG)
    assert target_fit.heaviest_target_batch(cfg.data, longest=1001) == (32, 1008)  # the data's longest, padded


def test_the_drafter_step_attends_over_32k_context_keys(long_data):
    target, data = long_data
    dataset = TokenDataset(data)
    cfg = long_job(target, data)
    model_config = DFlashConfig.from_target_config(load_target_config(target), num_draft_layers=1, block_size=16,
                                                   mask_token_id=3, target_layer_ids=[1, 2])
    trainer = DrafterTrainer(cfg, model_config, FrozenTargetHead.from_pretrained(target, dtype=torch.float32,
                                                                                 device="cpu"),
                             device="cpu", total_steps=2)
    ids, mask = dataset.sample(int(np.argmax(dataset.lengths)))
    seq = Sequence(batch_id=0, epoch=0, sample_id=0, input_ids=torch.from_numpy(ids.astype("int64")),
                   features=torch.randn(len(ids), model_config.num_context_features * model_config.hidden_size),
                   loss_mask=torch.from_numpy(mask), num_anchors=eligible_anchor_count(mask, 32))
    batch, _, masks, _ = trainer._build([(seq, 32)])
    dense = masks["full_attention"]  # one mask per layer type; this drafter has full layers only
    anchors = batch.layout.query_anchor[::16].long()
    assert int(anchors.max()) > LONG - 2048  # anchors spread over the whole reply
    visible_ctx = dense[::16, :LONG].sum(1)  # [blocks] context keys each block sees
    assert torch.equal(visible_ctx, anchors)  # every key before its anchor: up to ~32K of them
    stats = trainer.step([(seq, 32)])
    assert np.isfinite(stats["loss"]) and stats["anchors"] == 32 and stats["tokens"] == LONG


def test_the_8gpu_config_reaches_8192_tokens_by_default():
    cfg = load_config(os.path.join(REPO, "configs", "8xh200-qwen3-8b.yaml"))
    assert cfg.data.max_length == 8192 and cfg.data.token_budget >= 4 * 8192
    # The drafter queue's worst case at that length (Qwen3-8B features: 5 x 4096, bf16) stays
    # well inside an H200 beside the measured ~46 GiB step.
    worst = drafter_fit.drafter_queue_bytes(np.full(10_000, 8192), cfg, 5 * 4096 * 2).worst
    assert worst < 40 * GIB


def test_queue_bytes_typical_and_worst():
    cfg = config_from_dict({"drafter": {"fifo_sequences": 3, "prefetch": 2}, "data": {"token_budget": 100,
                                                                                    "bucket_boundaries": [64]}})
    q = drafter_fit.drafter_queue_bytes(np.array([10, 20, 30, 40, 50]), cfg, feature_bytes=2)
    assert q.typical == (3 * 30 + 200) * 2 and q.worst == (50 + 40 + 30 + 200) * 2


def test_the_heaviest_step_takes_the_longest_samples_first(long_data):
    target, data = long_data
    dataset = TokenDataset(data)
    cfg = long_job(target, data, objective={"max_anchors_per_seq": 16, "anchors_per_step": 24})
    chosen = drafter_fit.heaviest_step_samples(dataset, cfg)
    order = np.argsort(-dataset.lengths, kind="stable")
    assert [i for i, _ in chosen] == [int(order[0]), int(order[1])] and [a for _, a in chosen] == [16, 8]


class _FakeCuda:
    """Just enough of torch.cuda for the checks' arithmetic on a CPU machine."""

    def __init__(self, monkeypatch, *, free, reserved=0, allocated=0, peak=0):
        for name, value in (("mem_get_info", lambda d: (free, 2 * free)), ("memory_reserved", lambda d: reserved),
                            ("memory_allocated", lambda d: allocated), ("max_memory_allocated", lambda d: peak),
                            ("reset_peak_memory_stats", lambda d: None), ("synchronize", lambda d: None)):
            monkeypatch.setattr(torch.cuda, name, value)


def test_a_pool_that_cannot_fit_beside_the_model_is_a_config_error(monkeypatch):
    layout = SlotLayout(num_slots=4, max_tokens=LONG, feature_dim=5 * 4096, dtype="bfloat16")  # 5 GiB
    _FakeCuda(monkeypatch, free=4 * GIB, reserved=16 * GIB, allocated=16 * GIB)
    with pytest.raises(ConfigError, match=r"slot pool needs 5.0 GiB \(target.num_slots=4 x data.token_budget=32768"):
        target_fit.check_pool_fits(layout, "cuda:0")
    _FakeCuda(monkeypatch, free=8 * GIB, reserved=16 * GIB, allocated=16 * GIB)
    target_fit.check_pool_fits(layout, "cuda:0")
    target_fit.check_pool_fits(layout, "cpu")  # nothing to ask on CPU


def test_a_batch_that_runs_out_of_memory_is_a_config_error(monkeypatch, tiny_cache, long_data):
    target, data = long_data
    cfg = long_job(target, data)
    capture = FeatureCapture(target, layer_ids=[1], dtype="float32", attn_implementation="sdpa", device="cpu")

    def out_of_memory(*args):
        raise torch.OutOfMemoryError("CUDA out of memory")
    monkeypatch.setattr(capture, "forward_into", out_of_memory)
    _FakeCuda(monkeypatch, free=GIB)
    pool = type("Pool", (), {"write_view": lambda self, slot, n: None})()
    with pytest.raises(ConfigError, match=r"a batch of 1 x 32768 tokens .* runs out of memory .*sdpa attention"):
        target_fit.probe_target_batch(capture, pool, cfg.data, "cuda:0", longest=LONG)


def test_a_drafter_whose_queue_cannot_fit_is_a_config_error(monkeypatch, long_data, caplog):
    target, data = long_data
    dataset = TokenDataset(data)
    cfg = long_job(target, data, drafter={"fifo_sequences": 2})
    model_config = DFlashConfig.from_target_config(load_target_config(target), num_draft_layers=1,
                                                   mask_token_id=3, target_layer_ids=[1, 2])
    trainer = DrafterTrainer(cfg, model_config, FrozenTargetHead.from_pretrained(target, dtype=torch.float32,
                                                                                 device="cpu"),
                             device="cpu", total_steps=2)
    feature_bytes = 2 * 128 * 2  # two captured layers of 128, bf16
    queue = drafter_fit.drafter_queue_bytes(dataset.lengths, cfg, feature_bytes)
    adam = 2 * 4 * sum(p.numel() for p in trainer.model.parameters())
    _FakeCuda(monkeypatch, free=int((adam + queue.typical) / USABLE) - 1)
    with pytest.raises(ConfigError, match=r"drafter on cpu: needs .* AdamW state .*drafter.fifo_sequences=2.*"
                       r"drafter.lm_head_chunk_gib \(\d+ rows per LM-head chunk now\)"):
        drafter_fit._check_drafter_total(trainer, dataset, cfg, "the step", feature_bytes)
    _FakeCuda(monkeypatch, free=int((adam + queue.typical) / USABLE) + 1)
    drafter_fit._check_drafter_total(trainer, dataset, cfg, "the step", feature_bytes)
    assert "a queue of the data's 2 longest sequences would hold" in caplog.text  # the worst case warned


@pytest.mark.gpu
@CUDA
def test_gpu_probes_pass_at_32k_and_refuse_what_cannot_fit(long_data, caplog):
    """The tiny target's 32K batch fits an H200 (sdpa); eager attention over 131,072 tokens
    (scores 4 heads x 131,072^2 x 4 bytes = 256 GiB) cannot: a ConfigError, not a crash."""
    from architectures import ARCHITECTURES, build_tiny_target_of
    from dflash_ipc.transport.backends import create_pool
    caplog.set_level(logging.INFO)
    target, data = long_data
    cfg = long_job(target, data)
    capture = FeatureCapture(target, layer_ids=[1, 2], dtype="bfloat16", attn_implementation="sdpa", device="cuda:0")
    layout = SlotLayout(num_slots=1, max_tokens=LONG, feature_dim=capture.feature_dim, dtype="bfloat16")
    target_fit.check_pool_fits(layout, "cuda:0")
    with create_pool(layout, "cuda:0", name="dflash-test-long-t0") as pool:
        target_fit.probe_target_batch(capture, pool, cfg.data, "cuda:0")
    assert "heaviest batch 1 x 32768 tokens fits" in caplog.text
    eager = build_tiny_target_of(ARCHITECTURES["gpt_oss"], os.path.join(os.path.dirname(data), "gpt-oss"))
    huge = config_from_dict({"data": {"bucket_boundaries": [131072], "token_budget": 131072}})
    capture = FeatureCapture(eager, layer_ids=[1], dtype="bfloat16", attn_implementation="eager", device="cuda:0")
    layout = SlotLayout(num_slots=1, max_tokens=131072, feature_dim=capture.feature_dim, dtype="bfloat16")
    with create_pool(layout, "cuda:0", name="dflash-test-long-t1") as pool:
        with pytest.raises(ConfigError, match="runs out of memory.*eager attention"):
            target_fit.probe_target_batch(capture, pool, huge.data, "cuda:0")


def test_the_probe_step_runs_the_trainers_forward_and_backward_and_changes_nothing(long_data):
    target, data = long_data
    dataset = TokenDataset(data)
    cfg = long_job(target, data)
    model_config = DFlashConfig.from_target_config(load_target_config(target), num_draft_layers=1,
                                                   mask_token_id=3, target_layer_ids=[1, 2])
    trainer = DrafterTrainer(cfg, model_config, FrozenTargetHead.from_pretrained(target, dtype=torch.float32,
                                                                                 device="cpu"),
                             device="cpu", total_steps=2)
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    chosen, what = drafter_fit.heaviest_step(trainer, dataset, cfg, torch.float32)
    assert what == "1 sequences of 32768..32768 tokens, 32 anchors"
    grads = []
    trainer.model.fc.weight.register_hook(lambda g: grads.append(g.abs().sum()))
    drafter_fit.forward_backward(trainer, chosen)
    assert grads and grads[0] > 0  # the backward reached the first layer
    assert all(p.grad is None for p in trainer.model.parameters())
    assert all(torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())
    assert trainer.step_count == 0


@pytest.mark.gpu
@CUDA
def test_gpu_drafter_probe_at_32k(long_data, caplog):
    caplog.set_level(logging.INFO)
    target, data = long_data
    dataset = TokenDataset(data)
    cfg = long_job(target, data, target={"devices": ["cuda:0"]}, drafter={"dtype": "bfloat16", "devices": ["cuda:0"]})
    model_config = DFlashConfig.from_target_config(load_target_config(target), num_draft_layers=1,
                                                   mask_token_id=3, target_layer_ids=[1, 2])
    trainer = DrafterTrainer(cfg, model_config, FrozenTargetHead.from_pretrained(target, dtype=torch.bfloat16,
                                                                                 device="cuda:0"),
                             device="cuda:0", total_steps=2)
    drafter_fit.probe_drafter_step(trainer, dataset, cfg, torch.bfloat16)
    assert "drafter on cuda:0: fits" in caplog.text and "1 sequences of 32768..32768 tokens" in caplog.text
    assert all(p.grad is None for p in trainer.model.parameters())
