"""``dflash-ipc bench eval``: generated tokens/s of batched speculative and plain decoding against
the unbatched decoder (eval/unbatched.py), measured in one run.

Assets: a random-weight target of a real shape (bench/assets.py; Qwen3-1.7B-shaped by
default), saved and loaded through the real ``from_pretrained``; a random drafter of the
shape training builds for it (5 layers over the paper's target layers, block 16); random
prompts (ids < 1000, log-uniform lengths). With random weights nothing is accepted (tau
~1), so the figures measure the decoding machinery (batching, caches, syncs), not a
drafter's quality; a trained drafter multiplies the speculative rows by its tau.

Rows (greedy; wall time of the whole run, prefills included, after one untimed warm-up
run of each path, which also compiles the drafter's fused kernels on CUDA; a batched row's
warm-up is the same decoder on the same prompts, so its CUDA graphs are captured before the
timed run):

    legacy   speculative, plain     batch 1: ``speculative_generate`` / ``greedy_generate``,
                                    one prompt after another (the implementation batched
                                    decoding replaces), on ``legacy_prompts`` prompts
    batched  speculative, plain     each batch size, on max(2, prompts_per_batch x batch)
                                    prompts, rows refilled as sequences finish; plain runs
                                    on the decoding core (decode/engine.py), speculative
                                    cycles as CUDA graphs (eval/decoding.py)

Each row also gives its time per target forward (a plain step, a speculative cycle's verify
with its draft) and, for plain rows, the weight-bandwidth bound (decode/bound.py): a step
reads the target's weights once, so at ``hbm_tbps`` it takes at least weights / bandwidth;
the summary prints the batch-1 plain step against it and the batch-1 cycle in plain steps
(the speedup is tau over that).

Run manual (one H200, about 3 minutes with the target build)::

    dflash-ipc bench eval --device cuda:0
    dflash-ipc bench eval --device cpu --shape tiny --batch-sizes 1,4 --max-new-tokens 16
"""

from __future__ import annotations

import copy
import logging
import math
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from dflash_ipc.bench.assets import build_random_target
from dflash_ipc.decode.bound import hbm_tbps as device_hbm_tbps, weight_bytes
from dflash_ipc.drafter.model import DFlashConfig, DFlashDraftModel
from dflash_ipc.eval.decoding import PlainDecoder, SpeculativeDecoder
from dflash_ipc.eval.drafter_context import DrafterContext
from dflash_ipc.eval.unbatched import DFlashProposer, TargetLM, greedy_generate, speculative_generate
from dflash_ipc.decode.requests import Request, RequestList
from dflash_ipc.decode.target import BatchedTarget, resolve_dtype

logger = logging.getLogger(__name__)

GOAL = 20.0
"""Batched speculative tokens/s at the best batch over legacy speculative tokens/s (issue 21)."""
DRAFT_LAYERS = {"tiny": 2}  # default 5 (DESIGN.md); the tiny shape has 4 target layers


@dataclass(kw_only=True, slots=True)
class Row:
    impl: str
    """legacy | batched"""
    mode: str
    """speculative | plain"""
    batch_size: int
    num_prompts: int = 0
    num_tokens: int = 0
    wall_s: float = math.nan
    tau: float = math.nan
    peak_gib: float = math.nan
    """Peak GPU memory allocated during the row (CUDA only)."""
    num_forwards: int = 0
    """Target forwards (prefills, plain steps, verify passes)."""
    error: str | None = None
    ms_runs: list[float] = field(default_factory=list)
    """ms per forward of each timed run of a batched row (``repeats``); the row's figures are
    the median run's."""

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.wall_s if self.wall_s > 0 else math.nan

    @property
    def ms_per_forward(self) -> float:
        return 1e3 * self.wall_s / self.num_forwards if self.num_forwards else math.nan


