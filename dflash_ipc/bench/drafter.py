"""``dflash-ipc bench drafter``: step time, memory and MFU of one drafter training step.

The step is the real one: :class:`DrafterTrainer` ``take`` + ``step`` on random target
features (random weights, random token ids, loss mask all ones), a fresh set of sequences
every step, so anchors and the attention mask change every step as in training. The
mask is built inside the step; its time is also reported on its own.

Shapes (``shape=``): ``"qwen3-8b"`` is the issue's drafter (hidden 4096, 5 layers over
target layers [1, 9, 17, 25, 33] of a 36-layer Qwen3-8B, vocab 151,936); with the
defaults 4 sequences of 2,048 tokens, 512 anchors each, block 16 = 32,768 query tokens.
``"qwen3-1.7b"`` (hidden 2048, 5 layers, vocab 151,936) and ``"smollm2-135m"`` (a
135M-class target: hidden 576, 9/3 heads of 64, intermediate 1536, vocab 49,152, 3 layers
over a 30-layer target) are the small targets, at the same step sizes (2,048 anchors).
``"tiny"`` (hidden 64, 2 layers, vocab 512) runs the same code path on a CPU.

FLOP count (model FLOPs, matmuls only, 2*m*n*k each; norms, RoPE, softmax, SiLU, CE and
the optimizer are not counted). T = context tokens, Q = query (block) tokens, R = query
rows that carry loss (weight != 0: block position 0 never does, nor positions past the
sequence end; the CE skips the others), P = visible (query, key) pairs, H = hidden,
F = n_features*H, d_q = heads*head_dim, d_kv = kv_heads*head_dim, I = intermediate,
V = vocab, L = drafter layers. Forward:

    fc          2*T*F*H
    context_kv  L * 2*T*H*(2*d_kv)                 K, V projections of the context
    block_proj  L * 2*Q*H*(2*d_q + 2*d_kv)          Q, K, V, O of the block tokens
    attention   L * 4*P*d_q                         Q K^T and P V over visible pairs
    mlp         L * 2*Q*3*H*I                       gate, up, down
    lm_head     2*R*H*V                             frozen target LM head

Training = forward x factor: 3 (forward, input gradient, weight gradient) for every term
except ``fc``, 2 (its input, the target features, takes no gradient), and ``lm_head``,
2 (frozen: no weight gradient; the CE computes the input gradient in its forward).
Attention backward is counted as 2 forwards (dQ, dK, dV, dP), not the kernel's
recomputation of Q K^T. The context K/V projections do get an input gradient: it flows
into ``fc``. MFU uses P = visible pairs, exactly ``block_size * sum(anchor + block_size)``
over blocks (a query sees the ``anchor`` context keys before its anchor and its block's
``block_size`` keys). Also reported: the dense-equivalent count (P = Q*(T+Q), what a dense
masked attention computes) and the pairs inside the 128x128 tiles FlexAttention runs.
``DFlashDraftModel.flops_per_step`` counts ``fc`` x3 and leaves the LM head out; this
module is the reference. (DESIGN.md's 286 TFLOP counted fc x3 and the LM head over all Q.)

The matmul rate is measured in the same run: ``matmul_size``^3 bf16 matmuls (8192 for
qwen3-8b), 3 warmups, mean of 10. MFU = model FLOPs / step time / that rate, for every
precision (an fp8 run also reports the float8 ``torch._scaled_mm`` rate of the same size).

Precisions (``drafter.precision``, drafter/precision.py) and compile modes (``drafter.compile``
with an optional ``drafter.lm_head_chunk_gib``, ``MODE@GIB``): several variants in one run are
timed one after the other in the same process, each on a fresh trainer, and compared:
step time, tokens/s, peak memory, MFU and the speedup against the first.

Run manual::

    dflash-ipc bench drafter --device cuda:0 --steps 10
    dflash-ipc bench drafter --device cuda:0 --steps 10 --precision bf16,fp8
    dflash-ipc bench drafter --device cuda:0 --shape smollm2-135m --compile off@1.5,off,reduce-overhead
    python -c "from dflash_ipc.bench.drafter import run_drafter_bench; run_drafter_bench('cpu', 2, 'tiny', 16, 2, 128)"
"""

from __future__ import annotations

import collections
import gc
import logging
import os
import statistics
import time
import typing
from dataclasses import dataclass

import torch

from dflash_ipc.bench.host_profile import format_host_profile, profile_host
from dflash_ipc.bench.host_syncs import host_syncs
from dflash_ipc.bench.kernel_profile import format_profile, profile_kernels, summarize
from dflash_ipc.config.schema import Compile, Fp8HeadMatmuls, Fp8Recipe, JobConfig, Precision
from dflash_ipc.config.load import config_from_dict
from dflash_ipc.drafter.attention import FLEX_TILE, build_mask, flex_tile_flags
from dflash_ipc.drafter.model import DFlashConfig
from dflash_ipc.drafter.objective import TrainingBatch
from dflash_ipc.drafter.precision import reset_compiled_layers
from dflash_ipc.drafter.step_shape import pad_layout
from dflash_ipc.hf.target_head import FrozenTargetHead
from dflash_ipc.drafter.trainer import DrafterTrainer, Sequence, eligible_anchor_count
from dflash_ipc.errors import ConfigError
from dflash_ipc.run.compile_workers import compile_in_process

logger = logging.getLogger(__name__)

GIB = 1024**3
MATMUL_WARMUP = 3
MATMUL_ITERS = 10
# Training FLOPs per forward FLOP of each term (see the module docstring).
TRAIN_FACTOR = {"fc": 2, "context_kv": 3, "block_proj": 3, "attention": 3, "mlp": 3, "lm_head": 2}


