"""The tiny tokenizer and tiny Qwen3 target built locally."""

import json
import os

import numpy as np
import pytest
import torch

from dflash_ipc.data.dataset import tokenizer_fingerprint
from dflash_ipc.data.tiny import (
    ENDOFTEXT,
    IM_END,
    IM_START,
    MASK,
    TINY_VOCAB_WORDS,
    UNK,
    build_tiny_target,
    build_tiny_tokenizer,
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


def greedy(model, prompts, steps, allowed):
    ids = torch.as_tensor(prompts)  # [B, P]
    for _ in range(steps):
        logits = model(input_ids=ids).logits[:, -1].masked_fill(~allowed, float("-inf"))  # [B, V]
        ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], dim=1)
    return ids[:, len(prompts[0]):]  # [B, steps]


def test_greedy_continuations_are_not_degenerate(target):
    """The drafter must have something to learn: continuations vary, do not collapse into
    one repeated token, and depend on more than the last few tokens."""
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(target).eval()
    tok = build_tiny_tokenizer()
    word_ids = tok.convert_tokens_to_ids(list(W))
    allowed = torch.zeros(1024, dtype=torch.bool)
    allowed[word_ids] = True
    rng = np.random.default_rng(0)
    prompts = rng.choice(word_ids, (6, 24))
    prompts[1, -8:] = prompts[0, -8:]  # same last 8 tokens, different earlier context
    with torch.inference_mode():
        out = greedy(model, prompts.tolist(), 40, allowed)  # [6, 40]
    for row in out.tolist():
        assert len(set(row)) >= 15, row
        assert len(set(row[-20:])) >= 8, row  # no short loop at the end either
    assert len({tuple(r) for r in out[:, :5].tolist()}) == 6
    assert out[0, :5].tolist() != out[1, :5].tolist()