def random_prompts(n: int, lengths: tuple[int, int], seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    lo, hi = lengths
    sizes = np.exp(rng.uniform(math.log(lo), math.log(hi), size=n)).astype(int)
    return [rng.integers(10, 1000, size=int(s)) for s in sizes]


def bench_drafter(target_dir: str, shape: str, *, device: torch.device, dtype: torch.dtype,
                  seed: int) -> DFlashDraftModel:
    from transformers import AutoConfig, AutoTokenizer
    config = DFlashConfig.from_target_config(AutoConfig.from_pretrained(target_dir),
                                             num_draft_layers=DRAFT_LAYERS.get(shape, 5), block_size=16,
                                             mask_token_id=AutoTokenizer.from_pretrained(target_dir).mask_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = DFlashDraftModel(config)
    return model.to(device=device, dtype=dtype).eval()


def _measure(row: Row, device: torch.device, fn: Callable[[], tuple]) -> Row:
    """Run ``fn`` (-> tokens, tau[, target forwards]) and time it; out of GPU memory is recorded, not raised.
    Each row is logged as it is measured (a long run shows its progress)."""
    row = _time(row, device, fn)
    if row.error:
        logger.warning("bench eval: %s %s batch %d: %s", row.impl, row.mode, row.batch_size, row.error)
    else:
        logger.info("bench eval: %s %s batch %d, %d prompts: %d tokens in %.2f s, %.1f tok/s", row.impl, row.mode,
                    row.batch_size, row.num_prompts, row.num_tokens, row.wall_s, row.tokens_per_s)
    return row


def _median_run(runs: list[Row]) -> Row:
    """The run of median ms per forward (the lower of the middle two for an even count), with
    every run's ms per forward; the first failed run, if one failed."""
    failed = next((r for r in runs if r.error), None)
    if failed is not None:
        return failed
    ranked = sorted(runs, key=lambda r: r.wall_s / max(r.num_forwards, 1))  # ms per forward (or wall: none)
    chosen = copy.copy(ranked[(len(ranked) - 1) // 2])
    chosen.ms_runs = [r.ms_per_forward for r in runs]
    return chosen


def _time(row: Row, device: torch.device, fn: Callable[[], tuple]) -> Row:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    started = time.perf_counter()
    try:
        row.num_tokens, row.tau, *forwards = fn()
        row.num_forwards = forwards[0] if forwards else 0
    except torch.cuda.OutOfMemoryError as exc:
        row.error = f"out of GPU memory ({str(exc).splitlines()[0][:80]})"
        torch.cuda.empty_cache()
        return row
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        row.peak_gib = torch.cuda.max_memory_allocated(device) / 2**30
    row.wall_s = time.perf_counter() - started
    return row


def legacy_rows(target_dir: str, model: DFlashDraftModel, prompts: Sequence[np.ndarray], *, max_new_tokens: int,
                device: torch.device, dtype: str) -> list[Row]:
    """Today's unbatched decoder on ``prompts``, after a warm-up on a short one; frees its model."""
    target = TargetLM(target_dir, layer_ids=model.config.target_layer_ids, device=device, dtype=dtype)
    proposer = DFlashProposer(model, target.head)
    logger.info("bench eval: warm-up of the unbatched decoder")
    speculative_generate(target, proposer, prompts[0][:16], max_new_tokens=8)  # warm-up (and compile)
    greedy_generate(target, prompts[0][:16], max_new_tokens=8)

    def speculative():
        before = target.num_forwards
        results = [speculative_generate(target, proposer, p, max_new_tokens=max_new_tokens) for p in prompts]
        return (sum(len(r.output_ids) for r in results), _pooled_tau([r.stats for r in results]),
                target.num_forwards - before)

    def plain():
        before = target.num_forwards
        tokens = sum(len(greedy_generate(target, p, max_new_tokens=max_new_tokens)) for p in prompts)
        return tokens, math.nan, target.num_forwards - before

    rows = [_measure(Row(impl="legacy", mode=mode, batch_size=1, num_prompts=len(prompts)), device, fn)
            for mode, fn in (("speculative", speculative), ("plain", plain))]
    del target, proposer
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def batched_rows(target: BatchedTarget, model: DFlashDraftModel, prompts: Sequence[np.ndarray], *,
                 batch_sizes: Sequence[int], prompts_per_batch: int, max_new_tokens: int,
                 compile: str = "auto", repeats: int = 1) -> list[Row]:
    """Both batched decoders at each batch size; stops growing the batch after running out of memory.
    ``compile``: torch.compile of the target's decode forward (decode/compiled.py COMPILE);
    ``repeats``: timed runs per row, one after another (the median run is the row's)."""
    drafter = DrafterContext(model, target.head)

    def decoders(batch_size: int):
        graphs = "on" if target.device.type == "cuda" else "off"  # the bench measures the captured steps
        return (("speculative", SpeculativeDecoder(target, drafter, batch_size=batch_size, graphs=graphs,
                                                   compile=compile)),
                ("plain", PlainDecoder(target, batch_size=batch_size, keep_cache=True, graphs=graphs,
                                       compile=compile)))

    def requests(n: int) -> RequestList:
        return RequestList(Request(key=(i, 0), prompt_ids=prompts[i], max_new_tokens=max_new_tokens)
                           for i in range(n))

    logger.info("bench eval: warm-up of the batched decoders (compiles the drafter's kernels on CUDA)")
    # warm-up at the first batch size: compiles its shapes, grows the allocator a little
    for _, decoder in decoders(min(batch_sizes)):
        decoder.run(RequestList([Request(key=(0, 0), prompt_ids=prompts[0][:16], max_new_tokens=20)]))
        decoder.release()  # its graphs freed now, not by the garbage collector during a later capture
    rows: list[Row] = []
    for batch_size in batch_sizes:
        n = max(2, prompts_per_batch * batch_size)
        for mode, decoder in decoders(batch_size):
            def run(decoder=decoder):
                result = decoder.run(requests(n))
                return (result.num_generated, _pooled_tau([g.stats for g in result.generations if g.stats is not None]),
                        result.num_target_forwards)
            try:
                decoder.run(requests(n))  # warm-up: the same shapes, so every CUDA graph is captured
            except torch.cuda.OutOfMemoryError:
                torch.cuda.empty_cache()
            runs: list[Row] = []
            while len(runs) < repeats and not (runs and runs[-1].error):  # no more runs after one fails
                runs.append(_measure(Row(impl="batched", mode=mode, batch_size=batch_size, num_prompts=n),
                                     target.device, run))
            rows.append(_median_run(runs))
            decoder.release()  # its cache and graphs stayed for the timed runs; the next decoder builds its own
        if any(r.error for r in rows[-2:]):
            break
    return rows


def summary(rows: Sequence[Row], bound_ms: float = math.nan) -> dict:
    """Best batched row per mode and its ratio to the legacy row of that mode; at batch 1, the
    plain step against the weight-bandwidth bound (``bound_ms`` per step) and the speculative
    cycle in plain steps."""
    out = {}
    plain1 = next((r for r in rows if r.impl == "batched" and r.mode == "plain" and r.batch_size == 1
                   and not r.error), None)
    spec1 = next((r for r in rows if r.impl == "batched" and r.mode == "speculative" and r.batch_size == 1
                  and not r.error), None)
    if plain1 is not None:
        out["batch1"] = {"plain_ms_per_step": plain1.ms_per_forward, "bound_ms_per_step": bound_ms,
                         "plain_of_bound": bound_ms / plain1.ms_per_forward,
                         "spec_ms_per_cycle": spec1.ms_per_forward if spec1 else math.nan,
                         "cycle_in_plain_steps": spec1.ms_per_forward / plain1.ms_per_forward if spec1 else math.nan,
                         "plain_ms_runs": plain1.ms_runs, "spec_ms_runs": spec1.ms_runs if spec1 else []}
    for mode in ("speculative", "plain"):
        legacy = next((r for r in rows if r.impl == "legacy" and r.mode == mode and not r.error), None)
        batched = [r for r in rows if r.impl == "batched" and r.mode == mode and not r.error]
        if not batched:
            continue
        best = max(batched, key=lambda r: r.tokens_per_s)
        one = next((r for r in batched if r.batch_size == 1), None)
        ratio = best.tokens_per_s / legacy.tokens_per_s if legacy else math.nan
        out[mode] = {"best_batch_size": best.batch_size, "best_tokens_per_s": best.tokens_per_s,
                     "batch1_tokens_per_s": one.tokens_per_s if one else math.nan,
                     "legacy_tokens_per_s": legacy.tokens_per_s if legacy else math.nan, "vs_legacy": ratio}
    return out


def run_eval_bench(*, device: str = "cuda:0", shape: str = "qwen3-1.7b", batch_sizes: Sequence[int] = (1, 16, 64, 256),
                   prompts_per_batch: int = 2, max_new_tokens: int = 128, prompt_len: tuple[int, int] = (64, 256),
                   legacy_prompts: int = 2, dtype: str = "auto", work_dir: str | None = None, seed: int = 0,
                   hbm_tbps: float | None = None, compile: str = "auto", repeats: int = 1,
                   emit: Callable[[str], None] = print) -> dict:
    """Build (or reuse, in ``work_dir``) the assets, measure every row, ``emit`` the table; the figures."""
    dev = torch.device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    hbm_tbps = device_hbm_tbps(dev, hbm_tbps)
    owned = work_dir is None
    work_dir = work_dir or tempfile.mkdtemp(prefix="dflash-bench-eval-")
    try:
        target_dir = os.path.join(work_dir, f"target-{shape}")
        started = time.perf_counter()
        if not os.path.isfile(os.path.join(target_dir, "config.json")):
            logger.info("bench eval: building a random %s target in %s", shape, target_dir)
            build_random_target(target_dir, shape=shape, dtype=str(torch_dtype).removeprefix("torch."), seed=seed)
        build_s = time.perf_counter() - started
        model = bench_drafter(target_dir, shape, device=dev, dtype=torch_dtype, seed=seed)
        prompts = random_prompts(max(2, prompts_per_batch * max(batch_sizes), legacy_prompts), prompt_len, seed)
        rows = legacy_rows(target_dir, model, prompts[:legacy_prompts], max_new_tokens=max_new_tokens, device=dev,
                           dtype=dtype) if legacy_prompts else []
        target = BatchedTarget(target_dir, layer_ids=model.config.target_layer_ids, device=dev, dtype=dtype)
        rows += batched_rows(target, model, prompts, batch_sizes=batch_sizes, prompts_per_batch=prompts_per_batch,
                             max_new_tokens=max_new_tokens, compile=compile, repeats=repeats)
        weights = weight_bytes(target.model)
    finally:
        if owned:
            shutil.rmtree(work_dir, ignore_errors=True)
    figures = {"shape": shape, "device": str(dev), "dtype": str(torch_dtype).removeprefix("torch."),
               "num_target_layers": target.num_layers, "hidden_size": target.hidden_size,
               "vocab_size": target.head.vocab_size, "drafter_layers": model.config.num_hidden_layers,
               "block_size": model.config.block_size, "max_new_tokens": max_new_tokens, "prompt_len": list(prompt_len),
               "compile": compile, "repeats": repeats, "fused_groups": target.num_fused_groups, "matvec_linears": target.num_matvec_linears,
               "kernel_attention_layers": target.num_kernel_attention,
               "build_s": build_s, "total_s": time.perf_counter() - started, "goal": GOAL,
               "hbm_tbps": hbm_tbps, "weight_gib": weights / 2**30,
               "rows": [asdict(r) | {"tokens_per_s": r.tokens_per_s, "ms_per_forward": r.ms_per_forward}
                        for r in rows],
               "summary": summary(rows, bound_ms=1e3 * weights / (hbm_tbps * 1e12))}
    emit(format_table(figures))
    return figures


def format_table(f: dict) -> str:
    """The human-readable result of :func:`run_eval_bench`."""
    lines = [f"bench eval: {f['shape']}-shaped random target ({f['num_target_layers']} layers, hidden "
             f"{f['hidden_size']}, vocab {f['vocab_size']}), random drafter ({f['drafter_layers']} layers, block "
             f"{f['block_size']}), {f['dtype']} on {f['device']}",
             f"  prompts of {f['prompt_len'][0]}-{f['prompt_len'][1]} random tokens, {f['max_new_tokens']} new "
             "tokens each, greedy (random weights: tau ~1; the rows measure decoding, not drafting); decode "
             f"forward compile: {f.get('compile', 'off')}; {f.get('fused_groups', 0)} q|k|v, gate|up groups fused, "
             f"{f.get('matvec_linears', 0)} other linears through the few-row kernels, "
             f"{f.get('kernel_attention_layers', 0)} attention layers through the few-query kernel "
             "(decode/fused_projections.py, matvec.py, decode_attention.py)",
             f"  {'impl':<8} {'mode':<12} {'batch':>5} {'prompts':>7} {'tokens':>8} {'wall s':>8} {'tok/s':>10} "
             f"{'tau':>5} {'peak GiB':>8} {'ms/fwd':>7}"]
    for r in f["rows"]:
        if r["error"]:
            lines.append(f"  {r['impl']:<8} {r['mode']:<12} {r['batch_size']:>5} {r['num_prompts']:>7}  {r['error']}")
            continue
        tau = "-" if r["tau"] != r["tau"] else f"{r['tau']:.2f}"
        peak = "-" if r["peak_gib"] != r["peak_gib"] else f"{r['peak_gib']:.1f}"
        ms = "-" if r["ms_per_forward"] != r["ms_per_forward"] else f"{r['ms_per_forward']:.2f}"
        lines.append(f"  {r['impl']:<8} {r['mode']:<12} {r['batch_size']:>5} {r['num_prompts']:>7} "
                     f"{r['num_tokens']:>8} {r['wall_s']:>8.2f} {r['tokens_per_s']:>10,.1f} {tau:>5} {peak:>8} {ms:>7}")
    one = f["summary"].get("batch1")
    if one:
        lines.append(f"  batch 1: plain step {one['plain_ms_per_step']:.2f} ms against the weight-bandwidth bound "
                     f"{one['bound_ms_per_step']:.3f} ms ({f['weight_gib']:.2f} GiB at {f['hbm_tbps']:g} TB/s) = "
                     f"{100 * one['plain_of_bound']:.0f}% of the bound; speculative cycle (draft + verify) "
                     f"{one['spec_ms_per_cycle']:.2f} ms = {one['cycle_in_plain_steps']:.2f} plain steps "
                     f"(speedup = tau / {one['cycle_in_plain_steps']:.2f})")
        plain_runs, spec_runs = one.get("plain_ms_runs") or [], one.get("spec_ms_runs") or []
        if len(plain_runs) > 1 and len(spec_runs) > 1:
            lines.append(f"  batch 1, the median of {len(plain_runs)} timed runs each: plain {min(plain_runs):.2f}-"
                         f"{max(plain_runs):.2f} ms, cycle {min(spec_runs):.2f}-{max(spec_runs):.2f} ms, so the "
                         f"cycle is {min(spec_runs) / max(plain_runs):.2f}-{max(spec_runs) / min(plain_runs):.2f} "
                         "plain steps at the extremes")
    for mode, s in f["summary"].items():
        if mode == "batch1":
            continue
        one = "" if math.isnan(s["batch1_tokens_per_s"]) else f"{s['batch1_tokens_per_s']:,.1f} tok/s at batch 1, "
        best = f"  batched {mode}: {one}{s['best_tokens_per_s']:,.1f} tok/s at batch {s['best_batch_size']}"
        if math.isnan(s["vs_legacy"]):  # --legacy-prompts 0 (or the legacy row failed): nothing to compare with
            lines.append(f"{best} (no legacy row to compare with)")
            continue
        goal = f" (goal >= {f['goal']:g}x: {'met' if s['vs_legacy'] >= f['goal'] else 'not met'})" \
            if mode == "speculative" else ""
        lines.append(f"{best} = {s['vs_legacy']:.1f}x legacy {mode} ({s['legacy_tokens_per_s']:,.1f} tok/s){goal}")
    lines.append(f"  target build {f['build_s']:.1f} s, whole bench {f['total_s']:.1f} s")
    return "\n".join(lines)


def _pooled_tau(stats: list) -> float:
    """tau over every cycle of the runs (NaN when none ran a cycle)."""
    if not stats:
        return math.nan
    pooled = copy.deepcopy(stats[0])
    for other in stats[1:]:
        pooled.merge(other)
    return pooled.tau
