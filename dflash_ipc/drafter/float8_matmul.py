"""What the float8 LM head (precision.py) and the delayed recipe's layers (float8_delayed.py)
share: the formats, the scale of an abs-max, and one float8 GEMM, on the tensor cores or emulated."""

from __future__ import annotations

import torch
from torch import Tensor

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
AMAX_EPS = 1e-12  # as torchao: an all-zero tensor gets a finite scale
MM_MULTIPLE = 16  # torch._scaled_mm: inner and output dims must be multiples of 16


def float8_scale(amax: Tensor, dtype: torch.dtype, *, pow2: bool = False) -> Tensor:
    """float32 scale taking ``amax`` to the largest finite value of ``dtype`` (rounded down to
    a power of two when ``pow2``: scaling is then exact)."""
    scale = torch.finfo(dtype).max / amax.float().clamp_min(AMAX_EPS)
    return torch.exp2(torch.floor(torch.log2(scale))) if pow2 else scale


def scaled_matmul(a: Tensor, b: Tensor, a_inv: Tensor, b_inv: Tensor, out_dtype: torch.dtype, *,
                  fast_accum: bool, emulate: bool) -> Tensor:
    """``(a * a_inv) @ (b * b_inv)``: a ``[M, K]`` row-major and b ``[K, N]`` column-major in
    float8, a_inv ``[M, 1]`` or ``[]``, b_inv ``[1, N]`` or ``[]``. ``emulate``: float32
    operands and matmul (any device), for tests."""
    if emulate:
        return ((a.float() * a_inv) @ (b.float() * b_inv)).to(out_dtype)
    return torch._scaled_mm(a, b, scale_a=a_inv, scale_b=b_inv, out_dtype=out_dtype, use_fast_accum=fast_accum)
