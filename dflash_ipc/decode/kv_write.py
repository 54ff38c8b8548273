"""New K/V rows into a row cache: one launch for both k and v.

A row cache (row_cache.py) keeps per layer ``K, V`` ``[rows, capacity + 1, heads, D]`` and a
forward writes its tokens' k and v at ``(row, position)`` pairs. ``index_put_`` does that in a
kernel per tensor that works out every element's address from broadcast index tensors: the
drafter's block and its context append write 10 times per speculative cycle at batch 1 (5
layers each), and the profile of a cycle at the Qwen3-1.7B shape counted 21 ``index_put_``
launches and 0.1 ms of their kernel time in it (``python3 -m benchmarks.profile_speculative
qwen3-1.7b``). Here a program per token copies that token's
``heads x D`` keys (program_id 1 = 0) or values (1) to its row and position: one launch per
write, the same values (a copy).

Used by ``RowStorage.write`` for CUDA tensors of one dtype where Triton imports, outside a
torch.compile trace (a compiled forward keeps ``index_put_``, which the compiler fuses).
Writes whose row or position is outside the storage are skipped (``index_put_`` would raise).
"""

from __future__ import annotations

import torch
from torch import Tensor

from dflash_ipc.decode.matvec import available, triton

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _write_kernel(k_ptr, v_ptr, keys_ptr, values_ptr, rows_ptr, pos_ptr, Q, R, P, sk_r, sk_t, sk_h, sv_r, sv_t,
                      sv_h, s_row, s_pos, s_head, H: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr,
                      BLOCK_D: tl.constexpr):
        """Token ``program_id(0)`` (= r * Q + t) of k (``program_id(1)`` 0) or v (1) ``[R, Q, H, D]``
        (strides in elements, D contiguous) to storage row ``rows[r]``, position ``pos[r, t]``."""
        tok, which = tl.program_id(0), tl.program_id(1)
        r, t = tok // Q, tok % Q
        row = tl.load(rows_ptr + r).to(tl.int64)
        at = tl.load(pos_ptr + tok).to(tl.int64)
        h = tl.arange(0, BLOCK_H)[:, None]
        d = tl.arange(0, BLOCK_D)[None, :]
        ok = (h < H) & (d < D) & (row >= 0) & (row < R) & (at >= 0) & (at < P)
        if which == 0:
            x = tl.load(k_ptr + r.to(tl.int64) * sk_r + t * sk_t + h * sk_h + d, mask=ok)
            tl.store(keys_ptr + row * s_row + at * s_pos + h * s_head + d, x, mask=ok)
        else:
            x = tl.load(v_ptr + r.to(tl.int64) * sv_r + t * sv_t + h * sv_h + d, mask=ok)
            tl.store(values_ptr + row * s_row + at * s_pos + h * s_head + d, x, mask=ok)


def takes(keys: Tensor, values: Tensor, rows: Tensor, pos: Tensor, k: Tensor, v: Tensor) -> bool:
    """Whether :func:`write` takes these: CUDA tensors, k and v of one shape ``[R, q, heads,
    D]`` and of the storage's dtype with their last dimension contiguous, rows ``[R]`` and pos
    ``[R, q]`` of integers, keys and values contiguous and of one shape (as RowStorage
    allocates them), outside a torch.compile trace."""
    return (available() and keys.is_cuda and k.is_cuda and v.is_cuda and rows.is_cuda and pos.is_cuda
            and k.dtype == v.dtype == keys.dtype == values.dtype and k.shape == v.shape and k.dim() == 4
            and tuple(rows.shape) == tuple(k.shape[:1]) and tuple(pos.shape) == tuple(k.shape[:2])
            and not rows.is_floating_point() and not pos.is_floating_point()
            and k.stride(-1) == 1 and v.stride(-1) == 1 and keys.shape == values.shape
            and keys.is_contiguous() and values.is_contiguous() and keys.shape[2:] == k.shape[2:]
            and not torch.compiler.is_compiling())


def write(keys: Tensor, values: Tensor, rows: Tensor, pos: Tensor, k: Tensor, v: Tensor) -> None:
    """``keys[rows[:, None], pos] = k`` and the same for values, in one launch: k, v ``[R, q,
    heads, D]``, rows ``[R]``, pos ``[R, q]`` (integer, on the storage's device); keys and values
    ``[storage rows, positions, heads, D]``, contiguous, of one layout (:func:`takes`)."""
    r, q, heads, dim = k.shape
    pos = pos.contiguous()
    _write_kernel[(r * q, 2)](k, v, keys, values, rows, pos, q, keys.shape[0], keys.shape[1],
                              k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
                              keys.stride(0), keys.stride(1), keys.stride(2), H=heads, D=dim,
                              BLOCK_H=triton.next_power_of_2(heads), BLOCK_D=triton.next_power_of_2(dim),
                              num_warps=4)
