"""`dflash-ipc bench regenerate`: regenerate's decoders against one prompt at a time, on one
device, the same model and prompts, in the same run, each against the weight-bandwidth bound.

    dflash-ipc bench regenerate --shape qwen3-1.7b --device cuda:0
    dflash-ipc bench regenerate --shape qwen3-8b --device cuda:0 --json /tmp/regen-8b.json

The target is a random-weight model of the named shape (bench/assets.py), saved and loaded
back through `from_pretrained`, or `--target DIR`. Prompts are random words of the tiny
tokenizer, rendered through the chat template, lengths log-uniform in [--min-prompt,
--max-prompt]; reply lengths are mixed: each prompt's budget is log-uniform in [--min-new-tokens,
--max-new-tokens] (a random model's stop tokens are luck, so none is used and every reply runs
to its budget, the same in every phase; the engine knows budgets and frees such a row without
waiting for its next look, where a stop token would cost up to --check-every idle steps).
Phases (PHASES; in this order, so that generate runs before the engine switches the shared
model to its attention function):
  one-at-a-time       the first --one-at-a-time prompts, each alone (generate, batch 1, dynamic cache)
  generate-static     regenerate's generate decoder: length buckets, token-budget batches, left
  generate-dynamic    padding, transformers' generate per batch with that cache
  engine-batches      the decoding core with static batching: a batch's rows are refilled only
                      once all of them are done
  engine-continuous   the decoding core as regenerate runs it: rows refilled as replies finish,
                      a refill once an eighth of the rows are free (decode.engine's refill_rows)
  engine-refill-each  the same with a refill at every free row (refill_rows=1): a prefill
                      forward per finished reply or two
  engine-compiled     engine-continuous with the target's decode forward compiled by
                      torch.compile on CUDA (decode/compiled.py): what it gives
The engine phases run once untimed first (the same batches: every CUDA graph is captured
and every torch.compile program built there, as a long regenerate run builds them once), and the table says what that cost.
Printed per phase: prompts, new tokens, seconds, generated tokens/s, decode steps, rows per
step, the padding share (token slots computed for no real token: prompt padding and idle
rows), the weight-bandwidth bound in tokens/s at --hbm-tbps (decode/bound.py) and the
measured share of it, and for the engine the share of the bound that counts the K/V read too.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import tempfile
import time

import numpy as np

from dflash_ipc.decode.bound import hbm_tbps as device_hbm_tbps, bound, weight_bytes
from dflash_ipc.regenerate.generator import BatchStats, Generator, GeneratorSettings, default_max_batch_size
from dflash_ipc.regenerate.hf import make_scheduler

PHASES = ("one-at-a-time", "generate-static", "generate-dynamic", "engine-batches", "engine-continuous",
          "engine-refill-each", "engine-compiled")
_GENERATOR_OF_PHASE = {  # GeneratorSettings fields of each batched phase
    "generate-static": dict(decoder="generate", cache="static"),
    "generate-dynamic": dict(decoder="generate", cache="dynamic"),
    "engine-batches": dict(decoder="engine", cache="static", continuous=False, compile="off"),
    "engine-continuous": dict(decoder="engine", cache="static", continuous=True, compile="off"),
    "engine-refill-each": dict(decoder="engine", cache="static", continuous=True, refill_rows=1, compile="off"),
    "engine-compiled": dict(decoder="engine", cache="static", continuous=True, compile="auto"),
}
DEFAULT_PHASES = ("one-at-a-time", "generate-static", "engine-batches", "engine-continuous")


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


def reply_budgets(num: int, min_new: int, max_new: int, seed: int) -> list[int]:
    """Log-uniform reply budgets in [min_new, max_new] (mixed reply lengths)."""
    rng = np.random.default_rng(seed + 1)
    return [int(min(max_new, math.exp(rng.uniform(math.log(min_new), math.log(max_new + 1))))) for _ in range(num)]


def _phase(name: str, stats: BatchStats, seconds: float, weights: int, kv_bytes: int, hbm: float) -> dict:
    b = bound(tokens=stats.new_tokens, seconds=seconds, steps=stats.steps, weight_bytes=weights,
              hbm_bytes_per_s=hbm, kv_positions_read=stats.kv_positions_read, kv_bytes_per_token=kv_bytes)
    return {"phase": name, "prompts": stats.prompts, "new_tokens": stats.new_tokens, "seconds": seconds,
            "tokens_per_s": stats.new_tokens / max(seconds, 1e-9), "batches": stats.batches, "steps": stats.steps,
            "rows_per_step": (stats.new_slots - stats.prompts) / stats.steps if stats.steps else 0.0,
            "padding_share": stats.padding_share,
            "prompt_padding_share": 1 - stats.prompt_tokens / max(stats.prompt_slots, 1),
            "bound_tokens_per_s": b.bound_tokens_per_s, "bound_ratio": b.ratio, "bound_ratio_with_kv": b.ratio_with_kv,
            "captures": stats.captures}


def _sync(device: str) -> None:
    import torch
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def one_at_a_time(gen: Generator, prompts: list[list[int]], budgets: list[int]) -> tuple[BatchStats, float]:
    """Each prompt alone."""
    stats = BatchStats()
    _sync(gen.device)
    started = time.perf_counter()
    for p, n in zip(prompts, budgets):
        stats.add(gen.generate([p], [n])[1])
    _sync(gen.device)
    return stats, time.perf_counter() - started


def batched(gen: Generator, prompts: list[list[int]], budgets: list[int], *, token_budget: int | None,
            max_batch_size: int) -> tuple[BatchStats, float]:
    """Every prompt through regenerate's scheduler (as the hf backend makes it) and the generator."""
    scheduler = make_scheduler(gen.decoder, token_budget, max_batch_size, cpu=gen.device.startswith("cpu"))
    for i, (p, n) in enumerate(zip(prompts, budgets)):
        scheduler.add(i, len(p), n)
    stats = BatchStats()
    _sync(gen.device)
    started = time.perf_counter()
    while (keys := scheduler.next_batch(flush=True)) is not None:
        stats.add(gen.generate([prompts[k] for k in keys], [budgets[k] for k in keys], [(k, 0, 0) for k in keys])[1])
    _sync(gen.device)
    return stats, time.perf_counter() - started


