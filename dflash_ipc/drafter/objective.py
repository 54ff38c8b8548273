"""The DFlash training objective: anchors, blocks, labels, loss weights, chunked CE.

Per sequence, up to ``max_anchors`` anchors are drawn without repeats among positions
``p`` with ``loss_mask[p] and loss_mask[p+1]``. Each anchor opens a block

    ids        [input_ids[a], MASK, MASK, ..., MASK]        (block_size tokens)
    positions  a+0, a+1, ..., a+bs-1
    labels     -,   input_ids[a+1], ..., input_ids[a+bs-1]
    weights    0,   exp(0/g), exp(-1/g), ..., exp(-(bs-2)/g)  (g = gamma, 7 for bs 16)

and a label beyond the sequence end or on a ``loss_mask == 0`` token gets weight 0.
The loss of one rank is ``sum_i w_i * CE_i``; the trainer divides by the weight sum
all-reduced over ranks, so any number of ranks computes the same loss as one.

``objective.weighting: dpace`` (D-PACE, arXiv 2605.18810; speculators' DFlash default)
replaces the fixed decay by weights computed every step, per block, from the drafter's own
confidence ``q_k = exp(-CE_k)`` (detached) at each valid slot k:

    q~_k = (1 - alpha) q_k + alpha                     smoothed (alpha = 0.5), >= alpha
    C_k  = prod_{i <= k} q~_i                          cumulative confidence (invalid i: factor 1)
    w_k  = sum_{m >= k, m valid} C_m                   = d E / d log q~_k

where ``E = sum_m prod_{i <= m} q~_i`` is a surrogate of the expected number of accepted
draft tokens (the paper's Eqs. 7-8): each slot's CE is weighted by E's derivative in that
slot's log q~ (not in log q, which would add the factor (1 - alpha) q / q~). The batch's ``weights``
then hold 1 at every valid slot (0 elsewhere), so the trainer's denominator is the number of
valid slots (speculators' normalisation, global over ranks); the loss is sum w * CE / N.
It is computed in the same pass as the CE: per-row CE and unweighted gradient first, then
the weights, then the gradient rows scaled by them (``weighted_ce_sum(dpace=...)``).

Anchors depend only on (seed, epoch, sample id): the same sample gets the same anchors
on any rank and in any batch, and new anchors every epoch.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from dflash_ipc.drafter import ce_kernel
from dflash_ipc.drafter.attention import BlockLayout
from dflash_ipc.drafter.host_copy import to_device
from dflash_ipc.drafter.model import CudaCompiled, compile_enabled
from dflash_ipc.hf.target_head import FrozenTargetHead
from dflash_ipc.errors import DataError

logger = logging.getLogger(__name__)

WEIGHTINGS = ("decay", "dpace")


@dataclass
class TrainingBatch:
    """Everything about one step's blocks except the target features."""

    block_ids: Tensor  # [Q] long: anchor token then mask_token_id
    block_positions: Tensor  # [Q] long: anchor+0..bs-1, positions within the sequence
    labels: Tensor  # [Q] long: target token (any valid id where weight == 0)
    weights: Tensor  # [Q] float32: loss weight, 0 where no loss
    layout: BlockLayout  # query/key membership for attention.build_mask
    num_anchors: int
    loss_rows: Tensor | None = None
    """``[R]`` long: the rows with a nonzero weight, found where the batch was built (the
    host, in the trainer), so the chunked CE needs no device-to-host sync to count them."""

    @property
    def context_positions(self) -> Tensor:
        """``[T_ctx]`` long: position of every packed context token within its sequence."""
        return self.layout.ctx_pos.long()

    def to(self, device: torch.device | str) -> "TrainingBatch":
        """The same batch on ``device``; to a GPU in one non-blocking copy (host_copy.py), so the
        host can build it while the previous step runs."""
        layout_names = [f.name for f in dataclasses.fields(self.layout) if isinstance(getattr(self.layout, f.name), Tensor)]
        names = [f.name for f in dataclasses.fields(self) if isinstance(getattr(self, f.name), Tensor)]
        moved = to_device([getattr(self, n) for n in names] + [getattr(self.layout, n) for n in layout_names], device)
        layout = dataclasses.replace(self.layout, **dict(zip(layout_names, moved[len(names):])))
        return dataclasses.replace(self, layout=layout, **dict(zip(names, moved[:len(names)])))


