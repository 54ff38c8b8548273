"""The decode step's products of a few rows: cuBLAS against decode/matvec.py's Triton kernels.

    python3 -m benchmarks.matvec qwen3-1.7b qwen3-8b            # one row, the kernel's launch_config
    python3 -m benchmarks.matvec qwen3-1.7b --sweep             # every config of the grid, best kept
    python3 -m benchmarks.matvec qwen3-1.7b --rows 1,4,16       # one row, then the few-row kernel's
    python3 -m benchmarks.matvec qwen3-1.7b --rows 1,16 --fused # and with the fused layer's prologues
    python3 -m benchmarks.matvec qwen3-1.7b --rows 16 --sweep --grid wide --fused-only --compile-workers 14 \
        --write rows-configs.json                               # a table for $DFLASH_DECODE_ROWS_CONFIGS

For each weight shape of a bench shape's decoder layer (bench/assets.py SHAPES, or your model's
directory or config.json: q, k, v, o, gate,
up, down; fused q|k|v and gate|up; the bench drafter's fc; the LM head), each row count against it
(1: the matrix-vector kernel, launch_config; more: the few-row kernel, the config it picks on this
GPU, decode/rows_configs.py; a verify pass is 16): as many distinct copies of the
weight as fill 512 MiB (at least 4, so the 50-MB L2 holds none of them between reads), one linear
per copy, captured as one CUDA graph and replayed; microseconds per product and the weight's
read rate. Then the matmul time of one decode step at each, per kernel: the layer's products
times the depth, plus the head, against the bound of reading those bytes at the GPU's bandwidth
(decode/bound.py). ``--fused``: the Triton products of decode/fused_layer.py's step timed as it
runs them too, with their prologue and epilogue (q|k|v after the input norm, gate|up after the
residual add and the second norm with silu * up, down with the residual add), and with --sweep
each swept so; ``--fused-only``: those products only so, the others plain. ``--grid wide`` sweeps
deeper pipelines, longer key blocks and blocks of 16 rows too (WIDE_ROWS_GRID);
``--compile-workers N`` compiles the grid's kernels in N processes first (Triton's disk cache
keeps them for the timing). ``--write PATH``: the fastest config per weight of the few-row sweep
as a table that ``$DFLASH_DECODE_ROWS_CONFIGS=PATH`` hands to the decode (the fused timing where
a product has one: that is how a decode step runs it).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os

import torch
import torch.nn.functional as F

from benchmarks.graph_timing import graph_us
from dflash_ipc.bench.assets import SHAPES
from dflash_ipc.bench.eval import DRAFT_LAYERS
from dflash_ipc.decode import matvec, rows_configs
from dflash_ipc.decode.bound import hbm_tbps

FILL_BYTES = 512 * 2**20
GRID = [dict(BLOCK_N=n, BLOCK_K=k, num_warps=w, num_stages=s)
        for n, k, w, s in itertools.product((4, 8, 16), (256, 512, 1024), (4, 8), (2, 4))]
ROWS_GRID = [dict(BLOCK_N=n, BLOCK_K=k, SPLIT=split, num_warps=warps, num_stages=4)
             for (n, warps), k, split in itertools.product(((16, 4), (32, 4), (64, 4), (64, 8), (128, 8)), (128, 256),
                                                           (1, 2, 4, 8))]
WIDE_ROWS_GRID = [
    dict(BLOCK_N=n, BLOCK_K=k, SPLIT=split, num_warps=warps, num_stages=stages)
    for (n, warps), k, stages, split in itertools.product(((16, 4), (32, 4), (64, 4), (128, 8)), (128, 256, 512),
                                                          (3, 4, 6, 8), (1, 2, 4, 8))
    # at least 24 KiB of weight in flight per program, at most ~200 KiB of shared memory
    if (stages - 1) * n * k * 2 >= 24 * 1024 and stages * (n + 16) * k * 2 <= 200 * 1024]
FUSED = ("qkv", "gate_up", "down")
"""The products decode/fused_layer.py runs with a prologue or an epilogue (o_proj runs plain)."""


def shape_fields(shape: str) -> dict:
    """A bench shape's config fields (bench/assets.py SHAPES), or those of the model whose
    directory or config.json ``shape`` names (your target: its text config where it nests one)."""
    if shape in SHAPES:
        return SHAPES[shape][1]
    path = os.path.join(shape, "config.json") if os.path.isdir(shape) else shape
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise SystemExit(f"{shape}: neither a bench shape ({', '.join(sorted(SHAPES))}) nor a readable "
                         f"config.json ({e})") from None
    config = config.get("text_config") or config if isinstance(config, dict) else None
    if not isinstance(config, dict):
        raise SystemExit(f"{path}: not a model config (a JSON object, its text config an object where it nests one)")
    missing = [k for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers",
                           "vocab_size") if not isinstance(config.get(k), int)]
    if missing:
        raise SystemExit(f"{path}: no integer {', '.join(missing)} (a dense decoder's config is needed)")
    heads = config["num_attention_heads"]
    return dict(config, head_dim=config.get("head_dim") or config["hidden_size"] // heads,
                num_key_value_heads=config.get("num_key_value_heads") or heads)


def layer_shapes(shape: str) -> dict[str, tuple[int, int]]:
    """(N, K) of each linear weight of one decoder layer of ``shape``, and of the head."""
    c = shape_fields(shape)
    h, inter = c["hidden_size"], c["intermediate_size"]
    q, kv = c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"]
    taps = DRAFT_LAYERS.get(shape, 5)  # bench eval's drafter (5 layers, so 5 target layers read; a model's too)
    return {"q": (q, h), "k": (kv, h), "v": (kv, h), "o": (h, q), "gate": (inter, h), "up": (inter, h),
            "down": (h, inter), "qkv": (q + 2 * kv, h), "gate_up": (2 * inter, h), "fc": (h, taps * h),
            "head": (c["vocab_size"], h)}


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


def kernel(rows: int, grid: str = "narrow"):
    """The Triton entry for ``rows`` rows and its sweep grid (the default config: ``None``, the
    entry's own choice on this GPU)."""
    if rows == 1:
        return matvec.triton_matvec, GRID
    return matvec.triton_rows, WIDE_ROWS_GRID if grid == "wide" else ROWS_GRID


def check(n: int, k: int, config: dict | None, rows: int = 1) -> float:
    """Largest |Triton - cuBLAS| relative to the output's scale, one random product."""
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    want = F.linear(x, w).float()
    got = kernel(rows)[0](x, w, config=config).float()
    return float((got - want).abs().max() / want.abs().max())


def _compile_one(task: tuple) -> str:
    """Run one product of ``task`` (name, n, k, rows, fused, config) once: Triton compiles it into
    its disk cache. Returns an error's text, or ''."""
    name, n, k, rows, fused, cfg = task
    try:
        extra = fusion(name, n, k, rows) if fused else {}
        w = torch.empty(n, k, device="cuda", dtype=torch.bfloat16)
        kernel(rows)[0](torch.randn(rows, k, device="cuda", dtype=torch.bfloat16), w, config=cfg, **extra)
        torch.cuda.synchronize()
        return ""
    except Exception as e:  # noqa: BLE001 - reported by the timing loop, which meets it again
        return f"{type(e).__name__}: {str(e)[:80]}"


def precompile(tasks: list[tuple], workers: int) -> None:
    """Every task's kernel compiled in ``workers`` processes (spawned: CUDA in each) beforehand."""
    import concurrent.futures
    import multiprocessing
    import time
    t0 = time.perf_counter()
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        failed = sum(bool(r) for r in pool.map(_compile_one, tasks, chunksize=4))
    print(f"compiled {len(tasks)} kernels in {workers} processes, {time.perf_counter() - t0:.0f} s "
          f"({failed} refused)", flush=True)


def useful(cfg: dict | None, n: int, glu: bool = False, sms: int = 132) -> bool:
    """Whether the sweep times ``cfg`` against a weight of ``n`` rows: no K split where the
    blocks of rows alone fill the GPU twice over (the head's 2,374 blocks) or under silu * up
    (``glu``: the kernel runs it unsplit, its gate and up tiles in WIDE_ROWS_GRID's shared memory)."""
    if cfg is None or "SPLIT" not in cfg:  # the default, or the one-row kernel's grid
        return True
    if glu:  # gate and up rows per program, BLOCK_N // 2 each but at least 16: shared memory for both
        return cfg["SPLIT"] == 1 and rows_configs.shared_memory_bytes(cfg, glu=True) <= 200 * 1024
    return cfg["SPLIT"] == 1 or -(-n // cfg["BLOCK_N"]) < 2 * sms


def products(shapes: dict, fused: str) -> list[tuple[str, int, int, bool]]:
    """(name, n, k, fused) per product to time: ``fused`` "no", "also" (both ways) or "only"."""
    out = []
    for name, (n, k) in shapes.items():
        ways = (False,) if name not in FUSED or fused == "no" else (True,) if fused == "only" else (False, True)
        out += [(name, n, k, f) for f in ways]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shapes", nargs="+", help=f"bench shapes ({', '.join(sorted(SHAPES))}) or model "
                                                  f"directories / config.json files")
    parser.add_argument("--sweep", action="store_true", help="time every config of the grid, keep the best")
    parser.add_argument("--grid", choices=("narrow", "wide"), default="narrow", help="the few-row sweep's grid")
    parser.add_argument("--rows", default="1", help=f"row counts, comma-separated (1..{matvec.MAX_ROWS})")
    parser.add_argument("--fused", action="store_true", help="also the fused layer's products with their prologues")
    parser.add_argument("--fused-only", action="store_true", help="the fused layer's products with them only")
    parser.add_argument("--products", default=None,
                        help="products to time, comma-separated (default: all; the per-step sums need all)")
    parser.add_argument("--compile-workers", type=int, default=0, help="compile the sweep in N processes first")
    parser.add_argument("--write", default=None, help="write the few-row sweep's winners as a rows configs table")
    args = parser.parse_args()
    row_counts = [int(r) for r in args.rows.split(",")]
    if not all(1 <= r <= matvec.MAX_ROWS for r in row_counts):
        parser.error(f"--rows {args.rows}: each count in 1..{matvec.MAX_ROWS}")
    if args.write and (not args.sweep or len(row_counts) != 1 or row_counts == [1]):
        parser.error("--write needs --sweep and one row count of 2 or more (--rows 16: a verify pass)")
    fused_mode = "only" if args.fused_only else "also" if args.fused else "no"
    winners: dict[tuple, tuple[dict, float]] = {}
    for shape, rows in itertools.product(args.shapes, row_counts):
        depth = shape_fields(shape)["num_hidden_layers"]
        shapes = layer_shapes(shape)
        if args.products:
            shapes = {name: nk for name, nk in shapes.items() if name in args.products.split(",")}
        entry, grid = kernel(rows, args.grid)
        configs = [None] + (grid if args.sweep else [])
        todo = products(shapes, fused_mode)
        if args.compile_workers > 0 and args.sweep:
            precompile([(name, n, k, rows, fused, cfg) for name, n, k, fused in todo for cfg in configs[1:]
                        if useful(cfg, n, fused and name == "gate_up")], args.compile_workers)
        timed: dict[str, dict[str, float]] = {"cublas": {}, "triton": {}, "triton fused": {}}
        seen: dict[tuple, tuple[float, float]] = {}
        for name, n, k, fused in todo:
            key = (n, k, name if fused else None)
            if key not in seen:
                cublas = time_products(F.linear, n, k, rows) if not fused else float("nan")
                extra = fusion(name, n, k, rows) if fused else {}
                best, default = None, None
                for cfg in (c for c in configs if useful(c, n, fused and name == "gate_up")):
                    try:
                        us = time_products(lambda x, w, c=cfg: entry(x, w, config=c, **extra), n, k, rows)
                    except Exception as e:  # noqa: BLE001 - a config the compiler refuses (registers, shared memory)
                        print(f"  {shape} {n}x{k} {cfg}: {type(e).__name__}: {str(e)[:120]}")
                        continue
                    default = us if default is None else default
                    if best is None or us < best[0]:
                        best = (us, cfg)
                seen[key] = (cublas, best[0])
                glu = fused and name == "gate_up"
                if rows > 1 and (fused or (n, k, glu) not in winners):
                    # the default resolved to its config: a table holds every weight it swept, whatever
                    # table or rule the sweeping process had
                    winners[(n, k, glu)] = (best[1] or matvec.rows_config(n, k, glu=glu, **matvec.gpu_args(
                        torch.device("cuda", torch.cuda.current_device()))), best[0])
                    if args.write:  # after each weight: a sweep cut short keeps what it found
                        write_table(args.write, max(row_counts), winners)
                mb = 2 * n * k / 1e6
                label = f"{name}+fused" if fused else name
                print(f"{shape} rows {rows:2d} {label:14s} {n:6d}x{k:5d} ({mb:6.1f} MB): "
                      + ("" if fused else f"cuBLAS {cublas:7.2f} us ({mb / cublas:.2f} TB/s), ")
                      + f"Triton {best[0]:7.2f} us ({mb / best[0]:.2f} TB/s) {best[1] or 'default config'}"
                      + ("" if fused else f", rel err {check(n, k, best[1], rows):.1e}")
                      + (f" (default config {default:.2f} us)" if args.sweep else ""), flush=True)
            cublas, triton_us = seen[key]
            if fused:
                timed["triton fused"][name] = triton_us
            else:
                timed["cublas"][name], timed["triton"][name] = cublas, triton_us
        if fused_mode == "also":
            timed["triton fused"] = {**timed["triton"], **timed["triton fused"]}
        else:
            del timed["triton fused"]
        if len(shapes) < len(layer_shapes(shape)) or fused_mode == "only":
            continue  # not every product timed plainly: no per-step sums
        n_bytes = 2 * (depth * sum(shapes[m][0] * shapes[m][1] for m in ("qkv", "o", "gate_up", "down"))
                       + shapes["head"][0] * shapes["head"][1])
        bound = n_bytes / (hbm_tbps("cuda:0") * 1e12) * 1e6
        for impl, t in timed.items():
            plain = depth * sum(t[m] for m in ("q", "k", "v", "o", "gate", "up", "down")) + t["head"]
            fused = depth * sum(t[m] for m in ("qkv", "o", "gate_up", "down")) + t["head"]
            print(f"{shape} rows {rows} {impl}: matmul per step {plain / 1e3:.3f} ms (7 per layer), {fused / 1e3:.3f} ms "
                  f"(4 per layer: q|k|v and gate|up fused); bound {bound / 1e3:.3f} ms ({bound / plain:.0%} / "
                  f"{bound / fused:.0%} of it)", flush=True)
    if args.write:
        print(f"wrote {len(winners)} configs to {args.write} (DFLASH_DECODE_ROWS_CONFIGS={args.write})", flush=True)


def write_table(path: str, rows: int, winners: dict) -> None:
    """The winners so far as a rows configs table at ``path`` (replaced whole: never half written)."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(rows_configs.table_document(torch.cuda.get_device_name(), rows, winners), f, indent=1)
    os.replace(tmp, path)


if __name__ == "__main__":
    main()
