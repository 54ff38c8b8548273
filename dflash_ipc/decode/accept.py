"""A greedy speculative cycle's end in one launch: acceptance, the host's copy, the next inputs.

After the verify forward of a greedy cycle the target's tokens ``[B, bs]`` (with their margins
and top logits) and the drafts ``[B, bs-1]`` are on the device. The cycle then needs, per row:
how many drafts lead the target's tokens (``accepted``), one float32 row for the host to read
(accepted, tokens, margins, tops: eval/decoding.py ``LaunchedCycle``) and the next cycle's
inputs, which a cycle queued ahead reads on the device (the token at ``accepted``, the cache
length ``accepted + 1`` on, at most ``limit``: a running row never reaches it, since its cache
holds its prompt, its budget and a block; an idle row, whose inputs nobody reads, stays inside
the cache by it). In torch that is some fifteen launches of a few
microseconds (a compare, a cast, a cumulative product, a sum, a gather, the casts and the
concatenation of the host row, the copies into a CUDA graph's static buffers), each a gap in a
batch-1 cycle of ~3 ms. Here one program per row does all of it, with the same integer logic,
so the results are the torch path's exactly (token ids travel as float32: exact below 2**24).

:func:`greedy_accept_packed` runs the kernel for CUDA tensors, torch's ops elsewhere.
``$DFLASH_DECODE_FUSED_ACCEPT``: ``auto`` (the default: on CUDA where Triton imports) or ``off``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dflash_ipc.decode import pdl
from dflash_ipc.decode.matvec import available, cuda_switch, triton

FUSED_ACCEPT_ENV = "DFLASH_DECODE_FUSED_ACCEPT"
if triton is not None:
    import triton.language as tl

    from dflash_ipc.decode.pdl import wait_for_inputs

    # ``limit`` moves with the caches' capacity: specialised on its value (Triton's default for
    # integers: divisible by 16 or not), a new capacity could compile inside a graph capture.
    @triton.jit(do_not_specialize=["limit"])
    def _accept_kernel(drafted_ptr, tokens_ptr, margins_ptr, tops_ptr, starts_ptr, packed_ptr, anchors_ptr,
                       next_starts_ptr, limit, BS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
        """Row ``program_id(0)``: drafts ``[bs-1]``, target tokens, margins, tops ``[bs]`` (all rows
        contiguous) -> its host row ``[1 + 3 bs]``, next anchor and next start."""
        row = tl.program_id(0).to(tl.int64)
        i = tl.arange(0, BLOCK)
        in_block = i < BS
        wait_for_inputs(PDL)  # pdl.py
        tokens = tl.load(tokens_ptr + row * BS + i, mask=in_block, other=0)
        drafted = tl.load(drafted_ptr + row * (BS - 1) + i, mask=i < BS - 1, other=0)
        # The first position whose draft differs from the target's token, or bs-1 (none left to
        # check): the number of drafts accepted.
        missed = (drafted != tokens) | (i >= BS - 1)
        accepted = tl.min(tl.where(missed, i, BLOCK), axis=0)
        anchor = tl.sum(tl.where(i == accepted, tokens, 0), axis=0)
        start = tl.load(starts_ptr + row)
        margins = tl.load(margins_ptr + row * BS + i, mask=in_block)
        tops = tl.load(tops_ptr + row * BS + i, mask=in_block)
        out = packed_ptr + row * (1 + 3 * BS)
        tl.store(out, accepted.to(tl.float32))
        tl.store(out + 1 + i, tokens.to(tl.float32), mask=in_block)
        tl.store(out + 1 + BS + i, margins, mask=in_block)
        tl.store(out + 1 + 2 * BS + i, tops, mask=in_block)
        tl.store(anchors_ptr + row, anchor)
        tl.store(next_starts_ptr + row, tl.minimum(start + accepted + 1, limit))


def enabled(device) -> bool:
    """Whether greedy cycles on ``device`` end in the kernel ($DFLASH_DECODE_FUSED_ACCEPT)."""
    return cuda_switch(FUSED_ACCEPT_ENV, device) and available()


def torch_accept_packed(drafted: Tensor, tokens: Tensor, margins: Tensor, tops: Tensor, starts: Tensor,
                        limit: int) -> tuple[Tensor, Tensor, Tensor]:
    """What the kernel computes, by torch's ops (:func:`greedy_accept_packed`)."""
    accepted = (drafted == tokens[:, :-1]).int().cumprod(1).sum(1)
    packed = torch.cat([accepted[:, None].float(), tokens.float(), margins.float(), tops.float()], dim=1)
    anchors = tokens.gather(1, accepted[:, None].long())[:, 0]
    return packed, anchors, (starts + accepted + 1).clamp_max(limit)


def greedy_accept_packed(drafted: Tensor, tokens: Tensor, margins: Tensor, tops: Tensor, starts: Tensor, limit: int,
                         out: tuple[Tensor, Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """drafts ``[B, bs-1]``, the target's greedy tokens ``[B, bs]`` (int64), their margins and top
    logits ``[B, bs]`` (float32), cache lengths ``starts`` ``[B]`` (int64) ->

    - ``packed`` ``[B, 1 + 3 bs]`` float32: accepted drafts, tokens, margins, tops;
    - the next cycle's anchors ``[B]``: each row's token at ``accepted`` (its last committed one);
    - its starts ``[B]``: ``starts + accepted + 1``, at most ``limit``.

    ``out``: three tensors of those shapes to write them into (a CUDA graph's static buffers; the
    starts may be ``starts`` itself), returned."""
    b, bs = tokens.shape
    if drafted.shape != (b, bs - 1) or margins.shape != (b, bs) or tops.shape != (b, bs) or starts.shape != (b,):
        raise ValueError(f"greedy_accept_packed: drafted {tuple(drafted.shape)}, tokens {tuple(tokens.shape)}, "
                         f"margins {tuple(margins.shape)}, tops {tuple(tops.shape)}, starts {tuple(starts.shape)}: "
                         f"want [B, bs-1], [B, bs], [B, bs], [B, bs], [B]")
    if not (tokens.is_cuda and enabled(tokens.device) and tokens.dtype == drafted.dtype == starts.dtype == torch.int64
            and margins.dtype == tops.dtype == torch.float32 and bs >= 2):
        results = torch_accept_packed(drafted, tokens, margins, tops, starts, limit)
        if out is None:
            return results
        for o, r in zip(out, results):
            o.copy_(r)
        return out
    if out is None:
        out = (torch.empty(b, 1 + 3 * bs, dtype=torch.float32, device=tokens.device),
               torch.empty_like(starts), torch.empty_like(starts))
    packed, anchors, next_starts = out
    if not (packed.shape == (b, 1 + 3 * bs) and packed.dtype == torch.float32 and anchors.shape == next_starts.shape
            == (b,) and anchors.dtype == next_starts.dtype == torch.int64
            and all(t.is_contiguous() and t.device == tokens.device for t in out)):
        raise ValueError(f"greedy_accept_packed: out {[(tuple(t.shape), t.dtype, t.device) for t in out]}; want "
                         f"contiguous [{b}, {1 + 3 * bs}] float32, [{b}] and [{b}] int64 on {tokens.device}")
    inputs = [t.contiguous() for t in (drafted, tokens, margins, tops, starts)]
    with torch.cuda.device(tokens.device):  # Triton launches on the current device
        _accept_kernel[(b,)](*inputs, packed, anchors, next_starts, limit, BS=bs,
                             BLOCK=triton.next_power_of_2(bs), num_warps=1, **pdl.launch_args(tokens.device))
    return out
