"""The decode step's products of a few rows: cuBLAS against decode/matvec.py's Triton kernels.

    python3 -m benchmarks.matvec qwen3-1.7b qwen3-8b            # one row, the kernel's launch_config
    python3 -m benchmarks.matvec qwen3-1.7b --sweep             # every config of the grid, best kept
    python3 -m benchmarks.matvec qwen3-1.7b --rows 1,4,16       # one row, then the few-row kernel's
    python3 -m benchmarks.matvec qwen3-1.7b --rows 1,16 --fused # and with the fused layer's prologues

For each weight shape of a bench shape's decoder layer (bench/assets.py SHAPES: q, k, v, o, gate,
up, down; fused q|k|v and gate|up; the LM head), each row count against it (1: the matrix-vector
kernel, launch_config; more: the few-row kernel, rows_config; a verify pass is 16): as many distinct copies of the
weight as fill 512 MiB (at least 4, so the 50-MB L2 holds none of them between reads), one linear
per copy, captured as one CUDA graph and replayed; microseconds per product and the weight's
read rate. Then the matmul time of one decode step at each, per kernel: the layer's products
times the depth, plus the head, against the bound of reading those bytes at the GPU's bandwidth
(decode/bound.py). ``--fused``: the Triton products of decode/fused_layer.py's step timed as it
runs them too, with their prologue and epilogue (q|k|v after the input norm, gate|up after the
residual add and the second norm with silu * up, down with the residual add), and with --sweep
each swept so.
"""

from __future__ import annotations

import argparse
import itertools
import math

import torch
import torch.nn.functional as F

from benchmarks.graph_timing import graph_us
from dflash_ipc.bench.assets import SHAPES
from dflash_ipc.decode import matvec
from dflash_ipc.decode.bound import hbm_tbps

FILL_BYTES = 512 * 2**20
GRID = [dict(BLOCK_N=n, BLOCK_K=k, num_warps=w, num_stages=s)
        for n, k, w, s in itertools.product((4, 8, 16), (256, 512, 1024), (4, 8), (2, 4))]
ROWS_GRID = [dict(BLOCK_N=n, BLOCK_K=k, SPLIT=split, num_warps=warps, num_stages=4)
             for (n, warps), k, split in itertools.product(((16, 4), (32, 4), (64, 4), (64, 8), (128, 8)), (128, 256),
                                                           (1, 2, 4, 8))]
FUSED = ("qkv", "gate_up", "down")
"""The products decode/fused_layer.py runs with a prologue or an epilogue (o_proj runs plain)."""


def layer_shapes(shape: str) -> dict[str, tuple[int, int]]:
    """(N, K) of each linear weight of one decoder layer of ``shape``, and of the head."""
    c = SHAPES[shape][1]
    h, inter = c["hidden_size"], c["intermediate_size"]
    q, kv = c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"]
    return {"q": (q, h), "k": (kv, h), "v": (kv, h), "o": (h, q), "gate": (inter, h), "up": (inter, h),
            "down": (h, inter), "qkv": (q + 2 * kv, h), "gate_up": (2 * inter, h), "head": (c["vocab_size"], h)}


def fusion(name: str, n: int, k: int, rows: int) -> dict:
    """The fused layer's prologue/epilogue arguments of product ``name`` (FUSED) for ``rows`` rows
    of an N x K weight (gate|up: N counts both halves)."""
    def t(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16)
    if name == "qkv":
        return dict(norm=t(k), eps=1e-6)
    if name == "gate_up":
        return dict(add=t(rows, k), norm=t(k), eps=1e-6, h=t(rows, k), glu=True)
    return dict(residual=t(rows, n))


def time_products(fn, n: int, k: int, rows: int = 1) -> float:
    """Microseconds per ``fn(x, w)`` over distinct copies of an N x K bf16 weight, x of ``rows``
    rows, in a CUDA graph."""
    copies = max(4, math.ceil(FILL_BYTES / (2 * n * k)))
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    return graph_us(fn, [(x, w) for w in weights])


def kernel(rows: int):
    """The Triton entry for ``rows`` rows, its default config and its sweep grid."""
    if rows == 1:
        return matvec.triton_matvec, matvec.launch_config, GRID
    return matvec.triton_rows, matvec.rows_config, ROWS_GRID


