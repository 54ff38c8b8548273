"""The decode step's linear layers at batch 1: a Triton matrix-vector kernel.

At batch 1 every linear layer of a decode step is a matrix-vector product: its weight is read
once for one row, so the step is bound by how fast the weights stream. cuBLAS runs these
products as split-K GEMM tiles (``nvjet_sm90_tst_64x8`` and the like) that stream them at
1.5-2.7 TB/s at the Qwen3-1.7B shape on an H200, below 0.4 TB/s for its 4-MB k/v weights
(docs/benchmarks.md, "Batch 1: a matrix-vector kernel, fused projections"). The kernel here gives each program ``BLOCK_N``
whole rows of the weight: it streams their contiguous K once, keeps per-lane partial sums in
fp32 and reduces them once at the end, with no second pass over split-K partials. One row
only: from two rows on, cuBLAS's tiles share each read of the weight among the rows.

:func:`route_matvec` swaps a model's ``nn.Linear`` modules for :class:`MatVecLinear`, which
sends a one-row bf16/fp16 CUDA input through the custom op ``dflash::matvec_linear``; the op
is opaque to torch.compile, so a compiled decode layer calls it as it would cuBLAS, and a
CUDA graph records its launch. Where Triton is missing (CPU builds of torch) nothing is
swapped. ``$DFLASH_DECODE_GEMV``: ``auto`` (the default: on CUDA where Triton imports) or
``off``.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dflash_ipc.errors import ConfigError

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU builds of torch ship without Triton; nothing here is used there
    triton = None

HALF_DTYPES = (torch.bfloat16, torch.float16)
"""Input dtypes the kernel takes (a float32 target keeps cuBLAS: its decode is not the fast path)."""
GEMV_ENV = "DFLASH_DECODE_GEMV"
SETTINGS = ("auto", "off")


def available() -> bool:
    """Whether the kernel can run here (Triton imports and a CUDA device is present)."""
    return triton is not None and torch.cuda.is_available()


def cuda_switch(env: str, device) -> bool:
    """A decode switch read from ``$env`` (SETTINGS; unset: auto): on for a CUDA ``device`` unless off."""
    setting = os.environ.get(env) or "auto"
    if setting not in SETTINGS:
        raise ConfigError(f"${env}={setting!r}; allowed: {list(SETTINGS)}")
    return setting == "auto" and torch.device(device).type == "cuda"


def enabled(device) -> bool:
    """Whether a target on ``device`` routes its one-row linears here ($DFLASH_DECODE_GEMV)."""
    return cuda_switch(GEMV_ENV, device) and available()


if triton is not None:
    @triton.jit
    def _matvec_kernel(x_ptr, w_ptr, b_ptr, y_ptr, N, K, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
        """y[n] = sum_k x[k] w[n, k] (+ b[n]) for this program's BLOCK_N rows n of w [N, K]."""
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        offs_k = tl.arange(0, BLOCK_K)
        w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * K + offs_k[None, :]
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)  # per-lane partial sums: one reduction, at the end
        for k0 in range(0, K, BLOCK_K):
            if EVEN_K:
                w = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0, eviction_policy="evict_first")
                x = tl.load(x_ptr + k0 + offs_k)
            else:
                k_ok = k0 + offs_k < K
                w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0, eviction_policy="evict_first")
                x = tl.load(x_ptr + k0 + offs_k, mask=k_ok, other=0.0)
            acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
            w_ptrs += BLOCK_K
        y = tl.sum(acc, axis=1)
        if HAS_BIAS:
            y += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        tl.store(y_ptr + offs_n, y.to(y_ptr.dtype.element_ty), mask=n_ok)


def launch_config(n: int, k: int) -> dict:
    """Block sizes, warps and pipeline stages against an N x K weight: the best of
    benchmarks/matvec.py's sweep on an H200 for the Qwen3-1.7B and -8B layers, by N (a few hundred
    programs or more for 132 SMs; wide blocks of K where N gives few rows)."""
    if n <= 2048:
        return dict(BLOCK_N=4, BLOCK_K=1024, num_warps=8, num_stages=4)
    if n <= 4096:
        return dict(BLOCK_N=4, BLOCK_K=512, num_warps=4, num_stages=4)
    if n <= 8192:
        return dict(BLOCK_N=8, BLOCK_K=512, num_warps=4, num_stages=2)
    return dict(BLOCK_N=16, BLOCK_K=256, num_warps=4, num_stages=4)


def triton_matvec(x: Tensor, weight: Tensor, bias: Tensor | None = None, config: dict | None = None) -> Tensor:
    """``F.linear(x, weight, bias)`` by the Triton kernel for x of one row (``[..., K]`` with
    every leading size 1), weight ``[N, K]``, bias ``[N]``; fp32 sums, x's dtype out."""
    k = x.shape[-1]
    if x.numel() != k or weight.shape[1] != k:
        raise ValueError(f"triton_matvec: x {tuple(x.shape)} against weight {tuple(weight.shape)} "
                         f"(one row of the weight's K)")
    x1 = x.reshape(k).contiguous()
    weight = weight if weight.is_contiguous() else weight.contiguous()
    n = weight.shape[0]
    y = torch.empty(n, dtype=x.dtype, device=x.device)
    cfg = dict(config or launch_config(n, k))
    b = bias if bias is not None else weight  # a pointer the kernel does not read without HAS_BIAS
    _matvec_kernel[(triton.cdiv(n, cfg["BLOCK_N"]),)](x1, weight, b, y, n, k, HAS_BIAS=bias is not None,
                                                      EVEN_K=k % cfg["BLOCK_K"] == 0, **cfg)
    return y.reshape(*x.shape[:-1], n)


@torch.library.custom_op("dflash::matvec_linear", mutates_args=())
def matvec_linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """``F.linear``, by the Triton kernel where x is one row on CUDA."""
    if x.numel() != x.shape[-1] or not x.is_cuda:
        return F.linear(x, weight, bias)
    return triton_matvec(x, weight, bias)


@matvec_linear.register_fake
def _matvec_linear_shape(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


class MatVecLinear(nn.Linear):
    """An ``nn.Linear`` whose one-row bf16/fp16 CUDA inputs go through ``dflash::matvec_linear``
    (a frozen target's: the op has no backward)."""

    @classmethod
    def sharing(cls, linear: nn.Linear) -> MatVecLinear:
        """A MatVecLinear over ``linear``'s own parameters (nothing copied)."""
        module = cls.__new__(cls)
        nn.Module.__init__(module)
        module.in_features, module.out_features = linear.in_features, linear.out_features
        module.weight, module.bias = linear.weight, linear.bias
        return module

    def forward(self, x: Tensor) -> Tensor:
        if x.is_cuda and x.dtype in HALF_DTYPES and x.dtype == self.weight.dtype and x.numel() == x.shape[-1]:
            return torch.ops.dflash.matvec_linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


def route_matvec(*modules: nn.Module) -> int:
    """Replace every plain ``nn.Linear`` under ``modules`` (a decoder, with its LM head) by a
    :class:`MatVecLinear` over the same parameters; how many were replaced."""
    count = 0
    for root in modules:
        if type(root) is nn.Linear:
            raise ValueError("route_matvec: pass the module that holds the linear layer, not the layer")
        for parent in list(root.modules()):
            for name, child in list(parent.named_children()):
                if type(child) is nn.Linear:
                    setattr(parent, name, MatVecLinear.sharing(child))
                    count += 1
    return count
