"""A CE chunk's per-row loss and its gradient in one kernel, the gradient written over the logits.

The chunked CE (objective.py) turns each chunk's ``[C, V]`` logits into the rows' CE and
``dCE/dlogits = scale * (softmax - onehot)``. At the 135M-class drafter shape (30,720 rows of a
49,152-entry vocabulary: 3.0 GB of bf16 logits a step) inductor's compiled functions took 3.2 ms
of a 20.1-ms step's kernels on an H100 (docs/benchmarks.md), more than either LM-head matmul,
and wrote the gradient as a new tensor beside the logits.

Here a program per row makes two passes over its row: the first keeps a running maximum and
sum (the log-sum-exp) and reads the label's logit, the second writes the gradient over the
logits in place. The row (96 KiB at that shape) was read a moment before, so while the rows
in flight fit in L2 (some hundreds of programs) the second pass reads L2, not memory, and the
logits cross the memory bus once each way. The first pass asks the cache to keep the row, the
second to drop it. TILES lists the program shapes; the first call for a vocabulary times them.
On an H100 a chunk took 0.82x inductor's time at that shape (15,360 rows) and 0.74x at a
151,936-entry vocabulary (docs/benchmarks.md, "The CE chunk in one kernel").

The results are the torch functions' (objective.py ``_chunk_rows_and_grad``) up to float32
rounding: the sum is taken in another order. A label outside ``[0, V)`` gives a NaN CE, where
torch's gather fails; the chunked CE's labels are token ids of the target's vocabulary. A NaN
logit makes its row's CE and gradient NaN, as torch's; a +inf one gives NaN where torch gives +inf.

:func:`takes` says where it runs: CUDA logits in bf16, fp16 or fp32 with contiguous rows, and
Triton present. ``$DFLASH_CE_KERNEL``: ``auto`` (the default) or ``off`` (the compiled torch
functions, as before).
"""

from __future__ import annotations

import contextlib
import logging
import os

import torch
from torch import Tensor

from dflash_ipc.errors import ConfigError

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU builds of torch ship without Triton; the torch functions run there
    triton = None

logger = logging.getLogger(__name__)

CE_KERNEL_ENV = "DFLASH_CE_KERNEL"
SETTINGS = ("auto", "off")
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
TILES = ((8192, False, 32), (4096, False, 16), (2048, False, 8), (8192, True, 32), (4096, True, 16), (2048, True, 8))
"""The kernel's shapes: (vocabulary entries a program reads at once, LANES, warps). LANES keeps a
running maximum and sum per lane and reduces them across the program once per row (two
exponentials an entry, no barrier inside the loop); without it each step of the row reduces
across the program (one exponential an entry, two barriers a step). Which one the memory
system rewards differs by GPU: the first call for a vocabulary times them all (:func:`tile_for`)."""
TUNE_ROWS = 2048  # rows of the scratch copy a tile is timed on (200 MB at a 49,152-entry vocabulary)
FLOOR = -3.4028234663852886e38  # float32's lowest finite value: where a row's running maximum starts

if triton is not None:
    _FLOOR = tl.constexpr(FLOOR)  # a jitted function reads only constexpr globals

    @triton.jit
    def _ce_rows_kernel(x_ptr, labels_ptr, scale_ptr, ce_ptr, V, stride_row,
                        GRAD: tl.constexpr, SCALED: tl.constexpr, BLOCK: tl.constexpr, LANES: tl.constexpr):
        """Row ``program_id(0)``: its CE into ``ce``; with GRAD, ``scale * (softmax - onehot)``
        over the row (``scale`` 1 unless SCALED)."""
        row = tl.program_id(0).to(tl.int64)
        base = x_ptr + row * stride_row
        label = tl.load(labels_ptr + row)
        offs = tl.arange(0, BLOCK)
        # The running maximum starts at FLOOR, not -inf: then it is finite, x - top is never
        # -inf - -inf, and a NaN logit reaches the sum as exp(NaN) wherever it sits (GPU maxima
        # drop a NaN operand, so a maximum cannot be trusted to carry it). A row all -inf sums
        # to 0: lse -inf, as torch's.
        if LANES:
            tops = tl.full((BLOCK,), _FLOOR, tl.float32)
            sums = tl.zeros((BLOCK,), tl.float32)
            for start in range(0, V, BLOCK):
                x = tl.load(base + start + offs, mask=start + offs < V, other=float("-inf"),
                            eviction_policy="evict_last").to(tl.float32)
                new_tops = tl.maximum(tops, x)
                sums = sums * tl.exp(tops - new_tops) + tl.exp(x - new_tops)
                tops = new_tops
            top = tl.max(tops, axis=0)
            total = tl.sum(sums * tl.exp(tops - top), axis=0)
        else:
            top = tl.full((), _FLOOR, tl.float32)
            total = tl.zeros((), tl.float32)
            for start in range(0, V, BLOCK):
                x = tl.load(base + start + offs, mask=start + offs < V, other=float("-inf"),
                            eviction_policy="evict_last").to(tl.float32)
                new_top = tl.maximum(top, tl.max(x, axis=0))
                total = total * tl.exp(top - new_top) + tl.sum(tl.exp(x - new_top), axis=0)
                top = new_top
        lse = top + tl.log(total)
        valid = (label >= 0) & (label < V)
        picked = tl.load(base + label, mask=valid, other=float("nan")).to(tl.float32)
        tl.store(ce_ptr + row, lse - picked)
        if GRAD:
            scale = 1.0
            if SCALED:
                scale = tl.load(scale_ptr + row).to(tl.float32)
            for start in range(0, V, BLOCK):
                at = start + offs
                x = tl.load(base + at, mask=at < V, other=0.0, eviction_policy="evict_first").to(tl.float32)
                grad = (tl.exp(x - lse) - tl.where(at == label, 1.0, 0.0)) * scale
                tl.store(base + at, grad.to(x_ptr.dtype.element_ty), mask=at < V)