@dataclass(frozen=True)
class BenchShape:
    """A target model shape (Qwen3Config fields) and the drafter built on it."""

    target: dict
    num_draft_layers: int
    matmul_size: int
    """Edge of the square bf16 matmul that measures the peak rate."""


SHAPES = {
    "qwen3-8b": BenchShape(
        target=dict(hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                    head_dim=128, intermediate_size=12288, vocab_size=151936, rope_theta=1e6,
                    max_position_embeddings=40960),
        num_draft_layers=5, matmul_size=8192),
    "qwen3-1.7b": BenchShape(
        target=dict(hidden_size=2048, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                    head_dim=128, intermediate_size=6144, vocab_size=151936, rope_theta=1e6,
                    max_position_embeddings=40960),
        num_draft_layers=5, matmul_size=8192),
    # A 135M-class target (SmolLM2-135M's widths as Qwen3 fields: the drafter is Qwen3-style
    # whatever the target): hidden 576, vocab 49,152, 3 drafter layers.
    "smollm2-135m": BenchShape(
        target=dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                    head_dim=64, intermediate_size=1536, vocab_size=49152, rope_theta=1e5,
                    max_position_embeddings=8192),
        num_draft_layers=3, matmul_size=8192),
    "tiny": BenchShape(
        target=dict(hidden_size=64, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=16, intermediate_size=128, vocab_size=512, rope_theta=1e6,
                    max_position_embeddings=4096),
        num_draft_layers=2, matmul_size=256),
}


def drafter_model_config(shape: str) -> DFlashConfig:
    """The drafter of a named shape, built from a transformers Qwen3Config like a real target's."""
    from transformers import Qwen3Config

    if shape not in SHAPES:
        raise ConfigError(f"bench drafter: shape {shape!r} is not one of {sorted(SHAPES)}")
    spec = SHAPES[shape]
    target = Qwen3Config(**spec.target)
    return DFlashConfig.from_target_config(target, num_draft_layers=spec.num_draft_layers,
                                           mask_token_id=spec.target["vocab_size"] - 1)


# --- FLOPs ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepCounts:
    """What one step computed over: token counts and attention pairs."""

    num_ctx: int  # T
    num_queries: int  # Q
    num_loss_rows: int  # R
    visible_pairs: int  # (query, key) pairs the mask allows
    dense_pairs: int  # Q * (T + Q)
    tile_pairs: int  # pairs inside the 128x128 tiles FlexAttention visits


def step_counts(batch: TrainingBatch, tile: int = FLEX_TILE) -> StepCounts:
    """Counts of a built training batch (any device; a few small reductions)."""
    layout = batch.layout
    q, t, bs = layout.num_queries, layout.num_ctx, layout.block_size
    anchors = layout.query_anchor[::bs].long()  # [blocks]
    visible = bs * int((anchors + bs).sum())
    partial, full = flex_tile_flags(layout, tile)  # [QT, KT]
    rows = (q - torch.arange(partial.shape[0], device=partial.device) * tile).clamp(max=tile)  # [QT]
    cols = (t + q - torch.arange(partial.shape[1], device=partial.device) * tile).clamp(max=tile)  # [KT]
    tiles = int((rows[:, None] * cols[None, :] * (partial | full)).sum())
    return StepCounts(num_ctx=t, num_queries=q, num_loss_rows=int(torch.count_nonzero(batch.weights)),
                      visible_pairs=visible, dense_pairs=q * (t + q), tile_pairs=tiles)


def forward_flops(config: DFlashConfig, *, num_ctx: int, num_queries: int, num_loss_rows: int,
                  attention_pairs: int) -> dict[str, int]:
    """Forward matmul FLOPs per term (module docstring); ``attention_pairs`` = P."""
    h, i, nl = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    d_q = config.num_attention_heads * config.head_dim
    d_kv = config.num_key_value_heads * config.head_dim
    f = config.num_context_features * h
    return {
        "fc": 2 * num_ctx * f * h,
        "context_kv": nl * 2 * num_ctx * h * (2 * d_kv),
        "block_proj": nl * 2 * num_queries * h * (2 * d_q + 2 * d_kv),
        "attention": nl * 4 * attention_pairs * d_q,
        "mlp": nl * 2 * num_queries * 3 * h * i,
        "lm_head": 2 * num_loss_rows * h * config.vocab_size,
    }


def training_flops(config: DFlashConfig, counts: StepCounts, *, pairs: str = "visible") -> dict[str, int]:
    """Forward + backward FLOPs per term and their ``total``; ``pairs``: visible, dense or tile."""
    if pairs not in ("visible", "dense", "tile"):
        raise ConfigError(f"training_flops: pairs={pairs!r} not one of visible, dense, tile")
    fwd = forward_flops(config, num_ctx=counts.num_ctx, num_queries=counts.num_queries,
                        num_loss_rows=counts.num_loss_rows,
                        attention_pairs=getattr(counts, f"{pairs}_pairs"))
    out = {name: TRAIN_FACTOR[name] * value for name, value in fwd.items()}
    out["total"] = sum(out.values())
    return out


