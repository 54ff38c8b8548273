"""The synthetic default dataset: the tiny target's own greedy continuations, prepared."""

import json
import os
import shutil

import numpy as np
import pytest
import torch

from dflash_ipc.data.dataset import TokenDataset
from dflash_ipc.data.held_out import held_out_prompts_of
from dflash_ipc.builtin.synthetic import (
    _response,
    build_synthetic_dataset,
    synthetic_cache_key,
    synthetic_params,
)
from dflash_ipc.builtin.tiny import IM_END, build_tiny_target, build_tiny_tokenizer
from dflash_ipc.errors import ConfigError, DataError

PARAMS = dict(num_samples=24, min_len=24, max_len=160, seed=1, num_held_out=4)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("syn")
    target = build_tiny_target(str(root / "tiny"))
    out = build_synthetic_dataset(target, str(root / "data"), **PARAMS)
    return target, out


def test_lengths_spread_and_format(built):
    target, out = built
    ds = TokenDataset(out)
    assert len(ds) == 24
    assert ds.lengths.min() >= 24 and ds.lengths.max() <= 160
    assert len(set(ds.lengths.tolist())) >= 12  # spread, not quantised to a few values
    assert (ds.lengths < 60).any() and (ds.lengths > 100).any()  # short and long buckets
    ds.check_tokenizer(target)
    assert ds.meta["extra"]["synthetic"]["num_samples"] == 24
    with open(out + ".jsonl") as f:
        rows = [json.loads(line) for line in f]
    assert len(rows) == 24
    assert [m["role"] for m in rows[0]["messages"]] == ["user", "assistant"]


def test_responses_are_the_targets_greedy_continuation(built):
    """Recompute plain greedy decoding (whole vocabulary, no KV cache, no restriction) and
    compare; the mask covers exactly the response and its <|im_end|>."""
    from transformers import AutoModelForCausalLM

    target, out = built
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(target).eval()
    tok = build_tiny_tokenizer()
    ds = TokenDataset(out)
    im_end = tok.convert_tokens_to_ids(IM_END)
    order = np.argsort(ds.lengths)
    for i in order[[0, 8, 16, 23]]:  # short to longest
        ids, mask = ds.sample(int(i))
        start = int(np.argmax(mask))  # first response token
        assert ids[-2] == im_end and mask[start:-1].all() and not mask[:start].any() and not mask[-1]
        seq = torch.as_tensor(ids[:start], dtype=torch.long)[None]  # [1, P]
        with torch.inference_mode():
            for _ in range(len(ids) - 2 - start):
                seq = torch.cat([seq, model(input_ids=seq).logits[0, -1].argmax().view(1, 1)], dim=1)
        np.testing.assert_array_equal(seq[0, start:].numpy(), ids[start:-2])


def test_reply_ends_at_a_stop_or_before_a_non_text_token():
    text = np.zeros(16, dtype=bool)
    text[5:12] = True  # ids 5..11 are text; 2 is a stop token (not text); 12..15 are padding rows
    gen = np.array([5, 6, 7, 8, 9, 10])
    np.testing.assert_array_equal(_response(gen, 4, text), [5, 6, 7, 8])  # the budget
    np.testing.assert_array_equal(_response(np.array([5, 6, 2, 7]), 4, text), [5, 6])  # stopped
    np.testing.assert_array_equal(_response(np.array([5, 13, 7]), 3, text), [5])  # padding row
    np.testing.assert_array_equal(_response(np.array([5, 6, -1, -1]), 4, text), [5, 6])  # stopped early
    assert _response(np.array([2, 5]), 2, text).size == 0


