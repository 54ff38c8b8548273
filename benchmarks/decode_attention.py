"""Decode and verify attention: SDPA over the band mask against decode/decode_attention.py's kernel.

    python3 -m benchmarks.decode_attention qwen3-1.7b qwen3-8b               # the default cases
    python3 -m benchmarks.decode_attention qwen3-1.7b --case 512:1:1024:ragged   # rows:queries:span[:ragged]

For each case, one layer's attention as a decode step runs it: ``rows`` rows, ``queries`` new
tokens each (1: a decode step; 16: a verify block), keys read from views of a row storage
``[rows, span + 1, Hkv, D]`` under a causal band mask; every row ``span - queries`` long, or
(``ragged``) of lengths uniform in ``span/8 .. span``, as a batch of replies of mixed lengths.
Each path runs over as many distinct caches as fill 256 MiB (so the 50-MB L2 holds none of them
between calls), captured as one CUDA graph and replayed; microseconds per call, the K/V bytes the
rows' own lengths hold over that time, and the largest difference from an fp32 reference.
``sdpa`` is ragged_attention.py's ``gqa_attention`` with the transpose copy that
``hf_attention`` adds; ``kernel`` is the op with its default splits and combine (decode_attention.py
``combine_in_kernel``), ``kernel+last combines`` the same with the splits combined by the last
one, ``kernel+combine launch`` by a launch of its own, ``kernel/S`` with S splits (``--splits``,
default 1: none).
"""

from __future__ import annotations

import argparse
import math

import torch

from benchmarks.graph_timing import graph_us
from dflash_ipc.bench.assets import SHAPES
from dflash_ipc.decode import decode_attention, matvec
from dflash_ipc.decode.ragged_attention import band_mask, gqa_attention

FILL_BYTES = 256 * 2**20
CASES = ("1:1:512", "1:1:4096", "1:16:512", "1:16:4096", "64:1:1024:ragged", "512:1:1024:ragged",
         "512:1:4096:ragged")


def make_case(shape: str, rows: int, queries: int, span: int, ragged: bool, seed: int = 0):
    c = SHAPES[shape][1]
    hq, hkv, d = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, queries, hq, d, generator=g).to("cuda", torch.bfloat16).transpose(1, 2)
    store_k, store_v = (torch.randn(rows, span + 1, hkv, d, generator=g).to("cuda", torch.bfloat16)
                        for _ in range(2))
    lengths = (torch.randint(max(1, span // 8), span - queries + 1, (rows,), generator=g) if ragged
               else torch.full((rows,), span - queries))
    pos = lengths[:, None] + torch.arange(queries)
    mask = band_mask(torch.zeros_like(pos), pos + 1, span).cuda()
    kv_bytes = int((lengths + queries).sum()) * hkv * d * 2 * 2
    return q, store_k, store_v, mask, kv_bytes


def paths(splits: list[int]):
    def sdpa(q, k, v, mask):
        return gqa_attention(q, k, v, mask).transpose(1, 2).contiguous()

    def kernel(n, combine_last=None):
        return lambda q, k, v, mask: decode_attention.triton_decode_attention(q, k, v, mask, splits=n,
                                                                              combine_last=combine_last)

    return ({"sdpa": sdpa, "kernel": kernel(None), "kernel+last combines": kernel(None, True),
             "kernel+combine launch": kernel(None, False)}
            | {f"kernel/{n}": kernel(n) for n in splits})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shapes", nargs="+", choices=sorted(SHAPES))
    parser.add_argument("--case", action="append", help="rows:queries:span[:ragged] (repeatable)")
    parser.add_argument("--splits", default="1", help="comma-separated split counts timed beside the default")
    args = parser.parse_args()
    for shape in args.shapes:
        print(f"== {shape}: one layer's attention, bf16, us per call (K/V TB/s of the rows' own lengths), "
              f"max |err| against fp32")
        for spec in args.case or CASES:
            fields = spec.split(":")
            rows, queries, span = (int(x) for x in fields[:3])
            ragged = fields[3:] == ["ragged"]
            q, store_k, store_v, mask, kv_bytes = make_case(shape, rows, queries, span, ragged)
            copies = min(64, max(4, math.ceil(FILL_BYTES / (2 * store_k.numel() * 2))))
            cases = [(q, sk[:, :span].transpose(1, 2), sv[:, :span].transpose(1, 2), mask)
                     for sk, sv in [(store_k, store_v)] + [(store_k.clone(), store_v.clone()) for _ in range(copies - 1)]]
            want = gqa_attention(q.float(), cases[0][1].float(), cases[0][2].float(), mask).transpose(1, 2)
            cells, base = [], None
            for name, fn in paths([int(n) for n in args.splits.split(",")]).items():
                us = graph_us(fn, cases)
                err = float((fn(*cases[0]).float() - want).abs().max())
                base = base or us
                cells.append(f"{name} {us:7.2f} us ({kv_bytes / us / 1e6:4.2f}, {base / us:4.2f}x, err {err:.1e})")
            splits, _ = decode_attention.split_plan(rows * store_k.shape[2], span, matvec.num_sms(0),
                                                    decode_attention.BLOCK_T)
            print(f"  {spec:<20} splits {splits:>3}  " + "  ".join(cells), flush=True)
            del cases, store_k, store_v


if __name__ == "__main__":
    main()
