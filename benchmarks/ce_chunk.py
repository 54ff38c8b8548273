"""One CE chunk's rows and gradient: drafter/ce_kernel.py's kernel against inductor's, in one process.

    python3 -m benchmarks.ce_chunk                          # 15,360 x 49,152 bf16: the 135M-class chunk
    python3 -m benchmarks.ce_chunk --rows 8833 --vocab 151936

The chunked CE (drafter/objective.py) turns a chunk's logits into the rows' loss and
``w * (softmax - onehot)``: compiled by inductor (``_chunk_loss_and_grad``, what
``DFLASH_CE_KERNEL=off`` runs) or by the kernel, which writes the gradient over the logits, at each
of its tiles (ce_kernel.TILES) and at the one it picks by its own timing. All are timed on the same
random logits (each call on a fresh copy, the copy not timed), CUDA events around each of
``--iters`` calls after a warm-up; printed per variant: ms per chunk and the memory traffic's rate
counted as one read and one write of the logits (the least any variant moves), then the ratio of
the picked tile to inductor.
"""

from __future__ import annotations

import argparse

import torch

from dflash_ipc.drafter import ce_kernel
from dflash_ipc.drafter.objective import _fused_chunk_loss_and_grad


def time_ms(fn, prepare, iters: int) -> float:
    """Mean ms of ``fn(prepare())`` over ``iters`` calls, ``prepare`` outside the timed span."""
    total = 0.0
    for _ in range(iters):
        args = prepare()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(*args)
        end.record()
        end.synchronize()
        total += start.elapsed_time(end)
    return total / iters


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=15360)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    device = torch.device("cuda:0")
    gen = torch.Generator(device=device).manual_seed(0)
    logits = (torch.randn(args.rows, args.vocab, device=device, generator=gen) * 4).to(torch.bfloat16)
    labels = torch.randint(0, args.vocab, (args.rows,), device=device, generator=gen)
    weights = torch.rand(args.rows, device=device, generator=gen)
    scratch = torch.empty_like(logits)

    def fresh():
        scratch.copy_(logits)
        return scratch, labels, weights

    variants = {"inductor (DFLASH_CE_KERNEL=off)": lambda x, y, w: _fused_chunk_loss_and_grad.compiled(x, y, w)}
    for tile in ce_kernel.TILES:
        variants[f"kernel {tile}"] = lambda x, y, w, tile=tile: (ce_kernel.ce_rows(x, y, w, grad=True, tile=tile)
                                                                 * w).sum()
    variants["kernel, the tile it picks"] = lambda x, y, w: (ce_kernel.ce_rows(x, y, w, grad=True) * w).sum()
    traffic_gb = 2 * logits.numel() * logits.element_size() / 1e9
    print(f"{torch.cuda.get_device_name(device)}: [{args.rows}, {args.vocab}] bf16 logits, "
          f"{traffic_gb:.2f} GB read + written at the least")
    results = {}
    for name, fn in variants.items():
        for _ in range(3):  # compile, autotune, warm
            fn(*fresh())
        results[name] = time_ms(fn, fresh, args.iters)
        print(f"  {name:36s} {results[name]:7.3f} ms  {traffic_gb / results[name]:6.2f} TB/s")
    for name in ("inductor (DFLASH_CE_KERNEL=off)", "kernel, the tile it picks"):  # which kernels each one is
        args_ = fresh()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            variants[name](*args_)
            torch.cuda.synchronize()
        kernels = [(e.key, e.count, e.self_device_time_total) for e in prof.key_averages()
                   if e.self_device_time_total > 0]
        print(f"  {name}: " + "; ".join(f"{key[:70]} x{n} {us / 1e3:.3f} ms" for key, n, us in kernels))
    base, picked = results["inductor (DFLASH_CE_KERNEL=off)"], results["kernel, the tile it picks"]
    print(f"  picked: {ce_kernel.tile_for(logits, labels, weights, grad=True)}; kernel / inductor: {picked / base:.3f}")


if __name__ == "__main__":
    main()
