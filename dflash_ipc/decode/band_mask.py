"""A forward's band mask in one launch.

Every batched forward of a decode step or a speculative cycle builds the boolean mask of its
queries (ragged_attention.py :func:`~dflash_ipc.decode.ragged_attention.band_mask`: key ``t``
visible to query ``(b, i)`` iff ``lo <= t < hi``). In torch that is an ``arange``, two
comparisons and their ``&`` (a sliding window's lower edge, and a ``lo`` of zeros, one launch
more each): four to six launches of a microsecond or two per mask, and a batch-1 cycle builds
two (the verify's and the drafter's block), a plain step one. Here a program per (query, chunk
of keys) writes the same mask in one launch.

:func:`triton_band_mask` takes CUDA index tensors outside a torch.compile trace (the compiler
fuses the torch ops itself). ``$DFLASH_DECODE_BAND_MASK``: ``auto`` (the default: on CUDA where
Triton imports) or ``off``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dflash_ipc.decode import pdl
from dflash_ipc.decode.matvec import available, cuda_switch, triton

BAND_MASK_ENV = "DFLASH_DECODE_BAND_MASK"
BLOCK = 1024
"""Keys per program."""
INDEX_DTYPES = (torch.int32, torch.int64)

if triton is not None:
    import triton.language as tl

    from dflash_ipc.decode.pdl import wait_for_inputs

    # length and window change with the cache's key span: specialised on their values, a new span
    # could compile inside a CUDA graph capture.
    @triton.jit(do_not_specialize=["length", "window"])
    def _band_kernel(lo_ptr, hi_ptr, out_ptr, Q, length, window, s_lo_b, s_lo_q, s_hi_b, s_hi_q,
                     HAS_LO: tl.constexpr, HAS_WINDOW: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
        """Query ``program_id(0)`` (= b * Q + i), keys ``program_id(1) * BLOCK`` on: ``out[b, 0, i, t]``
        = ``lo <= t < hi`` (``lo`` 0 without HAS_LO; at least ``hi - window`` with HAS_WINDOW)."""
        r, chunk = tl.program_id(0), tl.program_id(1)
        b, i = r // Q, r % Q
        t = chunk * BLOCK + tl.arange(0, BLOCK)
        wait_for_inputs(PDL)  # pdl.py
        hi = tl.load(hi_ptr + b.to(tl.int64) * s_hi_b + i * s_hi_q).to(tl.int64)
        if HAS_LO:
            lo = tl.load(lo_ptr + b.to(tl.int64) * s_lo_b + i * s_lo_q).to(tl.int64)
        else:
            lo = tl.zeros([], dtype=tl.int64)
        if HAS_WINDOW:
            lo = tl.maximum(lo, hi - window)
        visible = (t >= lo) & (t < hi)
        tl.store(out_ptr + r.to(tl.int64) * length + t, visible.to(tl.uint8), mask=t < length)


def enabled(device) -> bool:
    """Whether masks on ``device`` take the kernel ($DFLASH_DECODE_BAND_MASK)."""
    return cuda_switch(BAND_MASK_ENV, device) and available()


def takes(lo: Tensor | None, hi: Tensor) -> bool:
    """Whether :func:`triton_band_mask` builds this mask (CUDA ``[B, q]`` indices, not traced)."""
    return (hi.is_cuda and hi.dim() == 2 and hi.dtype in INDEX_DTYPES and hi.numel() > 0
            and (lo is None or (lo.shape == hi.shape and lo.dtype in INDEX_DTYPES and lo.device == hi.device))
            and not torch.compiler.is_compiling() and enabled(hi.device))


def triton_band_mask(lo: Tensor | None, hi: Tensor, length: int, window: int | None = None) -> Tensor:
    """``[B, 1, q, length]`` bool: key ``t`` visible to query ``(b, i)`` iff ``lo[b, i] <= t <
    hi[b, i]`` and, with a window, ``t >= hi[b, i] - window`` (``lo`` None: 0)."""
    b, q = hi.shape
    out = torch.empty(b, 1, q, length, dtype=torch.bool, device=hi.device)
    if length == 0:
        return out
    lo_strides = lo.stride() if lo is not None else (0, 0)
    with torch.cuda.device(hi.device):  # Triton launches on the current device
        _band_kernel[(b * q, triton.cdiv(length, BLOCK))](
            lo if lo is not None else hi, hi, out.view(torch.uint8), q, length, window or 0, *lo_strides, *hi.stride(),
            HAS_LO=lo is not None, HAS_WINDOW=window is not None, BLOCK=BLOCK, num_warps=4,
            **pdl.launch_args(hi.device))
    return out
