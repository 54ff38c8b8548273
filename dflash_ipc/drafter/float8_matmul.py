"""One float8 GEMM, on the tensor cores or emulated: what the float8 LM head (precision.py) and the
delayed recipe's layers (float8_delayed.py) both multiply with."""

from __future__ import annotations

import torch
from torch import Tensor


def scaled_matmul(a: Tensor, b: Tensor, a_inv: Tensor, b_inv: Tensor, out_dtype: torch.dtype, *,
                  fast_accum: bool, emulate: bool) -> Tensor:
    """``(a * a_inv) @ (b * b_inv)``: a ``[M, K]`` row-major and b ``[K, N]`` column-major in
    float8, a_inv ``[M, 1]`` or ``[]``, b_inv ``[1, N]`` or ``[]``. ``emulate``: float32
    operands and matmul (any device), for tests."""
    if emulate:
        return ((a.float() * a_inv) @ (b.float() * b_inv)).to(out_dtype)
    return torch._scaled_mm(a, b, scale_a=a_inv, scale_b=b_inv, out_dtype=out_dtype, use_fast_accum=fast_accum)