def test_held_out_prompts_are_drawn_alike_and_never_trained_on(built):
    target, out = built
    ds = TokenDataset(out)
    held = held_out_prompts_of(ds.meta)
    assert [i for i, _ in held] == list(range(24, 28))
    train_prompts = set()
    for i in range(len(ds)):
        ids, mask = ds.sample(i)
        train_prompts.add(tuple(ids[: int(np.argmax(mask))].tolist()))
    tok = build_tiny_tokenizer()
    header = tok("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    first = next(iter(train_prompts))
    for _, prompt in held:
        assert tuple(prompt.tolist()) not in train_prompts
        assert prompt[:3].tolist() == list(first[:3]) and prompt[-len(header):].tolist() == header
    # the evaluation takes exactly these by default
    from dflash_ipc.eval.speculative import held_out_prompts
    got = held_out_prompts(ds, num_prompts=3)
    assert [i for i, _ in got] == [24, 25, 26]
    assert all(np.array_equal(a, b) for (_, a), (_, b) in zip(got, held))


def test_cache_key_covers_every_input(built, tmp_path):
    target, out = built
    base = synthetic_params(target, **PARAMS)
    assert TokenDataset(out).meta["extra"]["synthetic"] == base
    assert synthetic_cache_key(base) == synthetic_cache_key(synthetic_params(target, **PARAMS))
    changes = [{"num_samples": 25}, {"min_len": 25}, {"max_len": 161}, {"seed": 2}, {"num_words": 48},
               {"num_held_out": 3}]
    keys = {synthetic_cache_key(synthetic_params(target, **(PARAMS | c))) for c in changes}
    # the target's bytes: same files with one weight changed
    other = tmp_path / "tiny-changed"
    shutil.copytree(target, other)
    from safetensors.torch import load_file, save_file
    weights = load_file(str(other / "model.safetensors"))
    weights["model.norm.weight"][0] += 1
    save_file(weights, str(other / "model.safetensors"), metadata={"format": "pt"})
    keys.add(synthetic_cache_key(synthetic_params(str(other), **PARAMS)))
    assert len(keys) == len(changes) + 1 and synthetic_cache_key(base) not in keys
    with pytest.raises(DataError, match="holds a different dataset"):
        build_synthetic_dataset(str(other), out, **PARAMS)


def test_prompts_answered_with_nothing_are_drawn_again(built, tmp_path, monkeypatch):
    import dflash_ipc.builtin.synthetic as synthetic

    target, _ = built
    real, calls = synthetic._replies, []

    def first_replies_empty(backend, prompts, max_new_tokens, path):
        replies = real(backend, prompts, max_new_tokens, path)
        calls.append(len(prompts))
        if len(calls) == 1:
            replies[:2] = [None, None]  # the first two prompts: regenerate's empty_reply rejects
        return replies

    monkeypatch.setattr(synthetic, "_replies", first_replies_empty)
    out = build_synthetic_dataset(target, str(tmp_path / "d"), num_samples=6, min_len=24, max_len=64, seed=5)
    assert calls == [6, 2]  # one batch, then the two redrawn prompts
    ds = TokenDataset(out)
    assert len(ds) == 6 and all(ds.sample(i)[1].sum() >= 2 for i in range(6))
    assert not [n for n in os.listdir(tmp_path) if "regen" in n]  # the regenerate files are cleaned up


def test_idempotent_and_refuses_other_parameters(built):
    target, out = built
    stamp = TokenDataset(out).meta["created_at"], os.stat(os.path.join(out, "meta.json")).st_mtime_ns
    assert build_synthetic_dataset(target, out, **PARAMS) == out
    assert (TokenDataset(out).meta["created_at"], os.stat(os.path.join(out, "meta.json")).st_mtime_ns) == stamp
    with pytest.raises(DataError, match="holds a different dataset"):
        build_synthetic_dataset(target, out, **(PARAMS | {"num_samples": 25}))


def test_bad_parameters(built):
    target, out = built
    with pytest.raises(ConfigError, match="min_len"):
        build_synthetic_dataset(target, out + "-x", num_samples=4, min_len=5, max_len=64)
    with pytest.raises(ConfigError, match="max_len"):
        build_synthetic_dataset(target, out + "-x", num_samples=4, min_len=64, max_len=32)
