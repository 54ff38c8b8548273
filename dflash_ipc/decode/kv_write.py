"""New K/V rows into a row cache: one launch for both k and v.

A row cache (row_cache.py) keeps per layer ``K, V`` ``[rows, capacity + 1, heads, D]`` and a
forward writes its tokens' k and v at ``(row, position)`` pairs. ``index_put_`` does that in a
kernel per tensor that works out every element's address from broadcast index tensors: an
unfused drafter's block and its context append write 10 times per speculative cycle at batch 1
(5 layers each; the fused drafter writes through decode/qk_rope.py instead), and the profile of
such a cycle at the Qwen3-1.7B shape counted 21 ``index_put_`` launches and 0.1 ms of their
kernel time in it (``python3 -m benchmarks.profile_speculative qwen3-1.7b``). Here a program per token copies that token's ``heads x D`` keys
(program_id 1 = 0) or values (1) to its row and position: one launch per write, the same
values (a copy).

Used by ``RowStorage.write`` for CUDA tensors (:func:`takes`), outside a torch.compile trace (a
compiled forward keeps ``index_put_``, which the compiler fuses). Indices count from the end
when negative, as ``index_put_``'s do; a write whose row or position is still outside the
storage is skipped, where ``index_put_`` would stop the process with a device assert.
``$DFLASH_DECODE_KV_WRITE``: ``auto`` (the default: on CUDA where Triton imports) or ``off``.
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor

from dflash_ipc.decode import pdl
from dflash_ipc.decode.matvec import available, cuda_switch, triton

KV_WRITE_ENV = "DFLASH_DECODE_KV_WRITE"
INDEX_DTYPES = (torch.int32, torch.int64)

if triton is not None:
    import triton.language as tl

    from dflash_ipc.decode.pdl import wait_for_inputs

    @triton.jit
    def _write_kernel(k_ptr, v_ptr, keys_ptr, values_ptr, rows_ptr, pos_ptr, Q, R, P, sk_r, sk_t, sk_h, sv_r, sv_t,
                      sv_h, s_row, s_pos, s_head, H: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr,
                      BLOCK_D: tl.constexpr, PDL: tl.constexpr = False):
        """Token ``program_id(0)`` (= r * Q + t) of k (``program_id(1)`` 0) or v (1) ``[R', Q, H, D]``
        (strides in elements, D contiguous) to storage row ``rows[r]`` of R, position ``pos[r, t]``
        of P (negative: from the end)."""
        tok, which = tl.program_id(0), tl.program_id(1)
        r, t = tok // Q, tok % Q
        wait_for_inputs(PDL)  # pdl.py
        row = tl.load(rows_ptr + r).to(tl.int64)
        at = tl.load(pos_ptr + tok).to(tl.int64)
        row = tl.where(row < 0, row + R, row)
        at = tl.where(at < 0, at + P, at)
        h = tl.arange(0, BLOCK_H)[:, None]
        d = tl.arange(0, BLOCK_D)[None, :]
        ok = (h < H) & (d < D) & (row >= 0) & (row < R) & (at >= 0) & (at < P)
        if which == 0:
            x = tl.load(k_ptr + r.to(tl.int64) * sk_r + t * sk_t + h * sk_h + d, mask=ok)
            tl.store(keys_ptr + row * s_row + at * s_pos + h * s_head + d, x, mask=ok)
        else:
            x = tl.load(v_ptr + r.to(tl.int64) * sv_r + t * sv_t + h * sv_h + d, mask=ok)
            tl.store(values_ptr + row * s_row + at * s_pos + h * s_head + d, x, mask=ok)


def fits(keys: Tensor, values: Tensor, rows: Tensor, pos: Tensor, k: Tensor, v: Tensor) -> bool:
    """Whether the kernel's layout assumptions hold (any device): k and v of one shape ``[R, q,
    heads, D]`` and of the storage's dtype with their last dimension contiguous, rows ``[R]``
    and pos ``[R, q]`` of int32/int64, keys and values contiguous, of one shape, with k's
    heads and D, all on one device."""
    return (k.dim() == 4 and k.shape == v.shape and k.stride(-1) == 1 and v.stride(-1) == 1
            and k.dtype == v.dtype == keys.dtype == values.dtype
            and keys.shape == values.shape and keys.is_contiguous() and values.is_contiguous()
            and keys.shape[2:] == k.shape[2:]
            and tuple(rows.shape) == tuple(k.shape[:1]) and tuple(pos.shape) == tuple(k.shape[:2])
            and rows.dtype in INDEX_DTYPES and pos.dtype in INDEX_DTYPES
            and len({t.device for t in (keys, values, rows, pos, k, v)}) == 1)


def takes(keys: Tensor, values: Tensor, rows: Tensor, pos: Tensor, k: Tensor, v: Tensor) -> bool:
    """Whether ``RowStorage.write`` runs :func:`write`: CUDA tensors that :func:`fits`, the switch
    not off, Triton present, outside a torch.compile trace."""
    return (keys.is_cuda and cuda_switch(KV_WRITE_ENV, keys.device) and available()
            and not torch.compiler.is_compiling() and fits(keys, values, rows, pos, k, v))


def write(keys: Tensor, values: Tensor, rows: Tensor, pos: Tensor, k: Tensor, v: Tensor) -> None:
    """``keys[rows[:, None], pos] = k`` and the same for values, in one launch (:func:`takes`'s
    tensors; negative indices count from the end, rows or positions outside are skipped)."""
    r, q, heads, dim = k.shape
    rows, pos = rows.contiguous(), pos.contiguous()
    with torch.cuda.device(keys.device) if keys.is_cuda else contextlib.nullcontext():  # Triton's current device
        _write_kernel[(r * q, 2)](k, v, keys, values, rows, pos, q, keys.shape[0], keys.shape[1],
                                  k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
                                  keys.stride(0), keys.stride(1), keys.stride(2), H=heads, D=dim,
                                  BLOCK_H=triton.next_power_of_2(heads), BLOCK_D=triton.next_power_of_2(dim),
                                  num_warps=4, **pdl.launch_args(keys.device))