# --- measurements ---------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_rate(device: torch.device, size: int, *, fp8: bool = False, warmup: int = MATMUL_WARMUP,
                iters: int = MATMUL_ITERS) -> float:
    """Mean ``size^3`` matmul rate in TFLOP/s over ``iters`` back-to-back matmuls: bf16, or
    float8 e4m3 through ``torch._scaled_mm`` with tensorwise scales (CUDA only)."""
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16, generator=gen)
    b = torch.randn(size, size, device=device, dtype=torch.bfloat16, generator=gen)
    out = torch.empty(size, size, device=device, dtype=torch.bfloat16)
    if fp8:
        a8, b8 = a.to(torch.float8_e4m3fn), b.t().contiguous().to(torch.float8_e4m3fn).t()  # b column-major
        one = torch.ones((), device=device)

        def matmul() -> None:
            torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    else:
        def matmul() -> None:
            torch.matmul(a, b, out=out)
    for _ in range(warmup):
        matmul()
    _sync(device)
    started = time.perf_counter()
    for _ in range(iters):
        matmul()
    _sync(device)
    seconds = (time.perf_counter() - started) / iters
    return 2 * size**3 / seconds / 1e12


def random_head(config: DFlashConfig, device: torch.device, gen: torch.Generator) -> FrozenTargetHead:
    """Untied random bf16 embedding and LM head of the target's vocabulary ``[V, H]``."""
    shape = (config.vocab_size, config.hidden_size)
    embed = torch.randn(shape, device=device, dtype=torch.bfloat16, generator=gen).mul_(0.02)
    head = torch.randn(shape, device=device, dtype=torch.bfloat16, generator=gen).mul_(0.02)
    return FrozenTargetHead(embed, head)