def anchor_generator(seed: int, epoch: int, sample_id: int) -> torch.Generator:
    """A CPU generator seeded from (seed, epoch, sample_id) only, through a stable hash."""
    digest = hashlib.blake2b(f"dflash-anchors:{seed}:{epoch}:{sample_id}".encode(), digest_size=8).digest()
    gen = torch.Generator(device="cpu")
    gen.manual_seed(int.from_bytes(digest, "little") & ((1 << 63) - 1))
    return gen


def sample_anchors(loss_mask: np.ndarray | Tensor, max_anchors: int, generator: torch.Generator) -> Tensor:
    """Sorted anchor positions (long, CPU): eligible ones only, no repeats, at most ``max_anchors``."""
    if max_anchors < 0:
        raise DataError(f"max_anchors={max_anchors} must be >= 0")
    mask = torch.as_tensor(np.asarray(loss_mask) if not isinstance(loss_mask, Tensor) else loss_mask)
    mask = mask.to(device="cpu", dtype=torch.bool).reshape(-1)
    eligible = torch.nonzero(mask[:-1] & mask[1:]).squeeze(1)  # p with p+1 < len
    n = int(eligible.numel())
    if n <= max_anchors:
        return eligible
    pick = torch.randperm(n, generator=generator)[:max_anchors]
    return eligible[pick].sort().values


def block_loss_weights(block_size: int, gamma: float) -> Tensor:
    """``[block_size]`` float32: 0 at k=0, ``exp(-(k-1)/gamma)`` for k >= 1."""
    if block_size < 2 or gamma <= 0:
        raise DataError(f"block_size={block_size} must be >= 2 and gamma={gamma} > 0")
    k = torch.arange(block_size, dtype=torch.float32)
    w = torch.exp(-(k - 1) / gamma)
    w[0] = 0.0
    return w


def dpace_weights(ce: Tensor, valid: Tensor, alpha: float) -> Tensor:
    """D-PACE weights ``[A, bs]`` of per-slot CE ``[A, bs]`` (see the module docstring);
    ``valid`` ``[A, bs]`` bool marks the slots that carry loss; 0 elsewhere. No gradient."""
    if not 0 < alpha <= 1:
        raise DataError(f"dpace alpha={alpha} must be in (0, 1]")
    with torch.no_grad():
        q = torch.exp(-ce.double())
        smooth = torch.where(valid, (1 - alpha) * q + alpha, torch.ones_like(q))  # invalid: no-op in the product
        cumulative = torch.cumprod(smooth, dim=1) * valid  # C_k, invalid slots left out of the sums
        return torch.flip(torch.cumsum(torch.flip(cumulative, [1]), dim=1), [1]) * valid  # sum over m >= k


def _check_anchors(anchors_per_seq: list[Tensor], lengths: Tensor) -> None:
    if len(anchors_per_seq) != lengths.numel():
        raise DataError(f"anchors_per_seq has {len(anchors_per_seq)} entries for {lengths.numel()} sequences")
    for s, a in enumerate(anchors_per_seq):
        if a.numel() and (int(a.min()) < 0 or int(a.max()) >= int(lengths[s])):
            raise DataError(f"sequence {s}: anchors must lie in [0, {int(lengths[s])}), got {a.tolist()[:8]}...")


