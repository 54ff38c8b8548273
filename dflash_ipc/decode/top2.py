"""Greedy choice and its margin in one pass over the logits: argmax, top-1 and top-2 of every row.

Greedy decoding keeps, beside each token, how close the choice was (sampler.py ``top2_margin``:
top-1 minus top-2 logit; eval/lossless.py's near-tie rule reads it). torch computes that as an
argmax and a ``topk(2)``: over a 151,936-entry vocabulary the radix top-k alone is eight
launches, and the argmax of a few rows is one program per row reading its whole row; a greedy
cycle ran both for the verify and the argmax for the draft. Here the same three figures come from two launches
(with the cycle's end and the masks, 0.31 ms off a Qwen3-1.7B-shaped cycle of 3.14 ms at batch 1
on an H100: docs/benchmarks.md, "The greedy choice, the cycle's end and the masks in a launch
each"): programs over (row, chunk of ``BLOCK`` entries) each leave their chunk's largest value,
its first index and the chunk's second value; a program per row combines the chunks. The
values are the logits' own, so the results equal torch's: the token is the first index of the
row's largest logit (``torch.argmax``'s rule), top-2 counts a repeated maximum twice (as
``topk`` does), both as float32. A NaN logit (a broken forward) ranks as +inf here, where torch
ranks it above +inf: in a row holding one, the token is torch's (the first NaN) unless a +inf
comes before it, and the top logit reads +inf where torch's reads NaN (the margin +inf or NaN).

:func:`greedy_top2` runs the kernels for CUDA bf16/fp16/fp32 logits whose last dimension is
contiguous, torch's ops elsewhere. ``$DFLASH_DECODE_TOP2``: ``auto`` (the default: on CUDA where
Triton imports) or ``off``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dflash_ipc.decode import pdl
from dflash_ipc.decode.matvec import available, cuda_switch, triton
from dflash_ipc.decode.sampler import top2_margin

TOP2_ENV = "DFLASH_DECODE_TOP2"
BLOCK = 4096
"""Vocabulary entries per program: 38 chunks of a 151,936-entry row."""
DTYPES = (torch.bfloat16, torch.float16, torch.float32)

if triton is not None:
    import triton.language as tl

    from dflash_ipc.decode.pdl import wait_for_inputs

    @triton.jit
    def _chunk_kernel(x_ptr, part_ptr, V, stride_row, n_chunks, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
        """Row ``program_id(0)``, chunk ``program_id(1)``: (largest value, second value, first index
        of the largest) into ``part`` (fp32 triples; indices are exact in fp32 below 2**24)."""
        row, chunk = tl.program_id(0), tl.program_id(1)
        offs = chunk * BLOCK + tl.arange(0, BLOCK)
        wait_for_inputs(PDL)  # pdl.py
        x = tl.load(x_ptr + row.to(tl.int64) * stride_row + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        x = tl.where(x != x, float("inf"), x)  # NaN ranks as +inf
        top = tl.max(x, axis=0)
        first = tl.min(tl.where(x == top, offs, V + BLOCK), axis=0)  # lanes past V hold -inf and come last
        second = tl.max(tl.where(offs == first, float("-inf"), x), axis=0)
        at = part_ptr + (row * n_chunks + chunk).to(tl.int64) * 3
        tl.store(at, top)
        tl.store(at + 1, second)
        tl.store(at + 2, first.to(tl.float32))

    @triton.jit
    def _row_kernel(part_ptr, token_ptr, margin_ptr, top_ptr, n_chunks, BLOCK_C: tl.constexpr,
                    PDL: tl.constexpr = False):
        """Row ``program_id(0)``'s chunks combined: its token, top-1 minus top-2, top-1."""
        row = tl.program_id(0)
        c = tl.arange(0, BLOCK_C)
        ok = c < n_chunks
        wait_for_inputs(PDL)  # pdl.py
        at = part_ptr + (row * n_chunks + c).to(tl.int64) * 3
        tops = tl.load(at, mask=ok, other=float("-inf"))
        seconds = tl.load(at + 1, mask=ok, other=float("-inf"))
        firsts = tl.load(at + 2, mask=ok, other=float(1 << 30))
        top = tl.max(tops, axis=0)
        first = tl.min(tl.where(ok & (tops == top), firsts, float(1 << 30)), axis=0)  # the earliest chunk's
        won = ok & (firsts == first)  # the chunk that holds the token (chunks hold distinct indices)
        second = tl.max(tl.where(won, seconds, tops), axis=0)  # its own second, every other chunk's largest
        tl.store(token_ptr + row, first.to(tl.int64))
        tl.store(margin_ptr + row, top - second)
        tl.store(top_ptr + row, top)


def enabled(device) -> bool:
    """Whether greedy choices on ``device`` take the kernels ($DFLASH_DECODE_TOP2)."""
    return cuda_switch(TOP2_ENV, device) and available()


def torch_greedy_top2(logits: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """What the kernels compute, by torch's ops: (argmax, top-1 minus top-2, top-1) of ``[..., V]``."""
    return (logits.argmax(-1), *top2_margin(logits))


def greedy_top2(logits: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """logits ``[..., V]`` (V >= 2) -> (token int64, top-1 minus top-2 logit, top-1 logit float32)
    ``[...]``: by the kernels where they take the logits (module docstring), else by torch."""
    v = logits.shape[-1]
    if not (logits.is_cuda and logits.dtype in DTYPES and logits.stride(-1) == 1 and 2 <= v < 1 << 24
            and logits.numel() and enabled(logits.device)):
        return torch_greedy_top2(logits)
    lead = logits.shape[:-1]
    x = logits.reshape(-1, v)
    rows, chunks = x.shape[0], triton.cdiv(v, BLOCK)
    part = torch.empty(rows * chunks * 3, dtype=torch.float32, device=x.device)
    tokens = torch.empty(rows, dtype=torch.long, device=x.device)
    margins = torch.empty(rows, dtype=torch.float32, device=x.device)
    tops = torch.empty(rows, dtype=torch.float32, device=x.device)
    launch = pdl.launch_args(x.device)
    with torch.cuda.device(x.device):  # Triton launches on the current device
        _chunk_kernel[(rows, chunks)](x, part, v, x.stride(0), chunks, BLOCK=BLOCK, num_warps=8, **launch)
        _row_kernel[(rows,)](part, tokens, margins, tops, chunks, BLOCK_C=max(16, triton.next_power_of_2(chunks)),
                             num_warps=1, **launch)
    return tokens.view(lead), margins.view(lead), tops.view(lead)
