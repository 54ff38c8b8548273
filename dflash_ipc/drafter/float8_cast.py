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
transposed tile as the next paragraph says, the abs-max by ``atomic_max``); elsewhere the
torch ops below, which are also the reference the kernel is tested against (the same
values: a multiply, a clamp and a round-to-nearest-even cast per element).

The transposed tile: from bf16 the kernel transposes the float8 tile (``tl.trans``). From
float32 (the master weights) that transpose was wrong on an H100 with the Triton of torch 2.11
(3.6) at every tile and every weight shape, as was transposing the float32 tile before the
rounding (benchmarks/float8_cast_probe.py), while the row-major output was right; there the
kernel loads the tile a second time through transposed addresses (from cache: the same bytes)
and rounds it the same way. A compiler can get a layout wrong again, so the first transposed
cast of each (device, source dtype, float8 format, K) in a process (K: what the autotuner picks
a tile by) is checked bit for bit against torch's transpose of the kernel's own row-major
output; where they differ, a warning says so and those transposes are torch's copy of the
row-major output from then on (right, and slower: docs/benchmarks.md, "fp8 with delayed
scaling", measures both).
"""

from __future__ import annotations

import logging
import os

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU builds of torch ship without Triton; the torch ops run there
    triton = None

logger = logging.getLogger(__name__)

FLOAT8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
RELOAD_TRANSPOSES = (torch.float32,)
"""Sources whose transposed tile the kernel loads again through transposed addresses rather
than transposing the float8 tile (module docstring)."""
_kernel_transposes_right: dict[tuple, bool] = {}
"""(device, source dtype, float8 dtype, K) -> whether the kernel's transposed output matched torch's
transpose of its row-major one at its first use in this process."""

if triton is not None:
    _TILES = [triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w)
              for n, k, w in ((64, 64, 4), (64, 128, 4), (128, 64, 4), (128, 128, 8), (32, 256, 4), (128, 256, 8))]

    @triton.jit
    def _float8_cast_kernel(x_ptr, q_ptr, qt_ptr, scale_ptr, amax_ptr, N, K, stride_n, stride_k,
                     FMAX: tl.constexpr, TRANSPOSE: tl.constexpr, RELOAD_TRANSPOSE: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """Tile (program_id 0, 1) of x ``[N, K]``: ``clamp(x * scale)`` rounded into q ``[N, K]``
        and, with TRANSPOSE, qt ``[K, N]`` (RELOAD_TRANSPOSE: the tile loaded again through
        transposed addresses, not ``tl.trans``); the tile's abs-max into ``amax`` (float32 scalar)."""
        rn = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.program_id(1).to(tl.int64) * BLOCK_K + tl.arange(0, BLOCK_K)
        inside = (rn[:, None] < N) & (rk[None, :] < K)
        x = tl.load(x_ptr + rn[:, None] * stride_n + rk[None, :] * stride_k, mask=inside, other=0.0).to(tl.float32)
        tl.atomic_max(amax_ptr, tl.max(tl.max(tl.abs(x), axis=1), axis=0))
        scale = tl.load(scale_ptr)
        q = tl.clamp(x * scale, -FMAX, FMAX).to(q_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
        tl.store(q_ptr + rn[:, None] * K + rk[None, :], q, mask=inside)
        if TRANSPOSE:
            if RELOAD_TRANSPOSE:  # the tile read again, transposed by its addresses (from cache), cast the same way
                xt = tl.load(x_ptr + rk[:, None] * stride_k + rn[None, :] * stride_n, mask=tl.trans(inside),
                             other=0.0).to(tl.float32)
                qt = tl.clamp(xt * scale, -FMAX, FMAX).to(qt_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
            else:
                qt = tl.trans(q)
            tl.store(qt_ptr + rk[:, None] * N + rn[None, :], qt, mask=tl.trans(inside))

    # The tile is picked by timing them at the first call of each K on a GPU. The amax side
    # effect is a maximum (idempotent) and every output is rewritten whole, so the timing's
    # repeated launches leave the same results. (Triton's CPU interpreter cannot time: it runs
    # the first tile.)
    _cast_kernel_tuned = triton.autotune(configs=_TILES,
                                         key=["K", "TRANSPOSE", "RELOAD_TRANSPOSE"])(_float8_cast_kernel)


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
    if not kernel_takes(x):
        return cast_reference(x, scale, amax, dtype, transpose=transpose)
    if not transpose:
        return _cast_kernel_launch(x, scale, amax, dtype, False)
    key = (x.device, x.dtype, dtype, x.shape[1])
    if _kernel_transposes_right.get(key) is False:
        q, _ = _cast_kernel_launch(x, scale, amax, dtype, False)
        return q, q.t().contiguous()
    q, qt = _cast_kernel_launch(x, scale, amax, dtype, True)
    if key not in _kernel_transposes_right:  # its first use in this process: one wait, once
        _kernel_transposes_right[key] = right = torch.equal(qt.view(torch.uint8), q.t().contiguous().view(torch.uint8))
        if not right:
            logger.warning("float8 cast: the Triton kernel's transposed output from %s [*, %d] to %s on %s differs "
                           "from its row-major output transposed; torch transposes those from now on (slower)",
                           x.dtype, x.shape[1], dtype, x.device)
            qt = q.t().contiguous()
    return q, qt


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
        reload = transpose and x.dtype in RELOAD_TRANSPOSES
        if x.is_cuda:  # Triton launches on the current device
            with torch.cuda.device(x.device):
                _cast_kernel_tuned[grid](*args, FMAX=torch.finfo(dtype).max, TRANSPOSE=transpose,
                                         RELOAD_TRANSPOSE=reload)
        else:  # Triton's interpreter (TRITON_INTERPRET=1): tests
            _float8_cast_kernel[grid](*args, FMAX=torch.finfo(dtype).max, TRANSPOSE=transpose, RELOAD_TRANSPOSE=reload,
                                      **_TILES[0].kwargs)
    return q, (qt if transpose else None)
