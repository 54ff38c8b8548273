"""A decode step's q and k, normed and rotated, and its k and v written to the cache: one launch.

Between a decoder layer's q|k|v product and its attention, transformers' attention forward
views the product as heads, RMS-norms q and k per head (Qwen3's ``q_norm``/``k_norm``), rotates
both (``apply_rotary_pos_emb``: ``x * cos + rotate_half(x) * sin``) and writes k and v to the
cache. Compiled at batch 1 that is four Inductor kernels per layer (two norm-and-rotate, two
cache writes: 5.1 us of a 1.7B-shaped step's layer, docs/benchmarks.md). Here it is one,
``dflash::qk_rope_write``: a program per token and head reads the head's slice of the product,
norms and rotates q and k heads, and stores q heads to the attention's query ``[B, Hq, q, D]``
and k and v heads to the cache rows and positions the step writes. Each op rounds to the
activations' dtype where the eager forward does, so the values are the eager forward's.

On CPU, for dtypes other than bf16/fp16, head dims that are not a power of 2, inputs whose
last dimension is strided and where Triton is missing the op runs the eager forward's own torch
ops (the reference the kernel is tested against).
"""

from __future__ import annotations

import torch
from torch import Tensor

from dflash_ipc.decode import matvec, pdl

triton, tl = matvec.triton, (matvec.tl if matvec.triton is not None else None)
if triton is not None:
    from dflash_ipc.decode.pdl import wait_for_inputs


