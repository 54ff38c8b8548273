"""The embedded default's dataset: random-word prompts answered by the target's own
greedy replies, generated through the public `regenerate` path (hf backend) and passed
through the real `prepare_dataset`, as a user's data would be.

Why the target's own continuations: a drafter learns to predict what the target would
generate; on text the target did not write there is little to learn, and for a randomly
initialised tiny target, text from anywhere else is noise to it. The continuations are
plain greedy decoding over the target's whole vocabulary, exactly what speculative
decoding reproduces at evaluation (restricting them to the prompt words, as format 1 did,
taught the drafter a language the target never speaks at evaluation). A reply ends at the
target's first stop token (the chat template's <|im_end|> then is the target's own choice)
or before the first token that is not text (a special token or a padding row).

Lengths: each sample's total token count (chat template included) is drawn log-uniformly
in [min_len, max_len], so short and long buckets are both populated. Samples are sorted
by length and generated in batches that share one prompt length (one `regenerate` run per
batch, with the batch's longest response as --max-new-tokens); each sample keeps its
own number of response tokens (a prefix of a greedy continuation is still greedy), so the
lengths are spread, not quantised to batches; a target that stops early makes a sample
shorter. A prompt the target answers with nothing is drawn again (prepare rejects empty
replies). After prepare, every sample's length and tokens are checked against what was
generated (the tokenizer must round-trip).

Held out: `num_held_out` more samples come from the same plan; only their prompts are
kept (meta.json "extra.held_out", read by eval/speculative.py), so evaluation uses prompts
drawn like the training data that were never trained on.

Usage:
    build_synthetic_dataset(build_tiny_target("runs/cache/tiny"), "runs/cache/tiny-data",
                            num_samples=400, min_len=32, max_len=512, num_held_out=16)
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil

import numpy as np

from dflash_ipc.data.dataset import TokenDataset, dataset_is_complete
from dflash_ipc.data.prepare import prepare_dataset
from dflash_ipc.builtin.tiny import TINY_VOCAB_WORDS
from dflash_ipc.errors import ConfigError, DataError

log = logging.getLogger(__name__)

_SYNTHETIC_FORMAT = 3  # 3: replies through `regenerate` (2: unrestricted greedy replies, held-out prompts)
GEN_BATCH_SIZE = 64
_MAX_PROMPT_DRAWS = 16
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
        batches.append({"members": members, "prompt_len": prompt_len, "seed": seed,
                        "response_lens": content - prompt_len, "prompt_words": words})
    return batches


def _generate_rows(target_dir: str, tokenizer, batches: list[dict], num_samples: int, device: str,
                   num_words: int, work_dir: str):
    """Run the target greedily through `regenerate`; return the JSONL rows and the expected
    token ids, in sample order."""
    import torch

    from dflash_ipc.regenerate.hf import HFBackend
    from dflash_ipc.regenerate.options import GenerationOptions

    # The ids a response may hold: what the tokenizer writes back as the same ids inside an
    # assistant message (words, role words, newlines); not special tokens.
    text_ids = np.ones(len(tokenizer), dtype=bool)
    text_ids[list(set(tokenizer.all_special_ids))] = False
    rows: list = [None] * num_samples
    expected: list = [None] * num_samples
    # Measured on a loaded 2-core box: a decode step of the tiny target took 140 ms with
    # 2 intra-op threads and ~10 ms with 1 (its matmuls are too small to split; the
    # threads only contend). Restored afterwards.
    prev_threads = torch.get_num_threads()
    if str(device).startswith("cpu"):
        torch.set_num_threads(1)
    longest = max(int(b["prompt_len"] + b["response_lens"].max()) for b in batches) + 64
    backend = HFBackend(target_dir, GenerationOptions(), devices=[device], token_budget=GEN_BATCH_SIZE * longest,
                        max_batch_size=GEN_BATCH_SIZE)
    try:
        for b, batch in enumerate(batches):
            _generate_batch(backend, tokenizer, batch, b, text_ids, rows, expected, num_words,
                            os.path.join(work_dir, f"batch-{b}"))
    finally:
        backend.close()
        torch.set_num_threads(prev_threads)
    return rows, expected


def _response(gen_row, budget: int, text_ids) -> np.ndarray:
    """The response: the reply's tokens up to the budget, ending before the first token that
    is not text (a stop token ends the reply there: the template's <|im_end|> follows)."""
    row = gen_row[:budget]
    bad = np.flatnonzero((row < 0) | ~text_ids[np.clip(row, 0, len(text_ids) - 1)] | (row >= len(text_ids)))
    return row[: bad[0]] if bad.size else row


def _replies(backend, prompts: list[str], max_new_tokens: int, path: str) -> list[str | None]:
    """The target's greedy reply to each prompt, through the public regenerate path (None
    where it replied with nothing)."""
    from dflash_ipc.regenerate.options import GenerationOptions
    from dflash_ipc.regenerate.run import regenerate

    _write_jsonl([{"messages": [{"role": "user", "content": p}]} for p in prompts], path + ".in.jsonl")
    report = regenerate(path + ".in.jsonl", path + ".jsonl", backend, GenerationOptions(max_new_tokens=max_new_tokens),
                        window=len(prompts), overwrite=True, progress=False)
    other = {k: v for k, v in report.rejects_by_reason.items() if k != "empty_reply"}
    if other or not report.complete:
        raise DataError(f"synthetic dataset: regenerate rejected prompts {other} (see {report.rejects_path})")
    replies: list[str | None] = [None] * len(prompts)
    with open(path + ".jsonl") as f:
        for line in f:
            row = json.loads(line)
            replies[row["index"]] = row["messages"][-1]["content"]
    return replies


def _generate_batch(backend, tokenizer, batch, b, text_ids, rows, expected, num_words, path) -> None:
    """Fill rows/expected for one batch. A sample whose reply would be empty (the target
    stops, or writes no text, right after the prompt) gets a fresh prompt of the same
    length, drawn from an RNG seeded by the batch, until it has one (prepare rejects empty
    replies)."""
    words = batch["prompt_words"].copy()  # [B, P]
    todo = np.arange(len(words))
    rng = np.random.default_rng([batch["seed"], b])
    budget_all = batch["response_lens"]
    for draw in range(_MAX_PROMPT_DRAWS):
        prompts = [" ".join(TINY_VOCAB_WORDS[w] for w in ws) for ws in words[todo]]
        replies = _replies(backend, prompts, int(budget_all[todo].max()), f"{path}-{draw}")
        empty = []
        for j, k in enumerate(todo):
            ids = np.asarray(tokenizer(replies[j] or "", add_special_tokens=False)["input_ids"], dtype=np.int64)
            response = _response(ids, int(budget_all[k]), text_ids)
            if response.size == 0:
                empty.append(k)
                continue
            rendered = tokenizer.apply_chat_template([{"role": "user", "content": prompts[j]}], tokenize=False,
                                                     add_generation_prompt=True)
            i = batch["members"][k]
            rows[i] = {"messages": [{"role": "user", "content": prompts[j]},
                                    {"role": "assistant", "content": tokenizer.decode(response.tolist())}]}
            expected[i] = (np.asarray(tokenizer(rendered, add_special_tokens=False)["input_ids"]), response)
        todo = np.asarray(empty, dtype=np.int64)
        if not todo.size:
            return
        words[todo] = rng.integers(0, num_words, (todo.size, words.shape[1]))
    raise DataError(f"synthetic dataset: the target replied with nothing to {todo.size} prompts "
                    f"after {_MAX_PROMPT_DRAWS} draws each")


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


def target_fingerprint(target_dir: str) -> str:
    """sha256 over the names and bytes of the files in target_dir (weights, config,
    tokenizer): the generated replies are a function of all of them."""
    h = hashlib.sha256()
    for name in sorted(os.listdir(target_dir)):
        path = os.path.join(target_dir, name)
        if not os.path.isfile(path):
            continue
        h.update(name.encode() + b"\0")
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        h.update(b"\0")
    return h.hexdigest()


def synthetic_params(target_dir: str, *, num_samples: int, min_len: int, max_len: int, seed: int = 0,
                     num_words: int | None = None, num_held_out: int = 0) -> dict:
    """Everything the dataset depends on: code version, generation parameters and the
    target's fingerprint. Stored in meta.json ("extra.synthetic"); a dataset is reused
    only when they are equal. DataError unless target_dir holds the tiny tokenizer (checked
    before its files are hashed)."""
    from transformers import AutoTokenizer

    _word_ids(AutoTokenizer.from_pretrained(target_dir))
    return {"format": _SYNTHETIC_FORMAT, "num_samples": num_samples, "min_len": min_len, "max_len": max_len,
            "seed": seed, "num_words": len(TINY_VOCAB_WORDS) if num_words is None else num_words,
            "num_held_out": num_held_out, "target": target_fingerprint(target_dir)}


def synthetic_cache_key(params: dict) -> str:
    """Short hash of synthetic_params(): a cache directory name that changes with any of them."""
    return hashlib.sha256(json.dumps(params, sort_keys=True).encode()).hexdigest()[:12]


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
    num_held_out: int = 0,
) -> str:
    """Build (once) the synthetic dataset for the tiny target at out_dir; return out_dir.

    num_words: prompts use only the first num_words words (default: all); the replies are
    whatever the target writes. num_held_out: that many more samples are drawn by the same
    plan (sample ids num_samples.. num_samples+num_held_out-1); only their prompts are kept,
    in meta.json ("extra.held_out"), for evaluation on prompts never trained on.

    The source JSONL is written next to it ("<out_dir>.jsonl"). Idempotent: a complete
    dataset built with the same parameters (synthetic_params(): including the target's
    fingerprint) is reused; a different one raises DataError unless overwrite.
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
    if num_held_out < 0:
        raise ConfigError(f"synthetic dataset: num_held_out={num_held_out}; must be >= 0")
    params = synthetic_params(target_dir, num_samples=num_samples, min_len=min_len, max_len=max_len, seed=seed,
                              num_words=num_words, num_held_out=num_held_out)
    if dataset_is_complete(out_dir) and not overwrite:
        ds = TokenDataset(out_dir)
        if ds.meta.get("extra", {}).get("synthetic") != params:
            raise DataError(f"{out_dir}: holds a different dataset ({ds.meta.get('extra', {}).get('synthetic')}); "
                            f"wanted {params}. Pass overwrite=True or choose another directory.")
        ds.check_tokenizer(tokenizer)
        return out_dir
    total = num_samples + num_held_out
    batches = _plan(total, min_len, max_len, overhead, seed, num_words)
    work_dir = f"{out_dir}.regen-{os.getpid()}"
    os.makedirs(work_dir, exist_ok=True)
    try:
        rows, expected = _generate_rows(target_dir, tokenizer, batches, total, device, num_words, work_dir)
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)
    held_out = [{"sample_id": i, "prompt_ids": expected[i][0].tolist()} for i in range(num_samples, total)]
    rows, expected = rows[:num_samples], expected[:num_samples]
    jsonl = out_dir + ".jsonl"
    _write_jsonl(rows, jsonl)
    try:
        prepare_dataset(target_dir, jsonl, out_dir, max_length=max_len, overwrite=overwrite, progress=False,
                        extra_meta={"synthetic": params, "held_out": held_out})
    except DataError:
        # Another process may have published the same dataset first; reuse it if so.
        if not dataset_is_complete(out_dir) or TokenDataset(out_dir).meta.get("extra", {}).get("synthetic") != params:
            raise
    _check_round_trip(out_dir, expected)
    log.info("built synthetic dataset %s: %d samples (+%d held out), %d..%d tokens", out_dir, num_samples,
             num_held_out, min_len, max_len)
    return out_dir