def format_table(result: dict) -> str:
    """The figures as the bench prints them."""
    head = (f"bench regenerate: {result['target']} on {result['device']} ({result['dtype']}), {result['num_prompts']} "
            f"prompts of {result['min_prompt']}..{result['max_prompt']} tokens, replies of {result['min_new_tokens']}.."
            f"{result['max_new_tokens']} tokens (mixed), max batch {result['max_batch_size']}; bound: weights "
            f"{result['weight_gib']:.2f} GiB read per step at {result['hbm_tbps']:g} TB/s"
            + (f"; engine-continuous refills at {result['refill_rows']} free rows" if result.get("refill_rows") else ""))
    lines = [head, f"{'phase':<19}{'prompts':>8}{'new tokens':>11}{'seconds':>9}{'tokens/s':>10}{'steps':>7}"
                   f"{'rows/step':>10}{'padding':>9}{'bound tok/s':>12}{'of bound':>9}{'w/ KV':>7}"]
    for p in result["phases"]:
        kv = "-" if p["bound_ratio_with_kv"] is None else f"{100 * p['bound_ratio_with_kv']:.0f}%"
        lines.append(f"{p['phase']:<19}{p['prompts']:>8}{p['new_tokens']:>11,}{p['seconds']:>9.1f}"
                     f"{p['tokens_per_s']:>10,.0f}{p['steps']:>7}{p['rows_per_step']:>10.1f}"
                     f"{100 * p['padding_share']:>8.1f}%{p['bound_tokens_per_s']:>12,.0f}"
                     f"{100 * p['bound_ratio']:>8.1f}%{kv:>7}")
    for p in result["phases"]:
        if "warmup_seconds" in p:
            lines.append(f"{p['phase']}: untimed warm-up run {p['warmup_seconds']:.1f} s, {p['warmup_captures']} CUDA "
                         f"graphs captured; the timed run captured {p['captures']}")
    for name, x in result["speedup"].items():
        lines.append(f"speedup {name}: {x:.1f}x")
    return "\n".join(lines)


