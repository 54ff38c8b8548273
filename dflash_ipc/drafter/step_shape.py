"""The shapes a drafter training step runs at, and the padding that makes them.

A step's real shape is its context rows T (the packed sequences) and query rows Q (its
blocks x block size). Two things want other shapes, and get them from padding that changes
no real row's output, loss or gradient:

* CUDA graphs (``drafter.compile: reduce-overhead``) have fixed shapes, and recording one
  compiles for 12-19 s, while T changes every step. :class:`StepRows` runs every step at the
  largest shape the job has run: T padded to a bucket length (:func:`context_bucket`, 2^k
  and 1.5 x 2^k) never below the longest bucket so far, Q never below the most blocks so
  far. The cost: later steps compute fc and the context K/V projections over the mark's
  rows, not their own (attention skips the padding keys: no query sees them), which for
  data whose lengths have a long tail may be several times a typical step's context.
* FlexAttention compiled with dynamic shapes checks bounds on every load unless told both
  lengths are whole 128-tiles (attention.flex_kernel_options); the trainer pads a flex step
  to whole tiles (at most 127 rows each).

The padding: context keys of no sequence at position 0 (:func:`pad_layout`; their features
are zero rows, :func:`pad_rows`), and filler blocks that see only their own keys and carry
no weight (:func:`pad_blocks`, its layout :func:`pad_query_blocks`). In bf16 they change no
real output and no gradient (tests/test_drafter_step_shape.py); under fp8 they enter a layer's
tensorwise input amax (and rowwise the per-column scales of the weight gradient), so real rows
may move by a float8 rounding step.
"""

from __future__ import annotations

import dataclasses
import logging

import torch
import torch.nn.functional as F
from torch import Tensor

from dflash_ipc.drafter.attention import BlockLayout
from dflash_ipc.drafter.objective import TrainingBatch

logger = logging.getLogger(__name__)

MIN_CONTEXT_BUCKET = 1024  # below, a graph per length would outnumber what padding saves


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def context_bucket(num_ctx: int) -> int:
    """The padded context length of a CUDA graph: the smallest of 2^k and 3 x 2^(k-1) (k >= 10)
    that holds ``num_ctx``. Two lengths per octave, so a new largest step records a new graph
    only ~twice per doubling of the longest context (`StepRows`)."""
    if num_ctx < 0:
        raise ValueError(f"num_ctx={num_ctx} must be >= 0")
    size = MIN_CONTEXT_BUCKET
    while size < num_ctx:
        size = size * 3 // 2 if size & (size - 1) == 0 else size * 4 // 3
    return size


def pad_layout(layout: BlockLayout, num_ctx: int) -> BlockLayout:
    """The layout with ``num_ctx - T`` padding context keys after the real ones: sequence -1
    (no query's), position 0. The keys of the blocks move to ``num_ctx`` on; queries stay."""
    extra = num_ctx - layout.num_ctx
    if extra < 0:
        raise ValueError(f"pad_layout: num_ctx={num_ctx} is below the layout's {layout.num_ctx} context keys")
    if extra == 0:
        return layout
    dev = layout.device
    return BlockLayout(
        query_seq=layout.query_seq, query_anchor=layout.query_anchor, query_block=layout.query_block,
        ctx_seq=torch.cat([layout.ctx_seq, torch.full((extra,), -1, dtype=layout.ctx_seq.dtype, device=dev)]),
        ctx_pos=torch.cat([layout.ctx_pos, torch.zeros(extra, dtype=layout.ctx_pos.dtype, device=dev)]),
        cu_seqlens=layout.cu_seqlens, block_size=layout.block_size)


def _cat(t: Tensor, tail: Tensor) -> Tensor:
    return torch.cat([t, tail.to(device=t.device, dtype=t.dtype)])


def pad_query_blocks(layout: BlockLayout, num_queries: int) -> BlockLayout:
    """The layout with filler blocks appended up to ``num_queries`` query rows, each seeing
    only its own keys: sequence 0, anchor 0 (no context key lies before position 0)."""
    bs = layout.block_size
    extra = num_queries - layout.num_queries
    if extra < 0 or extra % bs:
        raise ValueError(f"pad_query_blocks: {num_queries} query rows must be whole blocks of {bs} and at "
                         f"least the layout's {layout.num_queries}")
    if extra == 0:
        return layout
    first, zeros = layout.num_queries // bs, torch.zeros(extra, dtype=torch.int32)
    return dataclasses.replace(
        layout, query_seq=_cat(layout.query_seq, zeros), query_anchor=_cat(layout.query_anchor, zeros),
        query_block=_cat(layout.query_block, torch.arange(first, first + extra // bs).repeat_interleave(bs)))


def pad_blocks(batch: TrainingBatch, num_queries: int, mask_token_id: int) -> TrainingBatch:
    """``batch`` with filler blocks appended up to ``num_queries`` query rows (its layout:
    `pad_query_blocks`): weight 0 everywhere (no loss row, not counted by the acceptance
    proxy), ``mask_token_id`` as input. ``num_anchors`` stays the real count."""
    layout = pad_query_blocks(batch.layout, num_queries)
    extra = num_queries - batch.layout.num_queries
    if extra == 0:
        return batch
    offsets = torch.arange(layout.block_size).repeat(extra // layout.block_size)  # [extra] 0..bs-1 per block
    return dataclasses.replace(
        batch, layout=layout, block_ids=_cat(batch.block_ids, torch.full((extra,), mask_token_id)),
        block_positions=_cat(batch.block_positions, offsets), labels=_cat(batch.labels, torch.zeros(extra)),
        weights=_cat(batch.weights, torch.zeros(extra)))


class StepRows:
    """The row counts a CUDA-graph step runs at: the context's bucket and the step's query
    rows, each never below the largest the job has run (a high-water mark), so a graph is
    recorded per new maximum, not per step (the module docstring says what that costs)."""

    def __init__(self) -> None:
        self.context = 0  # context rows of the largest graph so far (0: none yet)
        self.queries = 0  # query rows of the largest graph so far

    def pad(self, num_ctx: int, num_queries: int) -> tuple[int, int]:
        """(context rows, query rows) to run a step of ``num_ctx`` context and ``num_queries``
        query rows at; raises the marks where the step goes past them."""
        context, queries = max(context_bucket(num_ctx), self.context), max(num_queries, self.queries)
        if self.context and (context, queries) != (self.context, self.queries):
            logger.info("drafter.compile=reduce-overhead: a step of %d context and %d query rows outgrows the "
                        "CUDA graph's %d x %d; steps run at %d x %d from here on (one more graph to record)",
                        num_ctx, num_queries, self.context, self.queries, context, queries)
        self.context, self.queries = context, queries
        return context, queries


def pad_rows(x: Tensor, rows: int) -> Tensor:
    """``x`` with zero rows appended up to ``rows`` (``x`` itself when it has them)."""
    extra = rows - x.shape[0]
    if extra < 0:
        raise ValueError(f"pad_rows: {x.shape[0]} rows do not fit in {rows}")
    return x if extra == 0 else F.pad(x, (0, 0) * (x.dim() - 1) + (0, extra))
