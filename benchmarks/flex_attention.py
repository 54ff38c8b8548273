"""The drafter's FlexAttention (forward + backward) at the bench shapes, compiled several ways:
how much of a training step's attention time is the kernel configuration's.

    python -m benchmarks.flex_attention [qwen3-8b smollm2-135m ...] [--steps 10] [--variants a,b]   # CUDA

For each drafter shape of `dflash-ipc bench drafter` (4 sequences of 2,048 tokens, 512 random
anchors each: 32,768 block queries over 8,192 context keys), the step's real block mask
(drafter/attention.py's `flex_block_mask`) and bf16 q/k/v of the shape's heads, it times one
forward and backward of ``flex_attention`` (ms, between CUDA events, after two untimed calls)
compiled

* ``dynamic``: compiled as the trainer compiles it (`attention.FLEX_COMPILE_OPTIONS`: shapes
  dynamic), inductor's default kernel options;
* ``trainer``: the same with the kernel options the trainer passes (`attention.flex_kernel_options`:
  ``IS_DIVISIBLE``, and this GPU's tiles of `attention.FLEX_TILES`);
* ``static``: shapes static (a graph per shape: the kernel may assume 128-divisible lengths);
* ``autotune``: shapes dynamic, ``mode="max-autotune-no-cudagraphs"`` (inductor times its
  candidate tile configurations for the forward and the backward and keeps the fastest);
* ``opts:...``: shapes dynamic with explicit ``kernel_options`` (`OPTIONS` below);

with the compile seconds of each, and the attention TFLOP/s over the visible pairs (4 * pairs *
head_dim per head forward, x 3 with the backward: the count of bench drafter's MFU).
"""

from __future__ import annotations

import argparse
import time

import torch

from dflash_ipc.bench import drafter as bd
from dflash_ipc.drafter import attention as att
from dflash_ipc.drafter.objective import anchor_generator, build_training_batch, sample_anchors

def _fwd(m: int, n: int, warps: int = 4, stages: int = 3) -> dict:
    """Forward tiles (BLOCK_M x BLOCK_N), warps and stages, for the forward pass only."""
    return {"fwd_BLOCK_M": m, "fwd_BLOCK_N": n, "fwd_num_warps": warps, "fwd_num_stages": stages}


def _bwd(m1: int, n1: int, warps: int = 4, stages: int = 3) -> dict:
    """Backward tiles (BLOCK_M1 x BLOCK_N1 for dK/dV, the transpose for dQ), for the backward only."""
    return {"bwd_BLOCK_M1": m1, "bwd_BLOCK_N1": n1, "bwd_BLOCK_M2": n1, "bwd_BLOCK_N2": m1,
            "bwd_num_warps": warps, "bwd_num_stages": stages}


DIVISIBLE = {"IS_DIVISIBLE": True}
OPTIONS = {
    # the static kernel's loads without bounds checks, shapes still dynamic: true where the query
    # and key counts are multiples of 128 (the bench's are: 32,768 and 40,960)
    "divisible": DIVISIBLE,
    # forward tiles for both passes
    "fwd128x64w8": {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3},
    # whole tiles with other forward / backward tiles: inductor's sm90 defaults are 128x128 w4
    # forward and 64/128/128/64 w8 backward at head_dim 64
    "div:fwd128x64w4": {**DIVISIBLE, **_fwd(128, 64)},
    "div:fwd64x64w4": {**DIVISIBLE, **_fwd(64, 64)},
    "div:bwd64x64w4": {**DIVISIBLE, **_bwd(64, 64)},
    "div:bwd32x128w4": {**DIVISIBLE, **_bwd(32, 128)},
    "div:bwd64x128w4": {**DIVISIBLE, **_bwd(64, 128)},
    "div:fwd64bwd64": {**DIVISIBLE, **_fwd(64, 64), **_bwd(64, 64)},  # attention.FLEX_TILES at heads of 64, sm90
}