def run_regenerate_bench(*, shape: str = "qwen3-1.7b", target: str | None = None, device: str = "cuda:0",
                         num_prompts: int = 512, num_single: int = 4, min_prompt: int = 64, max_prompt: int = 256,
                         min_new_tokens: int | None = None, max_new_tokens: int = 256, token_budget: int | None = None,
                         max_batch_size: int | None = None, phases=DEFAULT_PHASES, dtype: str = "bfloat16",
                         check_every: int = 16, refill_rows: int | None = None, hbm_tbps: float | None = None,
                         seed: int = 0) -> dict:
    """Build (or take) the target, run the phases, return every figure (see the module docstring)."""
    from transformers import AutoTokenizer

    from dflash_ipc.bench.assets import build_random_target
    from dflash_ipc.decode.cache import kv_bytes_per_token
    from dflash_ipc.errors import ConfigError
    from dflash_ipc.hf.text_stack import text_config

    unknown = sorted(set(phases) - set(PHASES))
    if unknown or not phases:
        raise ConfigError(f"bench regenerate phases {unknown or '(none)'}; allowed: {list(PHASES)}")
    phases = [p for p in PHASES if p in phases]
    cpu = device.startswith("cpu")
    max_batch_size = max_batch_size or default_max_batch_size("engine", cpu=cpu)  # generate's phases too
    min_new_tokens = min_new_tokens or max(1, max_new_tokens // 8)
    hbm_tbps = device_hbm_tbps(device, hbm_tbps)
    hbm = hbm_tbps * 1e12
    with tempfile.TemporaryDirectory(prefix="bench-regenerate-") as tmp:
        if target is None:
            target = build_random_target(os.path.join(tmp, shape), shape=shape, dtype=dtype, seed=seed)
            label = f"random {shape}"
        else:
            label = target
        tokenizer = AutoTokenizer.from_pretrained(target)
        prompts = make_prompts(tokenizer, num_prompts, min_prompt, max_prompt, seed)
        budgets = reply_budgets(num_prompts, min_new_tokens, max_new_tokens, seed)
        settings = GeneratorSettings(target, dtype=dtype, cache="dynamic", pad_id=int(tokenizer.pad_token_id or 0),
                                     decoder="generate", max_rows=max_batch_size, kv_tokens=token_budget,
                                     check_every=check_every,
                                     graphs="on" if device.startswith("cuda") else "off")  # the captured steps
        single = Generator(settings, device)
        model = single.model
        weights = weight_bytes(model)
        kv_bytes = kv_bytes_per_token(text_config(model.config), next(model.parameters()).dtype)
        single.generate(prompts[:2], [8, 8])  # warm-up: kernels, allocator
        results = []
        for name in phases:
            warm = None
            if name == "one-at-a-time":
                stats, seconds = one_at_a_time(single, prompts[:num_single], budgets[:num_single])
            else:
                fields = _GENERATOR_OF_PHASE[name]
                if name in ("engine-continuous", "engine-compiled"):
                    fields = fields | {"refill_rows": refill_rows}
                gen = Generator(dataclasses.replace(settings, **fields), device, model=model)
                warm = None
                if gen.engine is not None:  # an untimed run first: the same batches, every graph captured
                    warm = batched(gen, prompts, budgets, token_budget=token_budget, max_batch_size=max_batch_size)
                stats, seconds = batched(gen, prompts, budgets, token_budget=token_budget,
                                         max_batch_size=max_batch_size)
                if gen.engine is not None:
                    gen.engine.release()
            results.append(_phase(name, stats, seconds, weights, kv_bytes, hbm))
            if warm is not None:
                results[-1] |= {"warmup_seconds": warm[1], "warmup_captures": warm[0].captures}
    rate = {p["phase"]: p["tokens_per_s"] for p in results}
    speedup = {f"{p} / one-at-a-time": rate[p] / rate["one-at-a-time"] for p in rate if p != "one-at-a-time"
               and "one-at-a-time" in rate}
    if "engine-continuous" in rate and "generate-static" in rate:
        speedup["engine-continuous / generate-static"] = rate["engine-continuous"] / rate["generate-static"]
    if "engine-continuous" in rate and "engine-batches" in rate:
        speedup["engine-continuous / engine-batches (continuous batching)"] = \
            rate["engine-continuous"] / rate["engine-batches"]
    if "engine-continuous" in rate and "engine-refill-each" in rate:
        speedup["engine-continuous / engine-refill-each (a refill per several free rows)"] = \
            rate["engine-continuous"] / rate["engine-refill-each"]
    if "engine-continuous" in rate and "engine-compiled" in rate:
        speedup["engine-compiled / engine-continuous (torch.compile of the decode forward)"] = \
            rate["engine-compiled"] / rate["engine-continuous"]
    return {"target": label, "device": device, "dtype": dtype, "num_prompts": num_prompts, "min_prompt": min_prompt,
            "max_prompt": max_prompt, "min_new_tokens": min_new_tokens, "max_new_tokens": max_new_tokens,
            "token_budget": token_budget, "max_batch_size": max_batch_size, "check_every": check_every,
            "refill_rows": refill_rows,
            "hbm_tbps": hbm_tbps, "weight_gib": weights / 2**30, "kv_bytes_per_token": kv_bytes,
            "phases": results, "speedup": speedup}


def write_json(result: dict, path: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