def random_sequences(config: DFlashConfig, *, step: int, num_seqs: int, seq_len: int, max_anchors: int,
                     device: torch.device, gen: torch.Generator, cpu_gen: torch.Generator,
                     ragged: bool = False) -> list[Sequence]:
    """Fresh sequences as a drafter worker holds them: features on the device, ids on the host.
    ``ragged``: each of its own length, uniform in [seq_len/4, seq_len] (the context length then
    changes every step, as in training; the anchors stay ``max_anchors`` while it fits)."""
    width = config.num_context_features * config.hidden_size
    out = []
    lengths = (torch.randint(max(2, seq_len // 4), seq_len + 1, (num_seqs,), generator=cpu_gen).tolist() if ragged
               else [seq_len] * num_seqs)
    for i, length in enumerate(lengths):
        loss_mask = torch.ones(length, dtype=torch.bool)
        out.append(Sequence(
            batch_id=step, epoch=0, sample_id=step * num_seqs + i,  # new ids: new anchors each step
            features=torch.randn(length, width, device=device, dtype=torch.bfloat16, generator=gen),  # [L, F]
            input_ids=torch.randint(0, config.vocab_size, (length,), generator=cpu_gen),  # [L]
            loss_mask=loss_mask,
            num_anchors=eligible_anchor_count(loss_mask.numpy(), max_anchors)))
    return out


class _RecordingTrainer(DrafterTrainer):
    """The real trainer, keeping its last step's real batch (no padding rows, no filler blocks:
    what the FLOP and token counts count) and the layout the step ran (its mask is timed)."""

    last_batch: TrainingBatch | None = None
    last_layout = None

    def _batch(self, chosen):
        self.last_batch = super()._batch(chosen)
        return self.last_batch

    def _build(self, chosen):
        built = super()._build(chosen)
        if built[0] is not None:
            self.last_layout = pad_layout(built[0].layout, built[1].shape[0])
        return built


def compile_counts() -> dict[str, int]:
    """torch.compile's process-wide counters (torch._dynamo.utils.counters): frames compiled
    (each recompile is one), graphs, graph breaks, and CUDA graphs inductor skipped."""
    from torch._dynamo.utils import counters
    return {"frames": int(counters["frames"]["ok"]), "graphs": int(counters["stats"]["unique_graphs"]),
            "graph_breaks": int(sum(counters["graph_break"].values())),
            "cudagraph_skips": int(sum(counters["inductor"][k] for k in counters["inductor"] if "cudagraph_skip" in k))}


def _counts_since(before: dict[str, int]) -> dict[str, int]:
    now = compile_counts()
    return {k: now[k] - before[k] for k in now}


def _mask_seconds(layout, backend: str, device: torch.device) -> float:
    """Mask construction to completion on the device (the trainer's in-step clock is host-side)."""
    _sync(device)
    started = time.perf_counter()
    mask = build_mask(layout, backend)
    _sync(device)
    del mask
    return time.perf_counter() - started


# --- the benchmark --------------------------------------------------------------------------


def _resolve_device(device: str) -> torch.device:
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"bench drafter: device {device!r} asked but CUDA is not available; use --device cpu")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(dev)  # compiled kernels launch on the current device
    elif dev.type != "cpu":
        raise ConfigError(f"bench drafter: device {device!r} is not 'cpu' or 'cuda:N'")
    return dev


def _check_sizes(steps: int, warmup: int, anchors_per_seq: int, num_seqs: int, seq_len: int) -> None:
    for name, value, low in (("steps", steps, 1), ("warmup", warmup, 0), ("anchors_per_seq", anchors_per_seq, 1),
                             ("num_seqs", num_seqs, 1), ("seq_len", seq_len, 2)):
        if value < low:
            raise ConfigError(f"bench drafter: {name}={value} must be >= {low}")
    if anchors_per_seq > seq_len - 1:  # anchors need a loss position after them
        raise ConfigError(f"bench drafter: anchors_per_seq={anchors_per_seq} must be <= seq_len-1={seq_len - 1}")


def _one_step(trainer: _RecordingTrainer, seqs: list[Sequence], device: torch.device) -> dict:
    """One timed training step, then (untimed) its counts and a synchronized mask re-build."""
    chosen = trainer.take(collections.deque(seqs))
    _sync(device)  # the features were generated asynchronously: not this step's time
    started = time.perf_counter()
    result = trainer.step(chosen)
    _sync(device)
    wall_s = time.perf_counter() - started
    batch, layout, trainer.last_batch, trainer.last_layout = trainer.last_batch, trainer.last_layout, None, None
    return {"step_s": wall_s, "mask_in_step_s": result["mask_s"], "loss": result["loss"],
            "anchors": result["anchors"], "counts": step_counts(batch),
            "mask_s": _mask_seconds(layout.to(device), trainer.backend, device)}


# --- precision variants -------------------------------------------------------------------------


def parse_compile_spec(spec: str) -> dict:
    """``MODE[@GIB]`` -> drafter fields: ``drafter.compile`` MODE, and ``lm_head_chunk_gib`` GIB
    when given (e.g. ``off@1.5``: compile off, 1.5 GiB LM-head chunks). ConfigError if bad."""
    mode, _, gib = spec.partition("@")
    allowed = typing.get_args(Compile)
    if mode not in allowed:
        raise ConfigError(f"bench: compile {spec!r}: mode {mode!r} not allowed; allowed: {', '.join(allowed)} "
                          f"(optionally @GIB, the LM-head chunk memory)")
    out: dict = {"compile": mode}
    if gib:
        try:
            out["lm_head_chunk_gib"] = float(gib)
        except ValueError:
            raise ConfigError(f"bench: compile {spec!r}: {gib!r} after '@' is not a number of GiB") from None
    return out


def precision_variants(precisions: typing.Sequence[str], recipes: typing.Sequence[str] = ("tensorwise",),
                       lm_heads: typing.Sequence[str] = ("all",), compiles: typing.Sequence[str] = ("off",),
                       shared_casts: typing.Sequence[str] = ("off",),
                       layers: typing.Sequence[str] = ("on",)) -> list[dict]:
    """The ``drafter`` config fields of each variant to compare, in order: bf16 once per
    ``compiles`` spec (``parse_compile_spec``), fp8 once per (recipe, LM-head choice, shared
    casts on/off, layers on/off, spec); layers off with shared casts on (nothing to share) or
    with the head's matmuls none (nothing in float8) is left out. ConfigError for a name not
    allowed."""
    for name, given, hint in (("precision", precisions, Precision), ("fp8 recipe", recipes, Fp8Recipe),
                              ("fp8 LM head", lm_heads, Fp8HeadMatmuls),
                              ("fp8 shared casts", shared_casts, typing.Literal["on", "off"]),
                              ("fp8 layers", layers, typing.Literal["on", "off"])):
        allowed = typing.get_args(hint)
        bad = [g for g in given if g not in allowed]
        if bad or not given:
            raise ConfigError(f"bench: {name} {', '.join(bad) or '(none)'} not allowed; allowed: {', '.join(allowed)}")
    specs = [parse_compile_spec(c) for c in compiles]
    if not specs:
        raise ConfigError("bench: compile (none) not allowed; give at least one mode, e.g. off")
    out = []
    for precision in precisions:
        if precision == "bf16":
            out += [{"precision": "bf16", **spec} for spec in specs]
        else:
            out += [{"precision": precision, "fp8_recipe": r, "fp8_lm_head": h, **spec,
                     **({"fp8_shared_casts": True} if shared == "on" else {}),
                     **({"fp8_layers": False} if layer == "off" else {})}
                    for spec in specs for r in recipes for h in lm_heads for shared in shared_casts
                    for layer in layers if layer == "on" or (shared == "off" and h != "none")]
    return out


def variant_label(variant: dict) -> str:
    extra = "".join([f", compile {variant['compile']}" if variant.get("compile", "off") != "off" else "",
                     f", chunks {variant['lm_head_chunk_gib']:g} GiB" if variant.get("lm_head_chunk_gib") else ""])
    if variant["precision"] == "bf16":
        return "bf16" + extra
    recipe, lm_head = variant.get("fp8_recipe", "tensorwise"), variant.get("fp8_lm_head", "all")
    casts = ", shared casts" if variant.get("fp8_shared_casts", False) else ""
    layers = ", layers bf16" if not variant.get("fp8_layers", True) else ""
    return f"{variant['precision']} {recipe}, lm_head {lm_head}{casts}{layers}{extra}"


PAPER_RECIPE = {"objective": {"weighting": "decay"}, "optimizer": {"name": "adamw"}, "schedule": {"name": "cosine"}}
"""The step the bench times: the DFlash paper's recipe, whose FLOPs `training_flops` counts and
whose figures docs/benchmarks.md gives (D-PACE's per-row CE and Muon's update cost more per
step: bench precision's "step ms" column measures them)."""


def bench_job_config(device: torch.device, *, drafter: dict | None = None, **sections: dict) -> JobConfig:
    """The config of a one-drafter job on ``device`` under the paper's recipe (targets on the same
    kind of device: a job config refuses to mix CPU and CUDA workers)."""
    merged = {name: {**part, **sections.get(name, {})} for name, part in PAPER_RECIPE.items()}
    return config_from_dict({"target": {"devices": [str(device)]},
                             "drafter": {"num_workers": 1, "devices": [str(device)], "dtype": "bfloat16",
                                         "attention": "auto", **(drafter or {})}, **sections, **merged})


def run_drafter_bench(device: str = "cuda:0", steps: int = 10, shape: str = "qwen3-8b", anchors_per_seq: int = 512,
                      num_seqs: int = 4, seq_len: int = 2048, warmup: int = 3,
                      variant: dict | None = None, profile_steps: int = 0, ragged: bool = False,
                      host_profile_steps: int = 0, gc_freeze: bool = False) -> dict:
    """Time ``steps`` real drafter training steps after ``warmup`` untimed ones; print and return figures.

    Every step trains on ``num_seqs`` fresh random sequences of ``seq_len`` tokens with
    ``anchors_per_seq`` anchors each (``num_seqs * anchors_per_seq * block_size`` queries).
    ``variant``: ``drafter`` config fields of the precision (default bf16; precision_variants).
    ``profile_steps``: that many more steps under the torch profiler, then the kernel time per
    step by kind (bench/kernel_profile.py; CUDA only). ``host_profile_steps``: that many more
    under cProfile and a garbage-collector clock, the host's time per step by function
    (bench/host_profile.py; any device). ``gc_freeze``: after the warm-up steps one full collection,
    then ``gc.freeze()``, so the collector's later passes skip every object the compile left (the
    heap is unfrozen before returning). ``ragged``: sequence lengths vary
    (``random_sequences``). Each step's torch.compile work is counted (``compile_counts``): a
    timed step that compiled is named in the report, and the mean without such steps given.
    """
    _check_sizes(steps, warmup, anchors_per_seq, num_seqs, seq_len)
    compile_in_process()  # as the drafter worker does (run/compile_workers.py)
    variant = variant or {"precision": "bf16"}
    dev = _resolve_device(device)
    if profile_steps < 0 or (profile_steps and dev.type != "cuda"):
        raise ConfigError(f"bench drafter: --profile {profile_steps}: profiles CUDA kernels, so it needs "
                          f"a count >= 0 and a CUDA --device (got {dev})")
    config = drafter_model_config(shape)
    size = SHAPES[shape].matmul_size
    rate = matmul_rate(dev, size)
    fp8_rate = matmul_rate(dev, size, fp8=True) if variant["precision"] == "fp8" and dev.type == "cuda" else None
    gen = torch.Generator(device=dev).manual_seed(1)
    cpu_gen = torch.Generator().manual_seed(2)
    cfg = bench_job_config(dev, drafter=variant,
                           model={"num_layers": config.num_hidden_layers, "block_size": config.block_size},
                           objective={"max_anchors_per_seq": anchors_per_seq,
                                      "anchors_per_step": num_seqs * anchors_per_seq})
    trainer = _RecordingTrainer(cfg, config, random_head(config, dev, gen), device=str(dev),
                                total_steps=warmup + 2 * steps + 1 + profile_steps + host_profile_steps)
    logger.info("bench drafter: %s on %s, %s, %s attention, %d warmup + %d steps", shape, dev,
                variant_label(variant), trainer.backend, warmup, steps)
    frozen = None  # freeze_heap's figures, once the heap is frozen
    try:
        warm, timed = [], []
        for i in range(warmup + steps):
            # The first step is the heaviest (every sequence seq_len long, ragged or not), as a job's
            # start-up probe (drafter/fit.py) runs first: CUDA graphs are recorded at the longest
            # context before any step is timed (step_shape.StepRows).
            seqs = random_sequences(config, step=i, num_seqs=num_seqs, seq_len=seq_len, max_anchors=anchors_per_seq,
                                    device=dev, gen=gen, cpu_gen=cpu_gen, ragged=ragged and i > 0)
            if i == warmup and gc_freeze:
                frozen = freeze_heap()
            if i == warmup and dev.type == "cuda":
                torch.cuda.reset_peak_memory_stats(dev)
            before = compile_counts()
            record = _one_step(trainer, seqs, dev)
            record["compiled"] = _counts_since(before)
            del seqs
            (warm if i < warmup else timed).append(record)
            logger.info("step %d%s: %.1f ms, %d context tokens, loss %.3f%s", i, " (warmup)" if i < warmup else "",
                        record["step_s"] * 1e3, record["counts"].num_ctx, record["loss"],
                        f", compiled {record['compiled']['frames']} frame(s)" if record["compiled"]["frames"] else "")
        peak = torch.cuda.max_memory_allocated(dev) / GIB if dev.type == "cuda" else None
        figures = _figures(trainer, config, shape, dev, rate, warm, timed, peak,
                           num_seqs=num_seqs, seq_len=seq_len, anchors_per_seq=anchors_per_seq)
        figures.update(precision=variant_label(variant), variant=dict(variant), fp8_matmul_tflops=fp8_rate,
                       ragged=ragged, compile_mode=cfg.drafter.compile, compile_active=trainer.drafter_forward.enabled,
                       compile_failure=trainer.drafter_forward.failure, lm_head_chunk_rows=trainer.ce_chunk_rows,
                       gc_frozen=frozen)
        figures.update(_pipelined_figures(trainer, config, dev, gen, cpu_gen, steps, first=warmup + steps,
                                          flops=figures["flops_per_step"], rate=rate, num_seqs=num_seqs,
                                          seq_len=seq_len, anchors_per_seq=anchors_per_seq, ragged=ragged))
        print(format_report(figures), flush=True)
        if profile_steps:
            figures["kernel_profile"] = _profile(trainer, config, dev, gen, cpu_gen, profile_steps,
                                                 first=warmup + 2 * steps + 1, num_seqs=num_seqs, seq_len=seq_len,
                                                 anchors_per_seq=anchors_per_seq, ragged=ragged)
            print(format_profile(figures["kernel_profile"], label=variant_label(variant),
                                 wall_ms=figures["step_s_mean"] * 1e3), flush=True)
        if host_profile_steps:
            first = warmup + 2 * steps + 1 + profile_steps
            figures["host_profile"] = _host_profile(trainer, config, dev, gen, cpu_gen, host_profile_steps, first=first,
                                                    num_seqs=num_seqs, seq_len=seq_len, anchors_per_seq=anchors_per_seq,
                                                    ragged=ragged)
            print(format_host_profile(figures["host_profile"], label=variant_label(variant)), flush=True)
        return figures
    finally:
        if frozen is not None:  # the caller's process is not left frozen, whatever happened
            gc.unfreeze()


def freeze_heap() -> dict:
    """One full collection, then every object left moved where the collector no longer looks
    (``gc.freeze``): how many, and the collection's ms (a freshly compiled process holds some
    hundreds of thousands of objects, which every full pass walks)."""
    started = time.perf_counter()
    gc.collect()
    collect_ms = (time.perf_counter() - started) * 1e3
    gc.freeze()
    return {"objects": gc.get_freeze_count(), "collect_ms": collect_ms}


def _pipelined_figures(trainer, config, dev, gen, cpu_gen, steps: int, *, first: int, flops: float, rate: float,
                       num_seqs: int, seq_len: int, anchors_per_seq: int, ragged: bool) -> dict:
    """``steps`` more steps as the drafter loop runs them on a GPU: each launched, then the
    previous one's figures read (drafter/launched_step.py); their mean wall time, MFU (the
    timed steps' FLOPs) and, on CUDA, the host syncs of one more launched step."""
    inputs = [random_sequences(config, step=first + i, num_seqs=num_seqs, seq_len=seq_len,
                               max_anchors=anchors_per_seq, device=dev, gen=gen, cpu_gen=cpu_gen, ragged=ragged)
              for i in range(steps + 1)]
    _sync(dev)
    started, previous = time.perf_counter(), None
    marks = [started]  # when each step's figures were in: its wall time is the gap to the last
    for seqs in inputs[:steps]:
        launched = trainer.launch(trainer.take(collections.deque(seqs)))
        if previous is not None:
            previous.result()
            marks.append(time.perf_counter())
        previous = launched
    previous.result()
    _sync(dev)
    marks.append(time.perf_counter())
    mean_s = (marks[-1] - started) / steps
    gaps = [b - a for a, b in zip(marks, marks[1:])]
    out = {"pipelined_step_s_mean": mean_s, "pipelined_mfu": flops / mean_s / 1e12 / rate,
           # the first gap holds two launches and one step, the last only a wait: the middle ones are steps
           "pipelined_step_s_range": (min(gaps[1:-1] or gaps), max(gaps[1:-1] or gaps))}
    if dev.type == "cuda":
        out["host_syncs"] = host_syncs(lambda: trainer.launch(trainer.take(collections.deque(inputs[-1]))).result())
    return out


def _step_runner(trainer, config, dev, gen, cpu_gen, steps: int, *, first: int, num_seqs: int, seq_len: int,
                 anchors_per_seq: int, ragged: bool, sync: bool = False) -> typing.Callable[[], None]:
    """One more step per call, ``steps`` calls, their inputs made now (so a profile of the calls
    sees the steps alone); ``sync``: each call waits for its step's device work."""
    inputs = [random_sequences(config, step=first + i, num_seqs=num_seqs, seq_len=seq_len,
                               max_anchors=anchors_per_seq, device=dev, gen=gen, cpu_gen=cpu_gen, ragged=ragged)
              for i in range(steps)]

    def run_step() -> None:
        trainer.step(trainer.take(collections.deque(inputs.pop(0))))
        if sync:
            _sync(dev)

    return run_step


PROFILE_TOP = 24
"""The costliest kernels --profile lists by name (an fp8 step's scaling is spread over many)."""


def _profile(trainer, config, dev, gen, cpu_gen, steps: int, **sizes) -> dict:
    """Kernel time per step by kind over ``steps`` more steps."""
    run_step = _step_runner(trainer, config, dev, gen, cpu_gen, steps, **sizes)
    return summarize(profile_kernels(run_step, steps), steps=steps, top=PROFILE_TOP)


def _host_profile(trainer, config, dev, gen, cpu_gen, steps: int, **sizes) -> dict:
    """The host's time per step by function over ``steps`` more synchronised steps."""
    run_step = _step_runner(trainer, config, dev, gen, cpu_gen, steps, sync=True, **sizes)
    _sync(dev)
    return profile_host(run_step, steps)


def compare_precisions(device: str = "cuda:0", steps: int = 10, shape: str = "qwen3-8b",
                       variants: typing.Sequence[dict] = ({"precision": "bf16"},), **sizes) -> list[dict]:
    """:func:`run_drafter_bench` for each variant, one after the other in this process (each
    trainer freed before the next is built), then the comparison against the first."""
    results = []
    for variant in variants:
        results.append(run_drafter_bench(device, steps, shape, variant=variant, **sizes))
        if variant["precision"] == "fp8":  # its float8 graphs are no use to the next model
            reset_compiled_layers()
        elif variant.get("compile", "off") != "off":
            # the graphs guard on this model: the next model would recompile them, counting
            # against dynamo's recompile limit, and CUDA graphs keep their memory pool
            torch._dynamo.reset()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    if len(results) > 1:
        print(format_comparison(results), flush=True)
    return results


def format_comparison(results: list[dict]) -> str:
    """One line per variant: step time, tokens/s, peak memory, speedup against the first."""
    base = results[0]
    lines = [f"comparison: {base['shape']} on {base['device']}, one run, speedup = step time of "
             f"{base['precision']} / step time",
             f"  {'variant':<46} {'step ms':>8} {'pipelined':>9} {'query tok/s':>12} {'context tok/s':>14} "
             f"{'peak GiB':>9} {'MFU':>6} {'speedup':>8}  compiled in timed steps"]
    for f in results:
        peak = f"{f['peak_memory_gib']:.1f}" if f["peak_memory_gib"] is not None else "n/a"
        label = f["precision"] + ("" if f.get("compile_active", True) or f.get("compile_mode", "off") == "off"
                                  else " (fell back to eager)" if f.get("compile_failure") else " (eager: CUDA only)")
        compiled = f.get("timed_steps_compiling") or "none"  # a compile in a timed step inflates its mean
        pipelined = f"{f['pipelined_step_s_mean'] * 1e3:.1f}" if "pipelined_step_s_mean" in f else "n/a"
        lines.append(f"  {label:<46} {f['step_s_mean'] * 1e3:>8.1f} {pipelined:>9} {f['query_tokens_per_s']:>12,.0f} "
                     f"{f['context_tokens_per_s']:>14,.0f} {peak:>9} {f.get('mfu', float('nan')) * 100:>5.1f}% "
                     f"{base['step_s_mean'] / f['step_s_mean']:>7.2f}x  {compiled}")
    return "\n".join(lines)


def _mean_flops(config: DFlashConfig, timed: list[dict], pairs: str) -> dict[str, float]:
    per_step = [training_flops(config, r["counts"], pairs=pairs) for r in timed]
    return {name: statistics.fmean(f[name] for f in per_step) for name in per_step[0]}


def _compile_figures(warm: list[dict], timed: list[dict]) -> dict:
    """torch.compile's work in the warmup and in the timed steps, and the timed mean without
    the steps that compiled (None when every timed step compiled)."""
    def total(records):
        return {k: sum(r["compiled"][k] for r in records) for k in compile_counts()}
    clean = [r["step_s"] for r in timed if not r["compiled"]["frames"]]
    return {"compiles_warmup": total(warm), "compiles_timed": total(timed),
            "timed_steps_compiling": [i for i, r in enumerate(timed) if r["compiled"]["frames"]],
            "step_s_mean_no_compile": statistics.fmean(clean) if clean else None}


def _figures(trainer, config, shape, dev, rate, warm, timed, peak, *, num_seqs, seq_len, anchors_per_seq) -> dict:
    step_s = [r["step_s"] for r in timed]
    mean_s = statistics.fmean(step_s)
    counts = timed[-1]["counts"]
    flops = _mean_flops(config, timed, "visible")
    dense = _mean_flops(config, timed, "dense")["total"]
    tile = _mean_flops(config, timed, "tile")["total"]
    achieved = flops["total"] / mean_s / 1e12
    return {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "shape": shape, "attention": trainer.backend, "torch": torch.__version__,
        "trainable_params": sum(p.numel() for p in trainer.model.parameters() if p.requires_grad),
        "num_layers": config.num_hidden_layers, "hidden_size": config.hidden_size, "vocab_size": config.vocab_size,
        "target_layer_ids": list(config.target_layer_ids), "block_size": config.block_size,
        "num_seqs": num_seqs, "seq_len": seq_len, "anchors_per_seq": anchors_per_seq,
        "anchors_per_step": timed[-1]["anchors"], "num_queries": counts.num_queries, "num_ctx": counts.num_ctx,
        "num_loss_rows_mean": statistics.fmean(r["counts"].num_loss_rows for r in timed),
        "steps": len(timed), "warmup_step_s": [r["step_s"] for r in warm],
        "step_s_mean": mean_s, "step_s_min": min(step_s), "step_s_max": max(step_s),
        "mask_s_mean": statistics.fmean(r["mask_s"] for r in timed),
        "mask_in_step_s_mean": statistics.fmean(r["mask_in_step_s"] for r in timed),
        "sequences_per_s": num_seqs / mean_s, "query_tokens_per_s": counts.num_queries / mean_s,
        "context_tokens_per_s": counts.num_ctx / mean_s,
        "peak_memory_gib": peak, "loss_last": timed[-1]["loss"],
        "matmul_tflops": rate, "matmul_size": SHAPES[shape].matmul_size,
        "flops_per_step": flops["total"], "flops_breakdown": {k: v for k, v in flops.items() if k != "total"},
        "flops_dense_per_step": dense, "flops_tile_per_step": tile,
        "tflops": achieved, "mfu": achieved / rate, "mfu_dense": dense / mean_s / 1e12 / rate,
        "num_ctx_min": min(r["counts"].num_ctx for r in timed), "num_ctx_max": max(r["counts"].num_ctx for r in timed),
        **_compile_figures(warm, timed),
    }


def _flop_str(value: float) -> str:
    for unit, scale in (("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if value >= scale:
            return f"{value / scale:,.2f} {unit}"
    return f"{value:,.0f} FLOP"


def _count_str(n: int) -> str:
    return f"{n / 1e9:.3f} B" if n >= 1e9 else f"{n / 1e6:.3f} M"


def _lengths_str(f: dict) -> str:
    return f"{f['seq_len'] // 4}..{f['seq_len']} (ragged)" if f.get("ragged") else str(f["seq_len"])


def _ctx_str(f: dict) -> str:
    lo, hi = f.get("num_ctx_min", f["num_ctx"]), f.get("num_ctx_max", f["num_ctx"])
    return f"{lo:,}" if lo == hi else f"{lo:,}..{hi:,}"


def _setup_lines(f: dict) -> list[str]:
    """drafter.compile (and whether it still runs), the LM-head chunking, torch.compile's work."""
    if "compiles_timed" not in f:
        return []
    mode = f["compile_mode"]
    state = "" if mode == "off" else " (active)" if f["compile_active"] else (
        f" (FELL BACK TO EAGER: {f['compile_failure']})" if f["compile_failure"] else " (eager: CUDA only)")
    warm, timed = f["compiles_warmup"], f["compiles_timed"]
    clean = f["step_s_mean_no_compile"]
    without = "" if not f["timed_steps_compiling"] else (
        f"; timed steps {f['timed_steps_compiling']} compiled, mean without them "
        + (f"{clean * 1e3:.1f} ms" if clean is not None else "n/a"))
    return [f"  setup         drafter.compile={mode}{state}; LM head + CE in chunks of <= {f['lm_head_chunk_rows']:,} rows",
            f"  torch.compile warmup {warm['frames']} frames / {warm['graphs']} graphs compiled, timed steps "
            f"{timed['frames']} frames / {timed['graphs']} graphs; graph breaks {warm['graph_breaks'] + timed['graph_breaks']}, "
            f"cudagraph skips {warm['cudagraph_skips'] + timed['cudagraph_skips']}{without}"] + (
        [f"  collector     heap frozen after the warm-up steps: {f['gc_frozen']['objects']:,} objects "
         f"(their full collection took {f['gc_frozen']['collect_ms']:.0f} ms)"] if f.get("gc_frozen") else [])


def _pipelined_lines(f: dict) -> list[str]:
    if "pipelined_step_s_mean" not in f:
        return []
    lines = [f"  pipelined     mean {f['pipelined_step_s_mean'] * 1e3:.1f} ms, MFU {f['pipelined_mfu'] * 100:.1f}% over "
             f"{f['steps']} more steps launched back to back (each step's figures read after the next is queued, "
             f"as the drafter loop runs on a GPU)"]
    if "pipelined_step_s_range" in f:
        low, high = f["pipelined_step_s_range"]
        lines[0] += f"; one step {low * 1e3:.1f}..{high * 1e3:.1f} ms"
    if "host_syncs" in f:
        syncs = f["host_syncs"]
        where = ", ".join(f"{k} x{v}" for k, v in sorted(syncs.items(), key=lambda kv: -kv[1])) or "none"
        lines.append(f"  host syncs    {sum(syncs.values())} in one launched step and its read: {where}")
    return lines


def format_report(f: dict) -> str:
    """The human-readable report of :func:`run_drafter_bench`'s figures."""
    ms = 1e3
    memory = f"{f['peak_memory_gib']:.1f} GiB (torch.cuda.max_memory_allocated)" if f["peak_memory_gib"] is not None \
        else "n/a on CPU"
    parts = ", ".join(f"{name} {_flop_str(v)}" for name, v in f["flops_breakdown"].items())
    warm = ", ".join(f"{s:.2f} s" for s in f["warmup_step_s"]) or "none"
    fp8_rate = f.get("fp8_matmul_tflops")
    fp8_line = [f"                float8 e4m3 matmul {_flop_str(fp8_rate * 1e12)}/s ({f['matmul_size']}^3, "
                f"torch._scaled_mm, same run)"] if fp8_rate else []
    return "\n".join([
        f"drafter step benchmark: {f['shape']} on {f['device']}, torch {f['torch']}, {f['attention']} attention, "
        f"{f.get('precision', 'bf16')}",
        *_setup_lines(f),
        f"  drafter       {f['num_layers']} layers, hidden {f['hidden_size']}, vocab {f['vocab_size']}, "
        f"{_count_str(f['trainable_params'])} trainable params, target layers {f['target_layer_ids']}",
        f"  step          {f['num_seqs']} seqs x {_lengths_str(f)} tokens, {f['anchors_per_seq']} anchors/seq, "
        f"block {f['block_size']}: {f['num_queries']:,} query tokens, {_ctx_str(f)} context tokens",
        f"  step time     mean {f['step_s_mean'] * ms:.1f} ms, min {f['step_s_min'] * ms:.1f} ms, "
        f"max {f['step_s_max'] * ms:.1f} ms over {f['steps']} steps (warmup steps: {warm})",
        *_pipelined_lines(f),
        f"  mask build    {f['mask_s_mean'] * ms:.2f} ms (synchronized re-build of each step's mask); "
        f"trainer's in-step clock {f['mask_in_step_s_mean'] * ms:.2f} ms",
        f"  throughput    {f['sequences_per_s']:,.2f} seq/s, {f['query_tokens_per_s']:,.0f} query tok/s, "
        f"{f['context_tokens_per_s']:,.0f} context tok/s",
        f"  peak memory   {memory}",
        f"  model FLOPs   {_flop_str(f['flops_per_step'])}/step over visible attention pairs "
        f"(dense-equivalent {_flop_str(f['flops_dense_per_step'])}, "
        f"in flex tiles {_flop_str(f['flops_tile_per_step'])})",
        f"                {parts}",
        f"  rate          {_flop_str(f['tflops'] * 1e12)}/s vs bf16 matmul {_flop_str(f['matmul_tflops'] * 1e12)}/s "
        f"({f['matmul_size']}^3, same run)",
        *fp8_line,
        f"  MFU           {f['mfu'] * 100:.1f}% (visible-pairs FLOPs; dense-equivalent would read "
        f"{f['mfu_dense'] * 100:.1f}%)",
        f"  loss          {f['loss_last']:.3f} (last step; random data)",
    ])