def step_batch(num_seqs: int = 4, seq_len: int = 2048, anchors: int = 512, block_size: int = 16, seed: int = 0):
    """The blocks of one bench step: every position a response position."""
    cu = torch.arange(num_seqs + 1, dtype=torch.int32) * seq_len
    mask = torch.ones(num_seqs * seq_len, dtype=torch.bool)
    picks = [sample_anchors(mask[:seq_len], anchors, anchor_generator(seed, 0, s)) for s in range(num_seqs)]
    ids = torch.zeros(num_seqs * seq_len, dtype=torch.long)
    return build_training_batch(ids, mask, cu, picks, block_size=block_size, mask_token_id=1, gamma=7.0)


def _time(fn, q, k, v, mask, steps: int) -> tuple[float, float]:
    """(compile + first call seconds, ms per forward + backward)."""
    started = time.perf_counter()
    out = fn(q, k, v, mask)
    out.backward(torch.ones_like(out))
    torch.cuda.synchronize()
    first_s = time.perf_counter() - started
    out = fn(q, k, v, mask)
    out.backward(torch.ones_like(out))
    grad = torch.randn_like(out)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        fn(q, k, v, mask).backward(grad)
    end.record()
    torch.cuda.synchronize()
    return first_s, start.elapsed_time(end) / steps


def variants(names=None):
    """(name, builder, kernel_options) of every variant, or of those in ``names``."""
    for name, build, options in _variants():
        if names is None or name in names:
            yield name, build, options


def _variants():
    flex = att.flex_attention

    def make(**compile_kw):
        compiled = torch.compile(flex, **compile_kw)

        def call(q, k, v, mask, options=None):
            gqa = q.shape[0] != k.shape[0]
            return compiled(q[None], k[None], v[None], block_mask=mask, scale=q.shape[-1] ** -0.5, enable_gqa=gqa,
                            kernel_options=options)[0]
        return call
    yield "dynamic", lambda: make(**att.FLEX_COMPILE_OPTIONS), None
    yield "trainer", lambda: make(**att.FLEX_COMPILE_OPTIONS), "trainer"  # attention.flex_kernel_options
    yield "static", lambda: make(dynamic=False), None
    yield "autotune", lambda: make(dynamic=True, mode="max-autotune-no-cudagraphs"), None
    for name, options in OPTIONS.items():
        yield f"opts:{name}", lambda: make(**att.FLEX_COMPILE_OPTIONS), options


def measure(shape: str, steps: int, names=None) -> None:
    config = bd.drafter_model_config(shape)
    batch = step_batch()
    pairs = bd.step_counts(batch).visible_pairs
    layout = batch.layout.to("cuda")
    mask = att.flex_block_mask(layout)
    heads, kv_heads, dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(heads, layout.num_queries, dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    kv = [torch.randn(kv_heads, layout.num_ctx + layout.num_queries, dim, device="cuda", dtype=torch.bfloat16,
                      generator=gen) for _ in range(2)]
    q, k, v = (t.requires_grad_(True) for t in (q, *kv))
    tflop = 4 * pairs * dim * heads * 3 / 1e12
    print(f"== {shape}: {heads}/{kv_heads} heads of {dim}, {layout.num_queries} queries, {layout.num_ctx} context "
          f"keys; {tflop:.2f} TFLOP of visible pairs per forward + backward", flush=True)
    for name, build, options in variants(names):
        if options == "trainer":  # what the trainer passes at this shape on this GPU
            options = att.flex_kernel_options(q.shape[1], k.shape[1], dim, att.cuda_arch(q.device))
        torch._dynamo.reset()
        try:
            call = build()
            first_s, ms = _time(lambda *a: call(*a, options=options), q, k, v, mask, steps)
            print(f"{name:18s} {ms:8.2f} ms fwd+bwd  {tflop / ms * 1e3:6.0f} TFLOP/s   (first call {first_s:.1f} s)",
                  flush=True)
        except Exception as exc:  # noqa: BLE001 - a research script: report the variant that failed and go on
            print(f"{name:18s} failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}", flush=True)
        for t in (q, k, v):
            t.grad = None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shapes", nargs="*", default=["qwen3-8b", "smollm2-135m"])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--variants", default=None, help="comma-separated names (default: all)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("flex_attention: needs a CUDA GPU")
    print(f"FlexAttention on {torch.cuda.get_device_name(0)}, torch {torch.__version__}", flush=True)
    for shape in args.shapes:
        measure(shape, args.steps, args.variants.split(",") if args.variants else None)


if __name__ == "__main__":
    main()
