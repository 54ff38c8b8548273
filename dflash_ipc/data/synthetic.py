"""The embedded default's dataset: random-word prompts answered by the target's own
greedy continuations, written as OpenAI `messages` JSONL and passed through the real
`prepare_dataset`.

Why the target's own continuations: a drafter learns to predict what the target would
generate; on text the target did not write there is little to learn, and for a randomly
initialised tiny target, text from anywhere else is noise to it.

Lengths: each sample's total token count (chat template included) is drawn log-uniformly
in [min_len, max_len], so short and long buckets are both populated. Samples are sorted
by length and generated in batches that share one prompt length; each sample keeps its
own number of response tokens (a prefix of a greedy continuation is still greedy), so the
lengths are spread, not quantised to batches. After prepare, every sample's length and
tokens are checked against what was generated (the tokenizer must round-trip).

Usage:
    build_synthetic_dataset(build_tiny_target("runs/cache/tiny"), "runs/cache/tiny-data",
                            num_samples=400, min_len=32, max_len=512)
"""

from __future__ import annotations

import inspect
import json
import logging
import math
import os

import numpy as np

from dflash_ipc.data.dataset import TokenDataset, dataset_is_complete
from dflash_ipc.data.prepare import prepare_dataset
from dflash_ipc.data.tiny import TINY_VOCAB_WORDS
from dflash_ipc.errors import ConfigError, DataError

log = logging.getLogger(__name__)

_SYNTHETIC_FORMAT = 1
GEN_BATCH_SIZE = 64
_PROMPT_FRACTION = (0.2, 0.6)  # share of a sample's content tokens that is prompt


def _template_overhead(tokenizer) -> int:
    """Tokens the chat template adds around one user and one assistant message."""
    w = TINY_VOCAB_WORDS[0]
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": w}, {"role": "assistant", "content": w}], tokenize=False
    )
    return len(tokenizer(text, add_special_tokens=False)["input_ids"]) - 2


def _word_ids(tokenizer) -> np.ndarray:
    ids = tokenizer.convert_tokens_to_ids(list(TINY_VOCAB_WORDS))
    unk = tokenizer.unk_token_id
    if unk is not None and unk in ids:
        raise DataError(f"{tokenizer.name_or_path}: the target's tokenizer is not the tiny tokenizer "
                        "(TINY_VOCAB_WORDS are unknown to it); synthetic data needs the tiny target")
    return np.asarray(ids, dtype=np.int64)


def _plan(num_samples: int, min_len: int, max_len: int, overhead: int, seed: int,
          num_words: int) -> list[dict]:
    """Per sample: total length, prompt words and response length; grouped into batches."""
    rng = np.random.default_rng(seed)
    totals = np.exp(rng.uniform(math.log(min_len), math.log(max_len + 1), num_samples))
    totals = np.clip(totals.astype(np.int64), min_len, max_len)  # [N]
    order = np.argsort(totals, kind="stable")
    batches = []
    for b in range(0, num_samples, GEN_BATCH_SIZE):
        members = order[b : b + GEN_BATCH_SIZE]
        content = totals[members] - overhead  # [b] prompt + response tokens
        frac = rng.uniform(*_PROMPT_FRACTION)
        prompt_len = max(1, int(frac * int(content.min())))
        words = rng.integers(0, num_words, (len(members), prompt_len))  # [b, P]
        batches.append({"members": members, "prompt_len": prompt_len,
                        "response_lens": content - prompt_len, "prompt_words": words})
    return batches


def _greedy(model, prompt_ids, num_new: int, allowed, device: str):
    """Greedy continuation of equal-length prompts [B, P] -> [B, num_new], restricted to
    allowed ids (content words: no special tokens, no padding rows of the vocabulary)."""
    import torch
    from transformers import DynamicCache

    # transformers 5.x renamed the cache argument; pass a cache we own so the output
    # field's name does not matter either.
    cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    cache = DynamicCache()
    ids = torch.as_tensor(prompt_ids, device=device)  # [B, P]
    banned = ~torch.as_tensor(allowed, device=device)  # [V]
    out_tokens = []
    logits = model(input_ids=ids, use_cache=True, **{cache_kw: cache}).logits[:, -1]  # [B, V]
    for step in range(num_new):
        nxt = logits.float().masked_fill(banned, float("-inf")).argmax(-1)  # [B]
        out_tokens.append(nxt)
        if step + 1 < num_new:
            logits = model(input_ids=nxt[:, None], use_cache=True, **{cache_kw: cache}).logits[:, -1]
    return torch.stack(out_tokens, dim=1).cpu().numpy()  # [B, num_new]


