"""The synthetic default dataset: the tiny target's own greedy continuations, prepared."""

import json
import os

import numpy as np
import pytest
import torch

from dflash_ipc.data.dataset import TokenDataset
from dflash_ipc.data.synthetic import build_synthetic_dataset
from dflash_ipc.data.tiny import IM_END, TINY_VOCAB_WORDS, build_tiny_target, build_tiny_tokenizer
from dflash_ipc.errors import ConfigError, DataError

PARAMS = dict(num_samples=24, min_len=24, max_len=160, seed=1)


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
    """Recompute greedily without a KV cache and compare; the mask covers exactly the
    response and its <|im_end|>."""
    from transformers import AutoModelForCausalLM

    target, out = built
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(target).eval()
    tok = build_tiny_tokenizer()
    allowed = torch.zeros(model.config.vocab_size, dtype=torch.bool)
    allowed[tok.convert_tokens_to_ids(list(TINY_VOCAB_WORDS))] = True
    ds = TokenDataset(out)
    im_end = tok.convert_tokens_to_ids(IM_END)
    for i in np.argsort(ds.lengths)[[0, 12]]:  # a short and a mid-length sample
        ids, mask = ds.sample(int(i))
        start = int(np.argmax(mask))  # first response token
        assert ids[-2] == im_end and mask[start:-1].all() and not mask[:start].any() and not mask[-1]
        seq = torch.as_tensor(ids[:start], dtype=torch.long)[None]  # [1, P]
        with torch.inference_mode():
            for _ in range(len(ids) - 2 - start):
                logits = model(input_ids=seq).logits[0, -1].masked_fill(~allowed, float("-inf"))
                seq = torch.cat([seq, logits.argmax().view(1, 1)], dim=1)
        np.testing.assert_array_equal(seq[0, start:].numpy(), ids[start:-2])


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