def check(n: int, k: int, config: dict, rows: int = 1) -> float:
    """Largest |Triton - cuBLAS| relative to the output's scale, one random product."""
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    want = F.linear(x, w).float()
    got = kernel(rows)[0](x, w, config=config).float()
    return float((got - want).abs().max() / want.abs().max())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shapes", nargs="+", choices=sorted(SHAPES))
    parser.add_argument("--sweep", action="store_true", help="time every config of the grid, keep the best")
    parser.add_argument("--rows", default="1", help=f"row counts, comma-separated (1..{matvec.MAX_ROWS})")
    parser.add_argument("--fused", action="store_true", help="also the fused layer's products with their prologues")
    parser.add_argument("--products", default=None,
                        help="products to time, comma-separated (default: all; the per-step sums need all)")
    args = parser.parse_args()
    row_counts = [int(r) for r in args.rows.split(",")]
    if not all(1 <= r <= matvec.MAX_ROWS for r in row_counts):
        parser.error(f"--rows {args.rows}: each count in 1..{matvec.MAX_ROWS}")
    for shape, rows in itertools.product(args.shapes, row_counts):
        depth = SHAPES[shape][1]["num_hidden_layers"]
        shapes = layer_shapes(shape)
        if args.products:
            shapes = {name: nk for name, nk in shapes.items() if name in args.products.split(",")}
        entry, default_config, grid = kernel(rows)
        timed: dict[str, dict[str, float]] = {"cublas": {}, "triton": {}, "triton fused": {}}
        seen: dict[tuple, tuple[float, float]] = {}
        for name, (n, k) in shapes.items():
            for fused in (False, True) if args.fused and name in FUSED else (False,):
                key = (n, k, name if fused else None)
                if key not in seen:
                    cublas = time_products(F.linear, n, k, rows) if not fused else float("nan")
                    extra = fusion(name, n, k, rows) if fused else {}
                    best, default = None, None
                    for cfg in [default_config(n, k)] + (grid if args.sweep else []):
                        try:
                            us = time_products(lambda x, w, c=cfg: entry(x, w, config=c, **extra), n, k, rows)
                        except Exception as e:  # noqa: BLE001 - a config the compiler refuses (registers, shared memory)
                            print(f"  {shape} {n}x{k} {cfg}: {type(e).__name__}: {str(e)[:120]}")
                            continue
                        default = us if default is None else default
                        if best is None or us < best[0]:
                            best = (us, cfg)
                    seen[key] = (cublas, best[0])
                    mb = 2 * n * k / 1e6
                    label = f"{name}+fused" if fused else name
                    print(f"{shape} rows {rows:2d} {label:14s} {n:6d}x{k:5d} ({mb:6.1f} MB): "
                          + ("" if fused else f"cuBLAS {cublas:7.2f} us ({mb / cublas:.2f} TB/s), ")
                          + f"Triton {best[0]:7.2f} us ({mb / best[0]:.2f} TB/s) {best[1]}"
                          + ("" if fused else f", rel err {check(n, k, best[1], rows):.1e}")
                          + (f" (default config {default:.2f} us)" if args.sweep else ""), flush=True)
                cublas, triton_us = seen[key]
                if fused:
                    timed["triton fused"][name] = triton_us
                else:
                    timed["cublas"][name], timed["triton"][name] = cublas, triton_us
        if args.fused:
            timed["triton fused"] = {**timed["triton"], **timed["triton fused"]}
        else:
            del timed["triton fused"]
        if len(shapes) < len(layer_shapes(shape)):
            continue  # not every product timed: no per-step sums
        n_bytes = 2 * (depth * sum(shapes[m][0] * shapes[m][1] for m in ("qkv", "o", "gate_up", "down"))
                       + shapes["head"][0] * shapes["head"][1])
        bound = n_bytes / (hbm_tbps("cuda:0") * 1e12) * 1e6
        for impl, t in timed.items():
            plain = depth * sum(t[m] for m in ("q", "k", "v", "o", "gate", "up", "down")) + t["head"]
            fused = depth * sum(t[m] for m in ("qkv", "o", "gate_up", "down")) + t["head"]
            print(f"{shape} rows {rows} {impl}: matmul per step {plain / 1e3:.3f} ms (7 per layer), {fused / 1e3:.3f} ms "
                  f"(4 per layer: q|k|v and gate|up fused); bound {bound / 1e3:.3f} ms ({bound / plain:.0%} / "
                  f"{bound / fused:.0%} of it)", flush=True)

if __name__ == "__main__":
    main()
