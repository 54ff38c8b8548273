"""The tiny tokenizer and tiny Qwen3 target built locally."""

import json
import os

import numpy as np
import pytest
import torch

from dflash_ipc.data.dataset import tokenizer_fingerprint
from dflash_ipc.builtin.tiny import (
    ENDOFTEXT,
    IM_END,
    IM_START,
    MASK,
    TINY_VOCAB_WORDS,
    UNK,
    build_tiny_target,
    build_tiny_tokenizer,
    tiny_target_key,
    tiny_vocab_size,
)
from dflash_ipc.errors import DataError

W = TINY_VOCAB_WORDS


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return build_tiny_target(str(tmp_path_factory.mktemp("t") / "tiny"))


def test_tokenizer_specials_and_sizes():
    tok = build_tiny_tokenizer()
    assert len(TINY_VOCAB_WORDS) == len(set(TINY_VOCAB_WORDS)) == 1000
    assert len(tok) == 1009
    assert tiny_vocab_size(tok) == 1024
    assert tok.mask_token == MASK and tok.eos_token == IM_END and tok.pad_token == ENDOFTEXT
    assert {ENDOFTEXT, IM_START, IM_END, MASK, UNK} <= set(tok.all_special_tokens)
    assert tok.convert_tokens_to_ids("nonsense") == tok.convert_tokens_to_ids(UNK)


def test_chat_template_is_chatml():
    tok = build_tiny_tokenizer()
    messages = [{"role": "system", "content": W[0]}, {"role": "user", "content": W[1]},
                {"role": "assistant", "content": f"{W[2]} {W[3]}"}]
    text = tok.apply_chat_template(messages, tokenize=False)
    assert text == (f"<|im_start|>system\n{W[0]}<|im_end|>\n<|im_start|>user\n{W[1]}<|im_end|>\n"
                    f"<|im_start|>assistant\n{W[2]} {W[3]}<|im_end|>\n")
    prompt = tok.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_end|>\n<|im_start|>assistant\n")
    marked = build_tiny_tokenizer(with_generation_markers=True)
    assert "{% generation %}" in marked.chat_template
    assert marked.apply_chat_template(messages, tokenize=False) == text


def test_newlines_are_tokens_and_decode_round_trips():
    tok = build_tiny_tokenizer()
    ids = tok(f"{W[5]} {W[6]}\n\n{W[7]}", add_special_tokens=False)["input_ids"]
    assert tok.convert_ids_to_tokens(ids) == [W[5], W[6], "\n", "\n", W[7]]
    rng = np.random.default_rng(0)
    seq = rng.integers(0, len(tok), 200).tolist()
    seq = [i for i in seq if i != tok.convert_tokens_to_ids(UNK)]
    assert tok(tok.decode(seq), add_special_tokens=False)["input_ids"] == seq


def test_target_config_and_files(target):
    from transformers import AutoConfig, AutoTokenizer

    cfg = AutoConfig.from_pretrained(target)
    assert cfg.model_type == "qwen3"
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size) == (4, 128, 256)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (4, 2, 32)
    assert cfg.vocab_size == 1024 and cfg.vocab_size % 64 == 0
    tok = AutoTokenizer.from_pretrained(target)
    assert tokenizer_fingerprint(tok) == tokenizer_fingerprint(build_tiny_tokenizer())
    assert tok.mask_token == MASK and cfg.eos_token_id == tok.convert_tokens_to_ids(IM_END)


def test_build_is_idempotent_and_refuses_other_builds(target):
    marker = os.path.join(target, "dflash_tiny.json")
    stamp = os.stat(marker).st_mtime_ns
    assert build_tiny_target(target) == target
    assert os.stat(marker).st_mtime_ns == stamp  # reused, not rebuilt
    with pytest.raises(DataError, match="holds a different build"):
        build_tiny_target(target, num_layers=2)
    assert not [n for n in os.listdir(os.path.dirname(target)) if ".tmp-" in n]


def test_same_seed_same_weights(tmp_path):
    from safetensors.torch import load_file

    a = build_tiny_target(str(tmp_path / "a"), num_layers=1, hidden_size=32, seed=3)
    b = build_tiny_target(str(tmp_path / "b"), num_layers=1, hidden_size=32, seed=3)
    c = build_tiny_target(str(tmp_path / "c"), num_layers=1, hidden_size=32, seed=4)
    wa, wb, wc = (load_file(os.path.join(d, "model.safetensors")) for d in (a, b, c))
    assert wa.keys() == wb.keys()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert not torch.equal(wa["model.embed_tokens.weight"], wc["model.embed_tokens.weight"])
    # overwrite rebuilds with the new parameters
    build_tiny_target(c, num_layers=2, hidden_size=32, seed=4, overwrite=True)
    assert json.load(open(os.path.join(c, "dflash_tiny.json")))["num_layers"] == 2


def greedy(model, prompts, steps):
    """Plain greedy decoding over the whole vocabulary, no KV cache."""
    ids = torch.as_tensor(prompts)  # [B, P]
    for _ in range(steps):
        ids = torch.cat([ids, model(input_ids=ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[:, len(prompts[0]):]  # [B, steps]


def period(row, tail=12):
    """Smallest p <= 4 with row[i] == row[i+p] over the last `tail` tokens, or 0."""
    t = row[-tail:]
    return next((p for p in range(1, 5) if all(t[i] == t[i + p] for i in range(len(t) - p))), 0)


def test_greedy_continuations_are_learnable_and_context_dependent(target):
    """What the embedded default's drafter learns: the target's own greedy replies. They
    depend on more than the last few tokens and differ between prompts, some settle into
    short cycles (which a drafter can predict a block at a time) and not all collapse;
    the padding rows of the vocabulary are never chosen."""
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(target).eval()
    tok = build_tiny_tokenizer()
    word_ids = tok.convert_tokens_to_ids(list(W))
    rng = np.random.default_rng(0)
    prompts = rng.choice(word_ids, (6, 24))
    prompts[1, -8:] = prompts[0, -8:]  # same last 8 tokens, different earlier context
    with torch.inference_mode():
        out = greedy(model, prompts.tolist(), 40)  # [6, 40]
    rows = out.tolist()
    assert len({tuple(r[:5]) for r in rows}) == 6
    assert rows[0][:5] != rows[1][:5]
    assert any(period(r) for r in rows), rows
    assert sum(len(set(r)) >= 10 for r in rows) >= 3, rows
    assert int(out.max()) < len(tok)


def test_padding_rows_of_the_head_are_zero(target):
    from safetensors.torch import load_file

    weights = load_file(os.path.join(target, "model.safetensors"))
    head = weights["lm_head.weight"]  # [1024, H]
    n = len(build_tiny_tokenizer())
    assert head.shape[0] == 1024 > n
    assert not head[n:].any() and head[:n].abs().sum(-1).min() > 0


def test_target_key_changes_with_every_build_parameter(monkeypatch):
    import dflash_ipc.builtin.tiny as tiny

    key = tiny_target_key()
    assert key == tiny_target_key(num_layers=4, hidden_size=128, seed=0)
    others = {tiny_target_key(num_layers=2), tiny_target_key(hidden_size=64), tiny_target_key(seed=1)}
    monkeypatch.setattr(tiny, "TINY_INITIALIZER_RANGE", 0.15)
    others.add(tiny_target_key())
    monkeypatch.setattr(tiny, "TINY_INITIALIZER_RANGE", 0.02)
    monkeypatch.setattr(tiny, "_TINY_FORMAT", 1)
    others.add(tiny_target_key())
    assert len(others) == 5 and key not in others
