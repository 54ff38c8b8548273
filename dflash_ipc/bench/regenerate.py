"""`dflash-ipc bench regenerate`: batched generation as `regenerate` runs it against one
prompt at a time, on one device, the same model and prompts, in the same run.

    dflash-ipc bench regenerate --shape qwen3-1.7b --device cuda:0
    dflash-ipc bench regenerate --shape qwen3-8b --device cuda:0 --json /tmp/regen-8b.json

The target is a random-weight model of the named shape (bench/assets.py), saved and loaded
back through `from_pretrained`, or `--target DIR`. Prompts are random words of the tiny
tokenizer, rendered through the chat template, lengths log-uniform in [--min-prompt,
--max-prompt]. Phases:
  one at a time  the first --one-at-a-time prompts, each alone (batch 1, dynamic cache)
  batched        every prompt through regenerate's hf path: length buckets, token-budget
                 batches, left padding, once per --cache
A random model's stop tokens are luck, so none is used: every prompt generates exactly
--max-new-tokens in both phases, and tokens/s compare like with like. Printed per phase:
prompts, new tokens, seconds, generated tokens/s, batches, mean batch size and the padding
share (token slots computed for no real token: prompt padding here); then the speedup.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import tempfile
import time

import numpy as np

from dflash_ipc.regenerate.generator import BatchStats, Generator, GeneratorSettings
from dflash_ipc.regenerate.scheduler import BatchScheduler


def make_prompts(tokenizer, num: int, min_len: int, max_len: int, seed: int) -> list[list[int]]:
    """Chat-template renderings of random-word user turns of log-uniform length."""
    from dflash_ipc.builtin.tiny import TINY_VOCAB_WORDS

    rng = np.random.default_rng(seed)
    prompts = []
    one_word = tokenizer.apply_chat_template([{"role": "user", "content": TINY_VOCAB_WORDS[0]}], tokenize=False,
                                             add_generation_prompt=True)
    overhead = len(tokenizer(one_word, add_special_tokens=False)["input_ids"]) - 1
    for _ in range(num):
        n = int(math.exp(rng.uniform(math.log(min_len), math.log(max_len + 1))))
        words = rng.integers(0, len(TINY_VOCAB_WORDS), max(1, n - overhead))
        text = tokenizer.apply_chat_template([{"role": "user", "content": " ".join(TINY_VOCAB_WORDS[w] for w in words)}],
                                             tokenize=False, add_generation_prompt=True)
        prompts.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return prompts


def _phase(name: str, stats: BatchStats, seconds: float) -> dict:
    return {"phase": name, "prompts": stats.prompts, "new_tokens": stats.new_tokens, "seconds": seconds,
            "tokens_per_s": stats.new_tokens / max(seconds, 1e-9), "batches": stats.batches,
            "mean_batch": stats.prompts / max(stats.batches, 1), "padding_share": stats.padding_share,
            "prompt_padding_share": 1 - stats.prompt_tokens / max(stats.prompt_slots, 1)}


def _sync(device: str) -> None:
    import torch
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def one_at_a_time(gen: Generator, prompts: list[list[int]], max_new_tokens: int) -> dict:
    """Each prompt alone."""
    stats = BatchStats()
    _sync(gen.device)
    started = time.perf_counter()
    for p in prompts:
        stats.add(gen.generate([p], [max_new_tokens])[1])
    _sync(gen.device)
    return _phase("one at a time", stats, time.perf_counter() - started)


def batched(gen: Generator, prompts: list[list[int]], max_new_tokens: int, *, token_budget: int,
            max_batch_size: int, name: str) -> dict:
    """Every prompt through regenerate's scheduler and generator."""
    scheduler = BatchScheduler(token_budget=token_budget, max_batch_size=max_batch_size)
    for i, p in enumerate(prompts):
        scheduler.add(i, len(p), max_new_tokens)
    stats = BatchStats()
    _sync(gen.device)
    started = time.perf_counter()
    while (keys := scheduler.next_batch(flush=True)) is not None:
        stats.add(gen.generate([prompts[k] for k in keys], [max_new_tokens] * len(keys))[1])
    _sync(gen.device)
    return _phase(name, stats, time.perf_counter() - started)


def format_table(result: dict) -> str:
    """The figures as the bench prints them."""
    head = (f"bench regenerate: {result['target']} on {result['device']} ({result['dtype']}), {result['num_prompts']} "
            f"prompts of {result['min_prompt']}..{result['max_prompt']} tokens, {result['max_new_tokens']} new each, "
            f"token budget {result['token_budget']}, max batch {result['max_batch_size']}")
    lines = [head, f"{'phase':<17}{'prompts':>8}{'new tokens':>12}{'seconds':>9}{'tokens/s':>10}{'batches':>9}"
                   f"{'mean batch':>11}{'padding':>9}"]
    for p in result["phases"]:
        lines.append(f"{p['phase']:<17}{p['prompts']:>8}{p['new_tokens']:>12,}{p['seconds']:>9.1f}"
                     f"{p['tokens_per_s']:>10,.0f}{p['batches']:>9}{p['mean_batch']:>11.1f}{100 * p['padding_share']:>8.1f}%")
    for name, x in result["speedup"].items():
        lines.append(f"speedup {name} / one at a time: {x:.1f}x")
    return "\n".join(lines)


def run_regenerate_bench(*, shape: str = "qwen3-1.7b", target: str | None = None, device: str = "cuda:0",
                         num_prompts: int = 1024, num_single: int = 4, min_prompt: int = 64, max_prompt: int = 256,
                         max_new_tokens: int = 128, token_budget: int | None = None, max_batch_size: int | None = None,
                         caches=("static", "dynamic"), dtype: str = "bfloat16", seed: int = 0) -> dict:
    """Build (or take) the target, run the phases, return every figure (see the module docstring)."""
    from transformers import AutoTokenizer

    from dflash_ipc.bench.assets import build_random_target

    cpu = device.startswith("cpu")
    token_budget = token_budget or (16384 if cpu else 131072)
    max_batch_size = max_batch_size or (64 if cpu else 256)
    with tempfile.TemporaryDirectory(prefix="bench-regenerate-") as tmp:
        if target is None:
            target = build_random_target(os.path.join(tmp, shape), shape=shape, dtype=dtype, seed=seed)
            label = f"random {shape}"
        else:
            label = target
        tokenizer = AutoTokenizer.from_pretrained(target)
        prompts = make_prompts(tokenizer, num_prompts, min_prompt, max_prompt, seed)
        settings = GeneratorSettings(target, dtype=dtype, cache="dynamic", pad_id=int(tokenizer.pad_token_id or 0))
        single = Generator(settings, device)
        single.generate(prompts[:2], [8, 8])  # warm-up: kernels, allocator
        phases = [one_at_a_time(single, prompts[:num_single], max_new_tokens)]
        for cache in caches:
            gen = Generator(dataclasses.replace(settings, cache=cache), device, model=single.model)
            phases.append(batched(gen, prompts, max_new_tokens, token_budget=token_budget,
                                  max_batch_size=max_batch_size, name=f"batched {cache}"))
    base = phases[0]["tokens_per_s"]
    return {"target": label, "device": device, "dtype": dtype, "num_prompts": num_prompts, "min_prompt": min_prompt,
            "max_prompt": max_prompt, "max_new_tokens": max_new_tokens, "token_budget": token_budget,
            "max_batch_size": max_batch_size, "phases": phases,
            "speedup": {p["phase"]: p["tokens_per_s"] / base for p in phases[1:]}}


def write_json(result: dict, path: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
