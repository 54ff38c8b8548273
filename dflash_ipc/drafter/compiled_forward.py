"""The drafter's forward as one torch.compile graph (``drafter.compile``).

With ``drafter.compile: off`` (the default) the forward runs as eager PyTorch around the
parts compiled on their own (RMSNorm, RoPE, SwiGLU, FlexAttention, the CE chunks): every
linear layer, residual add, cast and concat is a kernel of its own, launched from Python,
and autograd records each. A large drafter hides that behind its matmuls; a small one (a
135M-class target: hidden 576) does not, and its step waits on the CPU. Compiled as one
graph, inductor fuses what lies between the matmuls and autograd sees one node:

* ``default`` / ``max-autotune-no-cudagraphs``: torch.compile's modes, the context length
  dynamic (it changes every step), the query count as it comes (fixed by
  ``objective.anchors_per_step``; a short step recompiles once, then it is dynamic too).
* ``reduce-overhead``: the same graph replayed as CUDA graphs (torch.compile's cudagraph
  trees), which removes the launches themselves. A CUDA graph has fixed shapes, and a
  compile costs 14-19 s (a 135M-class drafter on an H200), so a step's shapes are padded to
  the largest the job has run (:class:`StepRows`): the context up to a bucket length
  (:func:`context_bucket`: 2^k and 1.5 x 2^k) and never below the longest bucket so far,
  the blocks up to the most the job has had (a short step, at the end of the data or after
  ``drafter.max_group_wait_s``, gets zero-weight filler blocks). So one graph serves the
  job once its longest step has run: a job's start-up probe (drafter/fit.py) runs its
  heaviest step first, and a longer context later compiles once more (a log line says so).
  Each graph is static, because a reduction over a dynamic row count, fp8's amax, runs at a
  quarter of the static speed (precision.py). Padding keys belong to no sequence: no query
  sees them (attention.py's rule), their features are zeros; a filler block sees only its
  own keys and has no loss; so they change no output and no gradient
  (tests/test_drafter_compiled_forward.py).

With ``drafter.precision: fp8`` the float8 layers are traced into the same graph instead of
compiled one by one (precision.py's ``_GraphForward``): the layers that read one input cast it
once (the compiler merges their identical casts), and the casts may fuse into the kernels
that produce their inputs. The context is padded to a multiple of 16 rows for them.

Robustness: the forward runs under ``force_non_lazy_backward_lowering`` where torch has it,
so a backward that cannot compile fails in the forward too. Any dynamo/inductor error (or
other RuntimeError but running out of memory: ``falls_back``) then
logs one warning naming the mode and the error, and the drafter runs eagerly
(``drafter.compile: off``) from there on; the step that hit it is recomputed eagerly
(``DrafterTrainer.step``), so a failed compile costs time, never a wrong step. CPU runs
stay eager (one log line) except in tests, which compile with the ``aot_eager`` backend
and compare with the eager forward.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import typing
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dflash_ipc.config.schema import Compile
from dflash_ipc.drafter.attention import BlockLayout
from dflash_ipc.drafter.objective import TrainingBatch

logger = logging.getLogger(__name__)

MODES = typing.get_args(Compile)  # drafter.compile's values
MIN_CONTEXT_BUCKET = 1024  # below, a graph per length would outnumber what padding saves
RECOMPILE_LIMIT = 64  # reduce-overhead compiles once per context length (and per query count)


def context_bucket(num_ctx: int) -> int:
    """The padded context length of a CUDA graph: the smallest of 2^k and 3 x 2^(k-1) (k >= 10)
    that holds ``num_ctx``. Two lengths per octave: at most 33 % padding rows (fc and the
    context K/V projections compute them; attention skips them, no query sees them), and
    ~2 graphs per doubling of the longest step."""
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


def pad_blocks(batch: TrainingBatch, num_queries: int, mask_token_id: int) -> TrainingBatch:
    """``batch`` with filler blocks appended up to ``num_queries`` query rows: each sees only
    its own keys (sequence 0, anchor 0: no context key lies before position 0), has weight 0
    everywhere (no loss row, not counted by the acceptance proxy) and ``mask_token_id`` as
    input. ``num_anchors`` stays the real count."""
    layout, bs = batch.layout, batch.layout.block_size
    extra = num_queries - layout.num_queries
    if extra < 0 or extra % bs:
        raise ValueError(f"pad_blocks: {num_queries} query rows must be whole blocks of {bs} and at least "
                         f"the batch's {layout.num_queries}")
    if extra == 0:
        return batch
    dev, first = layout.device, layout.num_queries // bs

    def cat(t: Tensor, tail: Tensor) -> Tensor:
        return torch.cat([t, tail.to(device=dev, dtype=t.dtype)])

    zeros = torch.zeros(extra, dtype=torch.int32)
    offsets = torch.arange(bs).repeat(extra // bs)  # [extra] 0..bs-1 per block
    padded = dataclasses.replace(
        layout, query_seq=cat(layout.query_seq, zeros), query_anchor=cat(layout.query_anchor, zeros),
        query_block=cat(layout.query_block, torch.arange(first, first + extra // bs).repeat_interleave(bs)))
    return dataclasses.replace(
        batch, layout=padded, block_ids=cat(batch.block_ids, torch.full((extra,), mask_token_id)),
        block_positions=cat(batch.block_positions, offsets), labels=cat(batch.labels, torch.zeros(extra)),
        weights=cat(batch.weights, torch.zeros(extra)))


class StepRows:
    """The row counts a CUDA-graph step runs at: the context's bucket and the step's query
    rows, each never below the largest the job has run (a high-water mark), so a graph is
    recorded per new maximum, not per step (module docstring)."""

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


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def pad_rows(x: Tensor, rows: int) -> Tensor:
    """``x`` with zero rows appended up to ``rows`` (``x`` itself when it has them)."""
    extra = rows - x.shape[0]
    if extra < 0:
        raise ValueError(f"pad_rows: {x.shape[0]} rows do not fit in {rows}")
    return x if extra == 0 else F.pad(x, (0, 0) * (x.dim() - 1) + (0, extra))


def falls_back(exc: BaseException) -> bool:
    """Whether an error of the compiled forward or backward turns compiling off (and the step
    is recomputed eagerly): a failed trace or compile (dynamo's errors, inductor's among them),
    or any other RuntimeError of compiled code (CUDA graphs' own checks), but not running out
    of memory, which eager would too. A genuine bug fails the eager recompute as well, and
    that error propagates."""
    if isinstance(exc, torch.OutOfMemoryError):
        return False
    return isinstance(exc, (torch._dynamo.exc.TorchDynamoException, RuntimeError))


def _eager_backward_lowering():
    """Compile the backward with the forward, so its failure shows in the forward's call
    (the switch is torch's; a no-op where this torch does not have it)."""
    config = torch._functorch.config
    if hasattr(config, "force_non_lazy_backward_lowering"):
        return config.patch(force_non_lazy_backward_lowering=True)
    return contextlib.nullcontext()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


class DrafterForward:
    """``model(features, ctx_positions, block_embeds, block_positions, mask)`` as
    ``drafter.compile`` says (module docstring). ``force`` compiles on CPU too (tests)."""

    def __init__(self, model: nn.Module, mode: str, device: torch.device, *, backend: str = "inductor",
                 force: bool = False, row_multiple: int = 1) -> None:
        if mode not in MODES:
            raise ValueError(f"drafter.compile={mode!r} not one of {', '.join(MODES)}")
        if row_multiple < 1:
            raise ValueError(f"row_multiple={row_multiple} must be >= 1")
        self.model, self.mode, self.backend = model, mode, backend
        self.row_multiple = row_multiple
        self.enabled = mode != "off"
        self.failure: str | None = None  # the error that turned compiling off
        if self.enabled and torch.device(device).type != "cuda" and not force:
            logger.info("drafter.compile=%s compiles on CUDA only: the forward runs eagerly on %s", mode, device)
            self.enabled = False
        self._compiled: Callable | None = None
        self._rows = StepRows()

    @property
    def cuda_graphs(self) -> bool:
        return self.enabled and self.mode == "reduce-overhead"

    def step_rows(self, num_ctx: int, num_queries: int, *, tile: int = 1, block_size: int = 1) -> tuple[int, int]:
        """(context rows, query rows) a step runs at. Under CUDA graphs the largest so far
        (`StepRows`); else the context rounded up to ``row_multiple`` when compiled (16 for
        fp8 in the graph: ``torch._scaled_mm``'s inner dims, so no layer pads inside it), as
        it is when eager. ``tile``: both counts rounded up to whole attention tiles besides
        (FlexAttention's 128: its kernel then skips bounds checks, attention.flex_kernel_options),
        the queries in filler blocks of ``block_size``, where whole blocks make whole tiles."""
        if self.cuda_graphs:
            num_ctx, num_queries = self._rows.pad(num_ctx, num_queries)
        elif self.enabled:
            num_ctx = _round_up(num_ctx, self.row_multiple)
        if tile > 1 and tile % block_size == 0:
            num_ctx, num_queries = _round_up(num_ctx, tile), _round_up(num_queries, tile)
        return num_ctx, num_queries

    def step_begin(self) -> None:
        """Before each training step: a new generation of CUDA graph outputs (the last step's
        are dead, so the graphs may reuse their memory)."""
        if self.cuda_graphs:
            torch.compiler.cudagraph_mark_step_begin()

    def disable(self, exc: BaseException) -> None:
        """Compiling off for good, with the one log line that says why."""
        inner = getattr(exc, "inner_exception", None)  # what the backend raised, under dynamo's wrapper
        self.failure = _first_line(exc) + (f" <- {_first_line(inner)}" if inner is not None else "")
        logger.warning("drafter.compile=%s failed (%s); the drafter's forward runs eagerly from here on "
                       "(as drafter.compile=off)", self.mode, self.failure)
        self.enabled, self._compiled = False, None

    def _fn(self) -> Callable:
        if self._compiled is None:
            options: dict[str, Any] = {"backend": self.backend}
            if self.backend == "inductor" and self.mode != "default":
                options["mode"] = self.mode
            if self.cuda_graphs:  # a static graph per context length (the module docstring)
                options["dynamic"] = False
                config = torch._dynamo.config
                for name in ("recompile_limit", "accumulated_recompile_limit"):
                    if getattr(config, name, RECOMPILE_LIMIT) < RECOMPILE_LIMIT:
                        setattr(config, name, RECOMPILE_LIMIT)
            self._compiled = torch.compile(self.model, **options)
        return self._compiled

    def __call__(self, features: Tensor, ctx_positions: Tensor, block_embeds: Tensor, block_positions: Tensor,
                 mask: Any) -> Tensor:
        if self.enabled:
            # the RoPE table's copy to this device, made outside the graph: traced, it would be a
            # host input of the first graph (CUDA graphs skipped) and a recompile on the next call
            self.model.rotary(block_positions[:1])
            if not self.cuda_graphs:  # the context length changes every step: dynamic from the first compile
                torch._dynamo.maybe_mark_dynamic(features, 0)
                torch._dynamo.maybe_mark_dynamic(ctx_positions, 0)
            try:
                with _eager_backward_lowering():
                    return self._fn()(features, ctx_positions, block_embeds, block_positions, mask)
            except Exception as exc:  # noqa: BLE001 - narrowed by falls_back, else re-raised
                if not falls_back(exc):
                    raise
                self.disable(exc)
        return self.model(features, ctx_positions, block_embeds, block_positions, mask)