if triton is not None:
    @triton.jit
    def _rounded(x, dtype: tl.constexpr):
        """x rounded to ``dtype`` and back to fp32, behind an opaque move: the compiler would
        otherwise fuse the product and the sum that follows into one fma of one rounding, where
        the eager forward rounds each (the values then differ in a last bit)."""
        return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x.to(dtype).to(tl.float32)], dtype=tl.float32,
                                         is_pure=True, pack=1)

    @triton.jit
    def _qk_rope_write_kernel(qkv_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, q_ptr, k_ptr, v_ptr, rows_ptr, pos_ptr,
                              Q, HQ, HK, R, P, eps, stride_tok, stride_row, stride_pos, stride_head,
                              D: tl.constexpr, QK_NORM: tl.constexpr, PDL: tl.constexpr = False):
        """Token ``program_id(0)`` (= b * Q + t) and head ``program_id(1)`` of q (< HQ), k (< HQ +
        HK) or v: normed (QK_NORM, q and k) and rotated (q and k), stored to q or the cache (R
        rows of P positions: a row or position outside is not written)."""
        tok, head = tl.program_id(0), tl.program_id(1)
        b, t = tok // Q, tok % Q
        dtype = q_ptr.dtype.element_ty
        d = tl.arange(0, D)
        rot = (d + D // 2) % D  # rotate_half(x)[i] = -x[i + D/2] for i < D/2, x[i - D/2] after
        src = qkv_ptr + tok.to(tl.int64) * stride_tok + head * D
        wait_for_inputs(PDL)  # pdl.py
        x = tl.load(src + d).to(tl.float32)
        raw = x.to(dtype)  # a v head's, stored as it is
        x_rot = tl.load(src + rot).to(tl.float32)
        is_k = (head >= HQ) & (head < HQ + HK)
        is_v = head >= HQ + HK
        if QK_NORM:  # the head's RMS norm: fp32 mean of squares, x * rsqrt cast, weight times it
            rstd = tl.math.rsqrt(tl.sum(x * x, axis=0) / D + eps)
            w = tl.where(is_k, tl.load(kw_ptr + d), tl.load(qw_ptr + d)).to(tl.float32)
            w_rot = tl.where(is_k, tl.load(kw_ptr + rot), tl.load(qw_ptr + rot)).to(tl.float32)
            x = (w * (x * rstd).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
            x_rot = (w_rot * (x_rot * rstd).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        x_rot = tl.where(d < D // 2, -x_rot, x_rot)
        c = tl.load(cos_ptr + tok.to(tl.int64) * D + d).to(tl.float32)
        s = tl.load(sin_ptr + tok.to(tl.int64) * D + d).to(tl.float32)
        rotated = (_rounded(x * c, dtype) + _rounded(x_rot * s, dtype)).to(dtype)
        out = tl.where(is_v, raw, rotated)
        row = tl.load(rows_ptr + b).to(tl.int64)
        pos = tl.load(pos_ptr + tok).to(tl.int64)
        inside = (row >= 0) & (row < R) & (pos >= 0) & (pos < P)
        at = row * stride_row + pos * stride_pos
        q_at = ((b * HQ + tl.minimum(head, HQ - 1)).to(tl.int64) * Q + t) * D
        tl.store(q_ptr + q_at + d, out, mask=(d < D) & (head < HQ))
        tl.store(k_ptr + at + tl.minimum(tl.maximum(head - HQ, 0), HK - 1) * stride_head + d, out,
                 mask=(d < D) & is_k & inside)
        tl.store(v_ptr + at + tl.maximum(head - HQ - HK, 0) * stride_head + d, out, mask=(d < D) & is_v & inside)


def triton_qk_rope_write(qkv: Tensor, cos: Tensor, sin: Tensor, q_norm: Tensor | None, k_norm: Tensor | None,
                         eps: float, keys: Tensor, values: Tensor, rows: Tensor, pos: Tensor, num_heads: int,
                         num_kv_heads: int) -> Tensor:
    """:func:`qk_rope_write` by the kernel (arguments as there; head dim a power of 2, K and V
    storage of one layout)."""
    b, q = qkv.shape[:2]
    d = qkv.shape[-1] // (num_heads + 2 * num_kv_heads)
    if keys.shape != values.shape or keys.stride() != values.stride() or keys.shape[-2:] != (num_kv_heads, d):
        raise ValueError(f"qk_rope_write: K {tuple(keys.shape)} and V {tuple(values.shape)} storage of "
                         f"{num_kv_heads} heads of {d}, one layout")
    qkv = qkv.reshape(b * q, -1)
    cos, sin = (t.expand(b, q, d).contiguous() for t in (cos, sin))
    out = torch.empty(b, num_heads, q, d, dtype=qkv.dtype, device=qkv.device)
    norm = q_norm is not None
    _qk_rope_write_kernel[(b * q, num_heads + 2 * num_kv_heads)](
        qkv, cos, sin, q_norm if norm else cos, k_norm if norm else cos,
        out if num_heads else qkv,  # no query heads (k and v alone): a pointer of the dtype, never stored to
        keys, values, rows,
        pos.contiguous(), q, num_heads, num_kv_heads, keys.shape[0], keys.shape[1], eps, qkv.stride(0),
        keys.stride(0), keys.stride(1),
        keys.stride(2), D=d, QK_NORM=norm, num_warps=1, **pdl.launch_args(qkv.device))
    return out


def rotate_half(x: Tensor) -> Tensor:
    """transformers' ``rotate_half``."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _norm(x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    if weight is None:
        return x
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _kernel_takes(qkv: Tensor, keys: Tensor, head_dim: int) -> bool:
    return (matvec.available() and qkv.is_cuda and qkv.dtype in matvec.HALF_DTYPES and keys.dtype == qkv.dtype
            and head_dim & (head_dim - 1) == 0 and keys.stride(-1) == 1 and qkv.stride(-1) == 1)


@torch.library.custom_op("dflash::qk_rope_write", mutates_args=("keys", "values"))
def qk_rope_write(qkv: Tensor, cos: Tensor, sin: Tensor, q_norm: Tensor | None, k_norm: Tensor | None, eps: float,
                  keys: Tensor, values: Tensor, rows: Tensor, pos: Tensor, num_heads: int, num_kv_heads: int) -> Tensor:
    """qkv ``[B, q, (Hq + 2 Hkv) D]`` (q, k, v heads in order), cos/sin ``[B, q, D]``, per-head
    norm weights (None: no q/k norm), the layer's cache storage ``[rows, capacity + 1, Hkv, D]``
    written at ``keys[rows[b], pos[b, t]]`` -> the rotated query ``[B, Hq, q, D]``. With
    ``num_heads`` 0 the product is k|v alone (context rows, which need no query). Indices must
    lie in the storage: the kernel writes nothing outside it (the torch code raises, or counts a
    negative index from the end)."""
    b, q = qkv.shape[:2]
    d = qkv.shape[-1] // (num_heads + 2 * num_kv_heads)
    if _kernel_takes(qkv, keys, d):
        return triton_qk_rope_write(qkv, cos, sin, q_norm, k_norm, eps, keys, values, rows, pos, num_heads,
                                    num_kv_heads)
    heads = qkv.view(b, q, num_heads + 2 * num_kv_heads, d)
    query = _norm(heads[:, :, :num_heads], q_norm, eps).transpose(1, 2)
    key = _norm(heads[:, :, num_heads:num_heads + num_kv_heads], k_norm, eps).transpose(1, 2)
    value = heads[:, :, num_heads + num_kv_heads:].transpose(1, 2)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    query = (query * cos) + (rotate_half(query) * sin)
    key = (key * cos) + (rotate_half(key) * sin)
    index = (rows[:, None], pos)
    keys.index_put_(index, key.transpose(1, 2))
    values.index_put_(index, value.transpose(1, 2))
    return query.contiguous()


@qk_rope_write.register_fake
def _qk_rope_write_shape(qkv, cos, sin, q_norm, k_norm, eps, keys, values, rows, pos, num_heads, num_kv_heads):
    b, q = qkv.shape[:2]
    d = qkv.shape[-1] // (num_heads + 2 * num_kv_heads)
    return qkv.new_empty((b, num_heads, q, d))
