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
SETTINGS = ("auto", "off")
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
    now. A CUDA graph capture that fails calls it and, if so, captures once more (graphs.py): a
    capture with overlapped launches is a newer path of the driver than one without, and the eager
    step it would otherwise fall back to is several times slower at batch 1."""
    global _turned_off
    was = enabled(device)
    _turned_off = True
    return was


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
