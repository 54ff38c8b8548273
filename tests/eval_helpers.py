"""Shared by the tests/test_eval_*.py modules: tiny drafters, a reference greedy decoder, and one
memorising drafter trained once per test session (training is the slow part of these tests)."""

import collections
import functools
import os

import torch
from transformers import AutoConfig, AutoTokenizer

from dflash_ipc.config.load import config_from_dict
from dflash_ipc.data.dataset import TokenDataset
from dflash_ipc.builtin.synthetic import build_synthetic_dataset
from dflash_ipc.drafter.model import DFlashConfig, DFlashDraftModel
from dflash_ipc.hf.target_head import FrozenTargetHead
from dflash_ipc.drafter.trainer import DrafterTrainer, Sequence, eligible_anchor_count

LAYER_IDS = [1, 2]
BS = 16


def drafter_config(target_dir, *, block_size=BS, num_layers=2, layer_types=None, sliding_window=None) -> DFlashConfig:
    mask_id = AutoTokenizer.from_pretrained(target_dir).mask_token_id
    return DFlashConfig.from_target_config(AutoConfig.from_pretrained(target_dir), num_draft_layers=num_layers,
                                           block_size=block_size, mask_token_id=mask_id, target_layer_ids=LAYER_IDS,
                                           layer_types=layer_types, sliding_window=sliding_window)


def random_drafter(target_dir, seed=0, **kwargs) -> DFlashDraftModel:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return DFlashDraftModel(drafter_config(target_dir, **kwargs)).eval()


@torch.inference_mode()
def reference_greedy(target, prompt, max_new_tokens: int) -> list[int]:
    """Greedy decoding by full recomputation, no cache: independent of any cache logic.
    ``target``: anything with the HF ``model`` and ``stop_token_ids``."""
    ids = torch.as_tensor(prompt, dtype=torch.long).tolist()
    out = []
    while len(out) < max_new_tokens and not (out and out[-1] in target.stop_token_ids):
        logits = target.model(input_ids=torch.tensor([ids + out])).logits[0, -1]
        out.append(int(logits.argmax()))
    return out


def train_drafter(target_dir, target, data_dir, sample_ids, *, steps: int, lr: float = 3e-3,
                  max_anchors: int = 64) -> DFlashDraftModel:
    """A 1-layer, block-8 drafter trained with the real DrafterTrainer on the given samples;
    ``target`` a legacy TargetLM (its prefill gives the training features)."""
    cfg = config_from_dict({"drafter": {"dtype": "float32"},
                            "model": {"num_layers": 1, "target_layer_ids": LAYER_IDS, "block_size": 8},
                            "objective": {"max_anchors_per_seq": max_anchors, "anchors_per_step": 256},
                            "optimizer": {"lr": lr}, "schedule": {"warmup_ratio": 0.0}})
    head = FrozenTargetHead.from_pretrained(target_dir, dtype=torch.float32, device="cpu")
    trainer = DrafterTrainer(cfg, drafter_config(target_dir, block_size=8, num_layers=1), head, device="cpu",
                             total_steps=steps)
    ds, seqs = TokenDataset(data_dir), []
    for i in sample_ids:
        ids, mask = ds.sample(i)
        _, feats = target.prefill(torch.as_tensor(ids, dtype=torch.long))  # the training features
        seqs.append(dict(batch_id=0, sample_id=i, features=feats, input_ids=torch.as_tensor(ids, dtype=torch.long),
                         loss_mask=torch.as_tensor(mask), num_anchors=eligible_anchor_count(mask, max_anchors)))
    fifo, epoch = collections.deque(), 0  # every sample in turn, epoch after epoch
    for _ in range(steps):
        while sum(s.num_anchors for s in fifo) < cfg.objective.anchors_per_step:
            fifo.extend(Sequence(epoch=epoch, **s) for s in seqs)
            epoch += 1
        trainer.step(trainer.take(fifo))
    return trainer.model.eval()


@functools.lru_cache(maxsize=None)
def eval_data(tiny_cache: str) -> str:
    """8 synthetic samples of the tiny target (its own greedy replies), built once per session."""
    target_dir = os.path.join(tiny_cache, "tiny-target")
    return build_synthetic_dataset(target_dir, os.path.join(tiny_cache, "eval-data"), num_samples=8, min_len=24,
                                   max_len=64, seed=3)


@functools.lru_cache(maxsize=None)
def memorising_drafter(tiny_cache: str) -> DFlashDraftModel:
    """A drafter trained (50 steps) on the last 4 samples of :func:`eval_data`, whose prompts the
    tests then decode: real acceptances (tau ~2) without generalisation."""
    from dflash_ipc.eval.unbatched import TargetLM

    target_dir = os.path.join(tiny_cache, "tiny-target")
    data_dir = eval_data(tiny_cache)
    target = TargetLM(target_dir, layer_ids=LAYER_IDS, device="cpu", dtype="float32")
    n = len(TokenDataset(data_dir))
    return train_drafter(target_dir, target, data_dir, list(range(n - 4, n)), steps=50)
