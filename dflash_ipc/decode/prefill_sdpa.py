"""Which of torch's SDPA kernels a prefill's attention may run.

A prefill's attention (ragged_attention.gqa_attention: a boolean band mask, the prompt's
width as the query and key length) goes through ``F.scaled_dot_product_attention``, which on a
Hopper GPU prefers cuDNN's fused attention. cuDNN builds an execution plan for every new
problem shape, and a prefill's shape is new with nearly every prompt (its rows and its width
are the prompts'), so each one pays for a plan. The memory-efficient kernel takes the same
mask with no per-shape set-up. ``benchmarks/prefill.py`` times a prefill at fresh and at
repeated widths both ways (docs/benchmarks.md, "The prefill's attention kernel").

``$DFLASH_DECODE_PREFILL_SDPA`` (matvec.SETTINGS): ``auto``, the default, keeps cuDNN out of
a CUDA prefill (flash, memory-efficient and math remain: flash takes no mask, so the band
masks run memory-efficient); ``off`` leaves the choice to torch. Decode steps and verify passes
take decode_attention.py's kernel, and so does a prefill short enough for it (at most 128 query
rows per K/V head, in a half dtype), so this touches the longer prefills only.
"""

from __future__ import annotations

import contextlib

import torch

from dflash_ipc.decode.matvec import cuda_switch

PREFILL_SDPA_ENV = "DFLASH_DECODE_PREFILL_SDPA"


def without_cudnn(device) -> bool:
    """Whether a prefill on ``device`` keeps cuDNN attention out ($DFLASH_DECODE_PREFILL_SDPA)."""
    return cuda_switch(PREFILL_SDPA_ENV, device)


def prefill_backends(device) -> contextlib.AbstractContextManager:
    """A context in which SDPA picks among the prefill's kernels (see the module docstring)."""
    if not without_cudnn(device):
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])