def _generate_rows(target_dir: str, tokenizer, batches: list[dict], num_samples: int, device: str,
                   num_words: int):
    """Run the target greedily; return the JSONL rows and the expected token ids, in sample order."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target_dir).to(device).eval()
    word_ids = _word_ids(tokenizer)[:num_words]
    allowed = np.zeros(model.config.vocab_size, dtype=bool)
    allowed[word_ids] = True
    rows: list = [None] * num_samples
    expected: list = [None] * num_samples
    # Measured on a loaded 2-core box: a decode step of the tiny target took 140 ms with
    # 2 intra-op threads and ~10 ms with 1 (its matmuls are too small to split; the
    # threads only contend). Restored afterwards.
    prev_threads = torch.get_num_threads()
    if str(device).startswith("cpu"):
        torch.set_num_threads(1)
    try:
        _generate_batches(model, tokenizer, batches, allowed, device, rows, expected)
    finally:
        torch.set_num_threads(prev_threads)
    return rows, expected


def _generate_batches(model, tokenizer, batches, allowed, device, rows, expected) -> None:
    import torch

    with torch.inference_mode():
        for batch in batches:
            prompts = [" ".join(TINY_VOCAB_WORDS[w] for w in words) for words in batch["prompt_words"]]
            rendered = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                                      add_generation_prompt=True) for p in prompts]
            prompt_ids = np.asarray([tokenizer(r, add_special_tokens=False)["input_ids"] for r in rendered])  # [B, P]
            gen = _greedy(model, prompt_ids, int(batch["response_lens"].max()), allowed, device)  # [B, R]
            for j, i in enumerate(batch["members"]):
                response = gen[j, : int(batch["response_lens"][j])]
                reply = tokenizer.decode(response.tolist())
                rows[i] = {"messages": [{"role": "user", "content": prompts[j]},
                                        {"role": "assistant", "content": reply}]}
                expected[i] = (prompt_ids[j], response)


def _write_jsonl(rows: list[dict], path: str) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    os.replace(tmp, path)


def _check_round_trip(out_dir: str, expected: list) -> None:
    """Prepared samples must start with exactly the prompt + response the target saw."""
    ds = TokenDataset(out_dir)
    if len(ds) != len(expected):
        raise DataError(f"{out_dir}: {len(ds)} samples prepared, {len(expected)} generated")
    for i, (prompt, response) in enumerate(expected):
        ids, mask = ds.sample(i)
        head = np.concatenate([prompt, response])
        if not np.array_equal(ids[: head.size], head) or not mask[prompt.size : head.size].all():
            raise DataError(f"{out_dir}: sample {i} does not round-trip through the chat template")


def build_synthetic_dataset(
    target_dir: str,
    out_dir: str,
    *,
    num_samples: int,
    min_len: int,
    max_len: int,
    seed: int = 0,
    device: str = "cpu",
    overwrite: bool = False,
    num_words: int | None = None,
) -> str:
    """Build (once) the synthetic dataset for the tiny target at out_dir; return out_dir.

    num_words: prompts and continuations use only the first num_words words (default: all).
    A small language (the embedded default uses 48 words) is one a CPU-sized drafter can
    learn in minutes; the continuations stay the target's own context-dependent choices.

    The source JSONL is written next to it ("<out_dir>.jsonl"). Idempotent: a complete
    dataset built with the same parameters and tokenizer is reused; a different one
    raises DataError unless overwrite.
    """
    from transformers import AutoTokenizer

    out_dir = os.path.abspath(out_dir.rstrip("/"))
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    overhead = _template_overhead(tokenizer)
    if num_samples < 1 or min_len < overhead + 2 or max_len < min_len:
        raise ConfigError(f"synthetic dataset: num_samples={num_samples}, min_len={min_len}, max_len={max_len}; "
                          f"need num_samples >= 1 and {overhead + 2} <= min_len <= max_len")
    num_words = len(TINY_VOCAB_WORDS) if num_words is None else num_words
    if not 2 <= num_words <= len(TINY_VOCAB_WORDS):
        raise ConfigError(f"synthetic dataset: num_words={num_words}; allowed 2..{len(TINY_VOCAB_WORDS)}")
    params = {"format": _SYNTHETIC_FORMAT, "num_samples": num_samples, "min_len": min_len,
              "max_len": max_len, "seed": seed}
    if num_words != len(TINY_VOCAB_WORDS):
        params["num_words"] = num_words  # absent for the full vocabulary: older caches stay valid
    if dataset_is_complete(out_dir) and not overwrite:
        ds = TokenDataset(out_dir)
        if ds.meta.get("extra", {}).get("synthetic") != params:
            raise DataError(f"{out_dir}: holds a different dataset ({ds.meta.get('extra')}); wanted {params}. "
                            "Pass overwrite=True or choose another directory.")
        ds.check_tokenizer(tokenizer)
        return out_dir
    batches = _plan(num_samples, min_len, max_len, overhead, seed, num_words)
    rows, expected = _generate_rows(target_dir, tokenizer, batches, num_samples, device, num_words)
    jsonl = out_dir + ".jsonl"
    _write_jsonl(rows, jsonl)
    try:
        prepare_dataset(target_dir, jsonl, out_dir, max_length=max_len, overwrite=overwrite, progress=False,
                        extra_meta={"synthetic": params})
    except DataError:
        # Another process may have published the same dataset first; reuse it if so.
        if not dataset_is_complete(out_dir) or TokenDataset(out_dir).meta.get("extra", {}).get("synthetic") != params:
            raise
    _check_round_trip(out_dir, expected)
    log.info("built synthetic dataset %s: %d samples, %d..%d tokens", out_dir, num_samples, min_len, max_len)
    return out_dir