def enabled() -> bool:
    """Whether ``$DFLASH_CE_KERNEL`` lets the kernel run (SETTINGS; unset: auto)."""
    setting = os.environ.get(CE_KERNEL_ENV) or "auto"
    if setting not in SETTINGS:
        raise ConfigError(f"${CE_KERNEL_ENV}={setting!r}; allowed: {list(SETTINGS)}")
    return setting == "auto"


def takes(logits: Tensor) -> bool:
    """Whether :func:`ce_rows` runs the kernel for ``logits`` (module docstring)."""
    # not while torch.compile traces: the launch is not a traceable op
    return (triton is not None and logits.is_cuda and logits.dtype in DTYPES and logits.dim() == 2
            and logits.stride(1) == 1 and logits.shape[1] > 0 and not torch.compiler.is_compiling() and enabled())


def _launch(logits: Tensor, labels: Tensor, scale: Tensor | None, ce: Tensor, grad: bool, tile) -> None:
    block, lanes, warps = tile
    # Triton launches on the current device; CPU tensors are Triton's interpreter's (TRITON_INTERPRET=1)
    with torch.cuda.device(logits.device) if logits.is_cuda else contextlib.nullcontext():
        _ce_rows_kernel[(logits.shape[0],)](logits, labels, ce if scale is None else scale, ce, logits.shape[1],
                                            logits.stride(0), GRAD=grad, SCALED=scale is not None, BLOCK=block,
                                            LANES=lanes, num_warps=warps)


_tiles: dict[tuple, tuple[int, bool, int]] = {}


def tile_for(logits: Tensor, labels: Tensor, scale: Tensor | None, *, grad: bool) -> tuple[int, bool, int]:
    """The fastest of TILES for rows like ``logits``'s, timed once per (vocabulary, dtype, device,
    grad, scaled) on a scratch copy of TUNE_ROWS rows (``logits``'s, repeated where it has fewer,
    so a small first chunk is not timed on launch overhead alone; the host waits once per tile);
    TILES[0], untimed, inside a CUDA graph's capture. The tile sets the order of each row's sum,
    so the loss's last bits can differ between processes that picked different tiles."""
    key = (logits.shape[1], logits.dtype, logits.device, grad, scale is not None)
    if key in _tiles:
        return _tiles[key]
    if torch.cuda.is_current_stream_capturing():
        return TILES[0]
    with torch.cuda.device(logits.device):  # the events on the stream the kernels run on
        pick = torch.arange(TUNE_ROWS, device=logits.device) % logits.shape[0]
        scratch, ce = logits[pick], torch.empty(TUNE_ROWS, dtype=torch.float32, device=logits.device)
        sample = (scratch, labels[pick], None if scale is None else scale[pick], ce, grad)
        times = {}
        for tile in TILES:
            _launch(*sample, tile)  # compiles it
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(3):
                _launch(*sample, tile)
            end.record()
            end.synchronize()
            times[tile] = start.elapsed_time(end) / 3
    best = _tiles[key] = min(times, key=times.get)
    logger.info("CE kernel, vocabulary %d %s%s: tile %s, ms per %d rows: %s", logits.shape[1], logits.dtype,
                " with its gradient" if grad else "", best, TUNE_ROWS,
                ", ".join(f"{tile} {ms:.3f}" for tile, ms in times.items()))
    return best


def ce_rows(logits: Tensor, labels: Tensor, scale: Tensor | None = None, *, grad: bool,
            tile: tuple[int, bool, int] | None = None) -> Tensor:
    """logits ``[C, V]``, labels ``[C]`` -> the rows' CE ``[C]`` float32. With ``grad`` the logits
    are overwritten by ``scale[:, None] * (softmax - onehot)`` (``scale`` ``[C]``; None: 1), in
    their dtype. Only where :func:`takes` the logits. ``tile``: one of TILES (None:
    :func:`tile_for`'s)."""
    rows, vocab = logits.shape
    if labels.shape != (rows,) or (scale is not None and scale.shape != (rows,)):
        raise ValueError(f"ce_rows: logits {tuple(logits.shape)}, labels {tuple(labels.shape)} and scale "
                         f"{None if scale is None else tuple(scale.shape)} disagree on the rows")
    if labels.device != logits.device or (scale is not None and scale.device != logits.device):
        scale_on = "" if scale is None else f", scale on {scale.device}"
        raise ValueError(f"ce_rows: logits on {logits.device}, labels on {labels.device}{scale_on}: "
                         "the kernel reads them on one device")
    ce = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if rows == 0:
        return ce
    labels = labels.contiguous()
    scale = None if scale is None else scale.contiguous()
    _launch(logits, labels, scale, ce, grad, tile or tile_for(logits, labels, scale, grad=grad))
    return ce