def build_training_batch(
    input_ids: Tensor,
    loss_mask: Tensor,
    cu_seqlens: Tensor,
    anchors_per_seq: list[Tensor],
    *,
    block_size: int,
    mask_token_id: int,
    gamma: float,
    weighting: str = "decay",
) -> TrainingBatch:
    """Blocks, labels, weights and attention layout of one packed batch.

    ``input_ids``/``loss_mask`` are packed ``[T]``; ``cu_seqlens`` ``[S+1]``;
    ``anchors_per_seq[s]`` holds anchor positions local to sequence ``s``. ``weighting``:
    ``decay`` (exp(-(k-1)/gamma)) or ``dpace`` (1 at every valid slot; the loss computes
    the weights). The result lives on ``input_ids.device``.
    """
    if weighting not in WEIGHTINGS:
        raise DataError(f"weighting {weighting!r} is not one of {WEIGHTINGS}")
    dev = input_ids.device
    cu = cu_seqlens.to(device=dev, dtype=torch.long)
    lengths = cu[1:] - cu[:-1]  # [S]
    _check_anchors(anchors_per_seq, lengths.cpu())
    counts = torch.tensor([a.numel() for a in anchors_per_seq], dtype=torch.long, device=dev)
    num_seqs = lengths.numel()
    anchors = torch.cat([a.reshape(-1).long() for a in anchors_per_seq]).to(dev) if num_seqs else cu[:0]
    seq_of = torch.repeat_interleave(torch.arange(num_seqs, device=dev), counts)  # [A]
    num_anchors = int(anchors.numel())

    k = torch.arange(block_size, device=dev)
    pos = anchors[:, None] + k[None, :]  # [A, bs] positions within the sequence
    start = cu[seq_of][:, None]  # [A, 1] packed offset of the sequence
    in_seq = pos < lengths[seq_of][:, None]  # [A, bs]
    flat = torch.where(in_seq, start + pos, start)  # [A, bs] packed index, clamped in-sequence
    has_label = in_seq & loss_mask.to(dev).bool()[flat]
    if weighting == "decay":
        weights = block_loss_weights(block_size, gamma).to(dev)[None, :] * has_label  # [A, bs]
    else:  # dpace: slot 0 (the anchor itself) is never trained
        weights = (has_label & (k >= 1)[None, :]).float()
    labels = torch.where(in_seq, input_ids[flat], torch.zeros_like(flat))
    block_ids = torch.full_like(pos, mask_token_id)
    block_ids[:, 0] = input_ids[start[:, 0] + anchors]

    ctx_seq = torch.repeat_interleave(torch.arange(num_seqs, device=dev), lengths)  # [T]
    layout = BlockLayout(
        query_seq=seq_of.repeat_interleave(block_size).int(),
        query_anchor=anchors.repeat_interleave(block_size).int(),
        query_block=torch.arange(num_anchors, device=dev).repeat_interleave(block_size).int(),
        ctx_seq=ctx_seq.int(),
        ctx_pos=(torch.arange(int(cu[-1]), device=dev) - cu[ctx_seq]).int(),
        cu_seqlens=cu.int(),
        block_size=block_size,
    )
    flat_weights = weights.reshape(-1).float()
    return TrainingBatch(
        block_ids=block_ids.reshape(-1),
        block_positions=pos.reshape(-1),
        labels=labels.reshape(-1).long(),
        weights=flat_weights,
        layout=layout,
        num_anchors=num_anchors,
        loss_rows=torch.nonzero(flat_weights).squeeze(1),
    )


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Softmax and loss dtype: never below float32 (float64 for a float64 head)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _chunk_loss(logits: Tensor, labels: Tensor, weights: Tensor) -> Tensor:
    """``sum_i w_i * (lse_i - logit_i[y_i])`` of one chunk; logits ``[C, V]`` any dtype."""
    x = logits.to(_acc_dtype(logits.dtype))  # [C, V]
    lse = torch.logsumexp(x, dim=-1)  # [C]
    return ((lse - x.gather(1, labels[:, None])[:, 0]) * weights).sum()


def _chunk_loss_and_grad(logits: Tensor, labels: Tensor, weights: Tensor) -> tuple[Tensor, Tensor]:
    """(chunk loss, ``dL/dlogits = w * (softmax - onehot)`` in the logits' dtype).

    Written for torch.compile: the one-hot is an index compare, not a scatter, so the
    float32 upcast, the row max/sum and the gradient fuse into two reads of the logits
    and one write, where the eager code makes ~8 full passes (and float32 copies).
    """
    acc = _acc_dtype(logits.dtype)
    x = logits.to(acc)  # [C, V]
    lse = torch.logsumexp(x, dim=-1)  # [C]
    y = labels[:, None]  # [C, 1]
    loss = ((lse - x.gather(1, y)[:, 0]) * weights).sum()
    onehot = torch.arange(x.shape[1], device=x.device)[None, :] == y  # [C, V]
    grad = (torch.exp(x - lse[:, None]) - onehot.to(acc)) * weights[:, None]  # [C, V]
    return loss, grad.to(logits.dtype)


