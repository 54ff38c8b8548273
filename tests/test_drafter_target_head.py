"""FrozenTargetHead reads only embed/lm_head from real HF checkpoints (single, sharded, tied)."""

import json
import os

import pytest
import torch
from safetensors import safe_open
from transformers import Qwen3Config, Qwen3ForCausalLM

from dflash_ipc.hf.target_head import FrozenTargetHead
from dflash_ipc.errors import DataError

torch.set_num_threads(1)


def tiny_qwen3(path, *, tied: bool, max_shard_size=None) -> Qwen3ForCausalLM:
    torch.manual_seed(0)
    cfg = Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, vocab_size=512, tie_word_embeddings=tied)
    model = Qwen3ForCausalLM(cfg)
    with torch.no_grad():  # make sure embed and head differ when untied, whatever the init does
        model.model.embed_tokens.weight.normal_()
        if not tied:
            model.lm_head.weight.normal_()
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(path, **kwargs)
    return model


def test_single_file_untied(tmp_path):
    model = tiny_qwen3(tmp_path, tied=False)
    assert (tmp_path / "model.safetensors").exists()
    head = FrozenTargetHead.from_pretrained(str(tmp_path), dtype=torch.float32, device="cpu")
    assert not head.tied and (head.vocab_size, head.hidden_size) == (512, 64)
    torch.testing.assert_close(head.embed_weight, model.model.embed_tokens.weight, rtol=0, atol=0)
    torch.testing.assert_close(head.lm_head_weight, model.lm_head.weight, rtol=0, atol=0)
    ids = torch.tensor([0, 7, 511])
    torch.testing.assert_close(head.embed(ids), model.model.embed_tokens(ids))
    h = torch.randn(3, 64)
    torch.testing.assert_close(head.logits(h), model.lm_head(h))


def test_sharded_checkpoint(tmp_path):
    model = tiny_qwen3(tmp_path, tied=False, max_shard_size="100KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1 and not (tmp_path / "model.safetensors").exists()
    head = FrozenTargetHead.from_pretrained(str(tmp_path), dtype=torch.bfloat16, device="cpu")
    assert head.embed_weight.dtype == torch.bfloat16
    torch.testing.assert_close(head.lm_head_weight, model.lm_head.weight.to(torch.bfloat16), rtol=0, atol=0)
    torch.testing.assert_close(head.embed_weight, model.model.embed_tokens.weight.to(torch.bfloat16), rtol=0, atol=0)


def test_tied_embeddings(tmp_path):
    model = tiny_qwen3(tmp_path, tied=True)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        assert "lm_head.weight" not in f.keys()  # HF drops the tied copy
    head = FrozenTargetHead.from_pretrained(str(tmp_path), dtype=torch.float32, device="cpu")
    assert head.tied and head.lm_head_weight is head.embed_weight
    torch.testing.assert_close(head.lm_head_weight, model.lm_head.weight, rtol=0, atol=0)
    moved = head.to(torch.float16)
    assert moved.lm_head_weight is moved.embed_weight and moved.embed_weight.dtype == torch.float16


def test_frozen_and_not_saved():
    head = FrozenTargetHead(torch.randn(10, 4), torch.randn(10, 4))
    assert head.state_dict() == {}
    assert not any(b.requires_grad for b in head.buffers())
    h = torch.randn(2, 4, requires_grad=True)
    head.logits(h).sum().backward()
    assert h.grad is not None and head.lm_head_weight.grad is None
    assert not head.embed(torch.tensor([1, 2])).requires_grad


def test_missing_files_and_tensors(tmp_path):
    with pytest.raises(DataError, match="neither model.safetensors.index.json nor model.safetensors"):
        FrozenTargetHead.from_pretrained(str(tmp_path), dtype=torch.float32, device="cpu")
    tiny_qwen3(tmp_path, tied=True)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["tie_word_embeddings"] = False  # claims an lm_head the file does not have
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DataError, match="lm_head.weight"):
        FrozenTargetHead.from_pretrained(str(tmp_path), dtype=torch.float32, device="cpu")


def test_missing_shard_is_named(tmp_path):
    tiny_qwen3(tmp_path, tied=False, max_shard_size="100KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shard = index["weight_map"]["lm_head.weight"]
    os.remove(tmp_path / shard)
    with pytest.raises(DataError, match=shard):
        FrozenTargetHead.from_pretrained(str(tmp_path), dtype=torch.float32, device="cpu")
