"""Programmatic dependent launch of the decode kernels: each one launched while the one before finishes.

At batch 1 a decode step is some 200 kernels of a few microseconds and a speculative cycle some
400, replayed from a CUDA graph; between two of them the GPU still idles, since the next kernel's
programs are scheduled only once the last one has completed and its writes are flushed. The
profile of a Qwen3-1.7B-shaped cycle on an H100 had 2.71 ms of kernels in 3.08 ms of wall time
(docs/benchmarks.md, "Launches that overlap"). On Hopper and later GPUs a kernel launched with
programmatic stream serialization (PDL) may start while the kernel before it in the stream still
runs: its programs go as far as ``griddepcontrol.wait``, which holds them until that kernel has
completed and its memory is visible, and it is launched once every program of the kernel before
has executed ``griddepcontrol.launch_dependents`` (or exited). CUDA graphs keep these edges.

Every decode kernel (matvec.py, decode_attention.py, qk_rope.py, kv_write.py, top2.py, accept.py,
band_mask.py) takes the constexpr ``PDL`` and calls :func:`wait_for_inputs` before it reads or
writes any memory that another kernel writes or reads (before it: index arithmetic alone), and
releases the kernel after it at once: that one's launch and its programs' start then overlap
this one's work. The launch passes
``launch_pdl`` with the same value (:func:`launch_args`): a kernel launched that way without its
wait would race with the one before it.

``$DFLASH_DECODE_PDL``: ``auto`` (the default: NVIDIA GPUs of compute capability 9.0 or more,
with a Triton that has ``griddepcontrol``) or ``off``.

K/V ahead of the wait: the attention kernel's programs, started under PDL while the kernel
before still runs (the q/k rotary and cache write), first ask L2 for the first K and V rows of
their span (``prefetch.global.L2``: :func:`prefetch_l2`, up to PREFETCH_BYTES a program), then
wait. The read of the cache then starts while the kernel before finishes, not after it. A
prefetch moves nothing into the program, only into L2, where every SM's reads and writes meet: a
line that the kernel before writes after it was fetched is still read as written (the new K/V
rows of a step are such lines). The products do not prefetch their weights so: on an H100 that
made the one-row step and the 16-row products slower (docs/benchmarks.md, "K/V read ahead of the
wait").
``$DFLASH_DECODE_PREFETCH``: ``auto`` (the default: wherever launches use PDL) or ``off``.
"""

from __future__ import annotations

import functools
import os

import torch

from dflash_ipc.errors import ConfigError


try:
    import triton
    import triton.language as tl
except ImportError:  # CPU builds of torch ship without Triton; nothing here is used there
    triton = None

PDL_ENV = "DFLASH_DECODE_PDL"
PREFETCH_ENV = "DFLASH_DECODE_PREFETCH"
SETTINGS = ("auto", "off")
PREFETCH_BYTES = 32 * 1024
"""The most K/V bytes one attention program asks L2 for ahead of its wait: about what an SM's
share of the GPU's bandwidth streams in the ~1 us a kernel's end and the next one's start take
(4.8 TB/s over 132 SMs is 36 KB/us on an H200); the rest the program reads as before."""
LINE_BYTES = 128
"""The bytes of one L2 line a prefetch asks for."""
MIN_CAPABILITY = (9, 0)
"""``griddepcontrol`` exists from sm_90 (Hopper) on."""


@functools.cache
def _capable(index: int) -> bool:
    # ROCm reports its own capabilities (an MI300 is 9.4): griddepcontrol is NVIDIA's PTX
    return torch.version.hip is None and torch.cuda.get_device_capability(index) >= MIN_CAPABILITY


_turned_off = False


def enabled(device) -> bool:
    """Whether the decode kernels on ``device`` launch with PDL ($DFLASH_DECODE_PDL; see the module;
    never after :func:`turn_off`)."""
    value = os.environ.get(PDL_ENV) or "auto"  # matvec.cuda_switch's rule (matvec imports this module)
    if value not in SETTINGS:
        raise ConfigError(f"${PDL_ENV}={value!r}; allowed: {list(SETTINGS)}")
    device = torch.device(device)
    return (value == "auto" and not _turned_off and device.type == "cuda" and _HAS_GDC
            and _capable(device.index if device.index is not None else torch.cuda.current_device()))


def turn_off(device) -> bool:
    """Launch without PDL from now on, in this process; whether launches on ``device`` used it until
    now. A CUDA graph capture that fails twice with PDL calls it and, if so, captures once more (graphs.py): a
    capture with overlapped launches is a newer path of the driver than one without, and the eager
    step it would otherwise fall back to is several times slower at batch 1."""
    global _turned_off
    was = enabled(device)
    _turned_off = True
    return was


def prefetch_enabled(device) -> bool:
    """Whether the attention kernel on ``device`` prefetches K/V ahead of its wait
    ($DFLASH_DECODE_PREFETCH: auto, the default, wherever launches use PDL; without PDL a program
    starts only once the kernel before has completed, so there is nothing to overlap)."""
    value = os.environ.get(PREFETCH_ENV) or "auto"
    if value not in SETTINGS:
        raise ConfigError(f"${PREFETCH_ENV}={value!r}; allowed: {list(SETTINGS)}")
    return value == "auto" and enabled(device)


def prefetch_tokens(tokens: int, row_bytes: int, device) -> tuple[int, int]:
    """(tokens, L2 lines per token) of the K and V rows (``row_bytes`` each) that an attention
    program asks for ahead of its wait, over its first ``tokens``: both powers of two (constexprs),
    at most PREFETCH_BYTES a program; (0, 1) where prefetch is off."""
    if not prefetch_enabled(device) or tokens < 1:
        return 0, 1
    lines = 1
    while lines * LINE_BYTES < row_bytes:
        lines *= 2
    cap = max(1, PREFETCH_BYTES // (2 * lines * LINE_BYTES))
    count = 1
    while count * 2 <= min(tokens, cap):
        count *= 2
    return count, lines


def launch_args(device) -> dict:
    """The launch's ``PDL`` constexpr and Triton's ``launch_pdl`` option: one value for both."""
    on = enabled(device)
    return {"PDL": on, "launch_pdl": on}


_HAS_GDC = False
"""Whether this Triton has griddepcontrol (3.4 and later)."""
if triton is not None:
    try:
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
        _HAS_GDC = True
    except ImportError:  # an older Triton: PDL stays off, and the kernels compile without the branch below
        gdc_wait = gdc_launch_dependents = None

    @triton.jit
    def wait_for_inputs(PDL: tl.constexpr):
        """Under PDL: wait until the kernel before has completed and its writes are visible, then let
        the kernel after be launched (its programs wait in turn). A kernel calls it before it touches
        memory another kernel writes or reads."""
        if PDL:
            gdc_wait()
            gdc_launch_dependents()

    @triton.jit
    def prefetch_l2(ptrs):
        """Asks L2 for the line at each of ``ptrs`` (a hint: nothing is loaded into the program). A
        kernel calls it before :func:`wait_for_inputs`, while the kernel before may still run, with
        pointers clamped inside their tensors (no address past an allocation's end)."""
        tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // dummy $0", "=r,l", [ptrs], dtype=tl.int32,
                                  is_pure=False, pack=1)
