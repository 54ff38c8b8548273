"""A tensor to float8 at a scale known in advance: one pass that writes both layouts and the amax.

A float8 linear layer's three matmuls want its input ``x`` ``[N, K]`` twice, row-major for the
forward product (K contiguous) and transposed for the weight gradient (N contiguous: a float8
GEMM on Hopper takes both operands with the inner dimension contiguous), and its output
gradient likewise. With a scale that comes from the tensor's own abs-max (torchao's
tensorwise recipe) a cast needs the whole tensor reduced before the first element can be
written: a reduction pass, a cast pass, and a second cast for the other layout, each reading
the bf16 tensor again (~8 bytes an element). With the scale known before the pass (delayed
scaling, float8_delayed.py) one pass reads each element once (2 bytes), writes it in both
layouts (1 + 1) and folds the tile's abs-max into a running maximum for the next step's
scale: :func:`cast_to_float8`.

On CUDA with Triton the pass is one kernel (a program per ``[BLOCK_N, BLOCK_K]`` tile, the
transposed tile stored through ``tl.trans``, the abs-max by ``atomic_max``); elsewhere the
torch ops below, which are also the reference the kernel is tested against (the same
values: a multiply, a clamp and a round-to-nearest-even cast per element).
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU builds of torch ship without Triton; the torch ops run there
    triton = None

FLOAT8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
KERNEL_TRANSPOSES = (torch.bfloat16,)
"""Inputs whose transposed copy the kernel writes (activations and gradients). From float32 (the
master weights) its row-major output was right and its transposed one wrong on an H100 with the
Triton of torch 2.11: the GPU test's float32 cases failed, and a probe of every tile at [48, 4096]
found the float32 transposes wrong at each and the bf16 ones right. There the transpose is torch's
copy of the row-major float8 output: 2 bytes an element of a weight cast once a step."""

if triton is not None:
    _TILES = [triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w)
              for n, k, w in ((64, 64, 4), (64, 128, 4), (128, 64, 4), (128, 128, 8), (32, 256, 4), (128, 256, 8))]

    @triton.jit
    def _float8_cast_kernel(x_ptr, q_ptr, qt_ptr, scale_ptr, amax_ptr, N, K, stride_n, stride_k,
                     FMAX: tl.constexpr, TRANSPOSE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """Tile (program_id 0, 1) of x ``[N, K]``: ``clamp(x * scale)`` rounded into q ``[N, K]``
        and, with TRANSPOSE, qt ``[K, N]``; the tile's abs-max into ``amax`` (float32 scalar)."""
        rn = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.program_id(1).to(tl.int64) * BLOCK_K + tl.arange(0, BLOCK_K)
        inside = (rn[:, None] < N) & (rk[None, :] < K)
        x = tl.load(x_ptr + rn[:, None] * stride_n + rk[None, :] * stride_k, mask=inside, other=0.0).to(tl.float32)
        tl.atomic_max(amax_ptr, tl.max(tl.max(tl.abs(x), axis=1), axis=0))
        scale = tl.load(scale_ptr)
        q = tl.clamp(x * scale, -FMAX, FMAX).to(q_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
        tl.store(q_ptr + rn[:, None] * K + rk[None, :], q, mask=inside)
        if TRANSPOSE:
            tl.store(qt_ptr + rk[:, None] * N + rn[None, :], tl.trans(q), mask=tl.trans(inside))

    # The tile is picked by timing them at the first call of each K on a GPU. The amax side
    # effect is a maximum (idempotent) and every output is rewritten whole, so the timing's
    # repeated launches leave the same results. (Triton's CPU interpreter cannot time: it runs
    # the first tile.)
    _cast_kernel_tuned = triton.autotune(configs=_TILES, key=["K", "TRANSPOSE"])(_float8_cast_kernel)


def kernel_takes(x: Tensor) -> bool:
    """Whether :func:`cast_to_float8` runs the kernel for ``x``: a CUDA tensor (or Triton's
    interpreter on CPU, tests), Triton present, outside a torch.compile trace."""
    if triton is None or torch.compiler.is_compiling():
        return False
    return x.is_cuda or _interpreting()


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def cast_to_float8(x: Tensor, scale: Tensor, amax: Tensor, dtype: torch.dtype, *,
                   transpose: bool) -> tuple[Tensor, Tensor | None]:
    """(``x * scale`` in ``dtype``, clamped to its finite range, ``[N, K]``; the same
    ``[K, N]`` contiguous when ``transpose``, else None). ``amax`` (float32, one element) becomes
    ``max(amax, max |x|)`` in place. x ``[N, K]`` bf16, fp16 or fp32; scale a float32 scalar
    tensor on x's device (read there: the host never waits for it)."""
    if x.dim() != 2 or x.dtype not in INPUT_DTYPES or dtype not in FLOAT8_DTYPES:
        raise ValueError(f"cast_to_float8: x {tuple(x.shape)} {x.dtype} to {dtype}; "
                         f"takes 2-D {INPUT_DTYPES} to {FLOAT8_DTYPES}")
    if kernel_takes(x):
        if transpose and x.dtype not in KERNEL_TRANSPOSES:
            q, _ = _cast_kernel_launch(x, scale, amax, dtype, False)
            return q, q.t().contiguous()
        return _cast_kernel_launch(x, scale, amax, dtype, transpose)
    return cast_reference(x, scale, amax, dtype, transpose=transpose)


def cast_reference(x: Tensor, scale: Tensor, amax: Tensor, dtype: torch.dtype, *,
                   transpose: bool) -> tuple[Tensor, Tensor | None]:
    """:func:`cast_to_float8` in torch ops (CPU, and the kernel's reference)."""
    xf = x.float()
    torch.maximum(amax, xf.abs().amax().reshape(amax.shape), out=amax)
    fmax = torch.finfo(dtype).max
    q = (xf * scale).clamp(-fmax, fmax).to(dtype).contiguous()  # row-major whatever x's strides
    return q, (q.t().contiguous() if transpose else None)


def _cast_kernel_launch(x: Tensor, scale: Tensor, amax: Tensor, dtype: torch.dtype,
                        transpose: bool) -> tuple[Tensor, Tensor | None]:
    n, k = x.shape
    q = torch.empty(n, k, dtype=dtype, device=x.device)
    qt = torch.empty(k, n, dtype=dtype, device=x.device) if transpose else q
    if n and k:
        def grid(meta):
            return triton.cdiv(n, meta["BLOCK_N"]), triton.cdiv(k, meta["BLOCK_K"])

        args = (x, q, qt, scale.float(), amax, n, k, x.stride(0), x.stride(1))
        if x.is_cuda:  # Triton launches on the current device
            with torch.cuda.device(x.device):
                _cast_kernel_tuned[grid](*args, FMAX=torch.finfo(dtype).max, TRANSPOSE=transpose)
        else:  # Triton's interpreter (TRITON_INTERPRET=1): tests
            _float8_cast_kernel[grid](*args, FMAX=torch.finfo(dtype).max, TRANSPOSE=transpose,
                                      **_TILES[0].kwargs)
    return q, (qt if transpose else None)