def _chunk_loss_and_grad_eager(logits: Tensor, labels: Tensor, weights: Tensor) -> tuple[Tensor, Tensor]:
    """Same values as :func:`_chunk_loss_and_grad`, in place to bound eager memory: one
    float32 ``[C, V]`` block plus what logsumexp allocates."""
    x = logits.to(_acc_dtype(logits.dtype))  # [C, V]
    y = labels[:, None]  # [C, 1]
    lse = torch.logsumexp(x, dim=-1)  # [C]
    loss = ((lse - x.gather(1, y)[:, 0]) * weights).sum()
    probs = x.sub_(lse[:, None]).exp_()  # softmax, in place of the logits
    probs.scatter_add_(1, y, -torch.ones_like(y, dtype=probs.dtype))
    return loss, probs.mul_(weights[:, None]).to(logits.dtype)


def _chunk_rows(logits: Tensor, labels: Tensor) -> Tensor:
    """``[C]`` per-row CE ``lse_i - logit_i[y_i]`` (float32 or float64)."""
    x = logits.to(_acc_dtype(logits.dtype))  # [C, V]
    return torch.logsumexp(x, dim=-1) - x.gather(1, labels[:, None])[:, 0]


def _chunk_rows_and_grad(logits: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
    """(per-row CE ``[C]``, unweighted ``dCE/dlogits = softmax - onehot`` in the logits' dtype):
    D-PACE's pass, whose weights exist only once every row's CE does."""
    acc = _acc_dtype(logits.dtype)
    x = logits.to(acc)  # [C, V]
    lse = torch.logsumexp(x, dim=-1)  # [C]
    y = labels[:, None]  # [C, 1]
    onehot = torch.arange(x.shape[1], device=x.device)[None, :] == y  # [C, V]
    return lse - x.gather(1, y)[:, 0], (torch.exp(x - lse[:, None]) - onehot.to(acc)).to(logits.dtype)


_fused_chunk_rows = CudaCompiled(_chunk_rows, dynamic_args=(0, 1))
_fused_chunk_rows_and_grad = CudaCompiled(_chunk_rows_and_grad, dynamic_args=(0, 1))
_fused_chunk_loss = CudaCompiled(_chunk_loss, dynamic_args=(0, 1, 2))
_fused_chunk_loss_and_grad = CudaCompiled(_chunk_loss_and_grad, dynamic_args=(0, 1, 2))


def _loss_and_grad(logits: Tensor, labels: Tensor, weights: Tensor) -> tuple[Tensor, Tensor]:
    """(chunk loss, ``dL/dlogits``): by ce_kernel.py's kernel where it takes the logits (the
    gradient then overwrites them), else compiled on CUDA, else eager."""
    if ce_kernel.takes(logits):
        ce = ce_kernel.ce_rows(logits, labels, weights, grad=True)
        return (ce * weights).sum(), logits
    if logits.is_cuda and compile_enabled():
        return _fused_chunk_loss_and_grad.compiled(logits, labels, weights)
    return _chunk_loss_and_grad_eager(logits, labels, weights)


def _loss(logits: Tensor, labels: Tensor, weights: Tensor) -> Tensor:
    """The chunk's loss alone (no gradient wanted)."""
    if ce_kernel.takes(logits):
        return (ce_kernel.ce_rows(logits, labels, grad=False) * weights).sum()
    return _fused_chunk_loss(logits, labels, weights)


def _rows(logits: Tensor, labels: Tensor) -> Tensor:
    """The chunk's per-row CE alone (D-PACE, no gradient wanted)."""
    if ce_kernel.takes(logits):
        return ce_kernel.ce_rows(logits, labels, grad=False)
    return _fused_chunk_rows(logits, labels)


def _rows_and_grad(logits: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
    """(per-row CE, unweighted ``dCE/dlogits``), D-PACE's pass: as :func:`_loss_and_grad`."""
    if ce_kernel.takes(logits):
        return ce_kernel.ce_rows(logits, labels, grad=True), logits
    return _fused_chunk_rows_and_grad(logits, labels)


LOGIT_BYTES = 4
"""Bytes per (row, vocab entry) that one CE chunk holds at most on CUDA: its bf16 logits and a
bf16 gradient beside them (inductor's functions, DFLASH_CE_KERNEL=off; ce_kernel.py writes the
gradient over the logits, half that; the eager path, on CPU or with DFLASH_COMPILE=0 as well,
holds float32 temporaries too, about twice that)."""
DEFAULT_CHUNK_ROWS = 8192  # the CE's chunk when its caller gives no memory budget
CHUNK_MEMORY_SHARE = 20  # the trainer's default budget: 1/20 of the device (about 7 GiB of an H200)


def lm_head_chunk_rows(vocab_size: int, budget_bytes: float) -> int:
    """Most rows per CE chunk whose ``[rows, vocab]`` logits and gradient fit ``budget_bytes``
    (at least 16). A small vocabulary gets fewer, larger chunks: 27,000+ rows of 49,152 entries
    where 151,936 entries get 8,833, in 5 GiB."""
    if vocab_size < 1 or not budget_bytes > 0:
        raise DataError(f"lm_head_chunk_rows: vocab_size={vocab_size} and budget_bytes={budget_bytes} "
                        f"must be positive")
    return max(16, int(budget_bytes // (vocab_size * LOGIT_BYTES)))


def default_chunk_budget(device: torch.device) -> float:
    """The CE's memory budget when ``drafter.lm_head_chunk_gib`` is unset: 1/20 of a GPU's
    memory, sized for the GPU; 1 GiB elsewhere."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory / CHUNK_MEMORY_SHARE
    return float(1 << 30)


def chunk_bounds(num_rows: int, max_rows: int) -> list[tuple[int, int]]:
    """``[start, end)`` of the chunks covering ``num_rows`` rows: as few as hold at most
    ``max_rows`` each, of equal size (the last a few rows shorter at most), so no chunk is a
    small ragged tail that costs a launch sequence for a sliver of work."""
    if max_rows < 1:
        raise DataError(f"chunk_size={max_rows} must be >= 1")
    if num_rows <= 0:
        return []
    count = -(-num_rows // max_rows)
    size = -(-num_rows // count)
    return [(s, min(s + size, num_rows)) for s in range(0, num_rows, size)]


class _ChunkedWeightedCE(torch.autograd.Function):
    """sum_i w_i * CE(hidden_i @ W^T, label_i), with the gradient computed in forward.

    Per chunk of rows: logits (in W's dtype), log-sum-exp and loss in float32, and
    ``dL/dh = (w * (softmax - onehot)) @ W``, then the chunk's logits are freed. On CUDA
    the softmax part is one kernel over the bf16 logits (ce_kernel.py); nothing
    vocabulary-sized lives in backward, and the LM-head matmul runs twice instead of
    three times (checkpointing would recompute the logits). Only rows with a nonzero
    weight are computed. ``W`` is frozen: it gets no gradient.
    """

    @staticmethod
    def forward(ctx, hidden, weight, labels, weights, chunk_size, fp8_head, dpace, rows):  # noqa: D102
        if rows is None:  # counting them on the device syncs the host with it
            rows = torch.nonzero(weights).squeeze(1)  # [R] rows that carry loss
        if dpace is not None:
            total, grad = _dpace_loss_and_grad(hidden, weight, labels, weights, rows, chunk_size, dpace,
                                               with_grad=ctx.needs_input_grad[0])
            ctx.save_for_backward(grad if grad is not None else hidden.new_empty(0))
            return total
        acc = _acc_dtype(weight.dtype)
        total = torch.zeros((), dtype=acc, device=hidden.device)
        grad = torch.zeros_like(hidden) if ctx.needs_input_grad[0] else None
        for start, end in chunk_bounds(rows.numel(), chunk_size):
            idx = rows[start:end]
            h = hidden.index_select(0, idx).to(weight.dtype)  # [C, H]
            y = labels.index_select(0, idx)  # [C]
            w = weights.index_select(0, idx).to(acc)  # [C]
            if fp8_head is not None:  # both LM-head matmuls in float8 (precision.py)
                loss, dh = fp8_head.loss_and_input_grad(h, y, w, with_grad=grad is not None)
                total += loss
                if grad is not None:
                    grad.index_copy_(0, idx, dh.to(hidden.dtype))
                continue
            logits = F.linear(h, weight)  # [C, V]
            if grad is None:
                total += _loss(logits, y, w)
                continue
            loss, dlogits = _loss_and_grad(logits, y, w)
            del logits
            total += loss
            grad.index_copy_(0, idx, (dlogits @ weight).to(hidden.dtype))
        ctx.save_for_backward(grad if grad is not None else hidden.new_empty(0))
        return total

    @staticmethod
    def backward(ctx, grad_out):  # noqa: D102
        (grad,) = ctx.saved_tensors
        return grad * grad_out.to(grad.dtype), None, None, None, None, None, None, None


def _dpace_loss_and_grad(hidden: Tensor, weight: Tensor, labels: Tensor, weights: Tensor, rows: Tensor,
                         chunk_size: int, dpace: tuple[float, int], *, with_grad: bool) -> tuple[Tensor, Tensor | None]:
    """``sum_i w_i * weights_i * CE_i`` with D-PACE's w, and its gradient, in one LM-head pass:
    per chunk the rows' CE and unweighted ``dCE/dh``; then w; then the rows scaled by it."""
    alpha, block_size = dpace
    if hidden.shape[0] % block_size:
        raise DataError(f"dpace: {hidden.shape[0]} rows are not whole blocks of {block_size}")
    acc = _acc_dtype(weight.dtype)
    ce = torch.zeros(hidden.shape[0], dtype=acc, device=hidden.device)  # [Q]
    grad = torch.zeros_like(hidden) if with_grad else None
    for start, end in chunk_bounds(rows.numel(), chunk_size):
        idx = rows[start:end]
        logits = F.linear(hidden.index_select(0, idx).to(weight.dtype), weight)  # [C, V]
        y = labels.index_select(0, idx)
        if grad is None:
            ce.index_copy_(0, idx, _rows(logits, y))
            continue
        row_ce, dlogits = _rows_and_grad(logits, y)
        del logits
        ce.index_copy_(0, idx, row_ce)
        grad.index_copy_(0, idx, (dlogits @ weight).to(hidden.dtype))
    valid = (weights != 0).view(-1, block_size)
    w = (dpace_weights(ce.view(-1, block_size), valid, alpha).reshape(-1) * weights.double()).to(acc)  # [Q]
    if grad is not None:
        grad.mul_(w[:, None].to(grad.dtype))
    return (w * ce).sum(), grad


def weighted_ce_sum(
    hidden: Tensor,
    head: FrozenTargetHead,
    labels: Tensor,
    weights: Tensor,
    chunk_size: int = DEFAULT_CHUNK_ROWS,
    fp8_head=None,
    dpace: tuple[float, int] | None = None,
    rows: Tensor | None = None,
) -> Tensor:
    """``sum_i weights[i] * CE(head.logits(hidden[i]), labels[i])`` as a scalar.

    Softmax and the sum run in float32 (float64 for a float64 head), the result's dtype.

    hidden ``[Q, H]``, labels ``[Q]`` long, weights ``[Q]``. Chunked over Q so the
    ``[Q, vocab]`` logits never exist at once, in forward or backward: equal chunks of at
    most ``chunk_size`` rows (see :func:`lm_head_chunk_rows`). ``rows`` ``[R]`` long, on
    hidden's device: the rows to compute, a superset of those with a nonzero weight (a zero
    weight adds exactly 0 to the loss and its gradient); None finds them on the device,
    which syncs the host (``TrainingBatch.loss_rows`` comes from the host). ``fp8_head``
    (``precision.Fp8LMHead``, for ``drafter.precision: fp8``) computes each chunk's logits
    and ``dL/dh`` with float8 matmuls; None keeps the head's own dtype. ``dpace``
    (``(alpha, block_size)``, ``objective.weighting: dpace``) weights the rows by D-PACE.
    """
    if chunk_size < 1:
        raise DataError(f"chunk_size={chunk_size} must be >= 1")
    if not (hidden.shape[0] == labels.shape[0] == weights.shape[0]):
        raise DataError(
            f"hidden {tuple(hidden.shape)}, labels {tuple(labels.shape)} and weights "
            f"{tuple(weights.shape)} disagree on the number of rows"
        )
    if rows is not None and (rows.dim() != 1 or rows.device != hidden.device):
        raise DataError(f"rows must be 1-D on {hidden.device}, got {tuple(rows.shape)} on {rows.device}")
    return _ChunkedWeightedCE.apply(hidden, head.lm_head_weight, labels.long(), weights, chunk_size, fp8_head, dpace,
                                    None if rows is None else rows.long())
