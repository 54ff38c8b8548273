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
  trees), which removes the launches themselves. A CUDA graph has fixed shapes, so the
  context is padded up to a few lengths (:func:`context_bucket`: 2^k and 1.5 x 2^k, at most
  half as many rows again) and each length is compiled static and recorded once (~13 lengths
  for contexts up to 64K: static, because a reduction over a dynamic row count, fp8's amax,
  runs at a quarter of the static speed; see precision.py). Padding keys belong to no
  sequence: no query sees them (attention.py's rule), their features are zeros, so they
  change no output and no gradient (tests/test_drafter_compiled_forward.py).

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
import logging
import typing
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dflash_ipc.config.schema import Compile
from dflash_ipc.drafter.attention import BlockLayout

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

    @property
    def cuda_graphs(self) -> bool:
        return self.enabled and self.mode == "reduce-overhead"

    def context_rows(self, num_ctx: int) -> int:
        """Context rows the forward runs at: a bucket length under CUDA graphs, else ``num_ctx``
        rounded up to ``row_multiple`` (16 for fp8 in the graph: ``torch._scaled_mm``'s inner
        dims, so no layer pads inside it)."""
        if self.cuda_graphs:
            return context_bucket(num_ctx)
        if self.enabled:
            return -(-num_ctx // self.row_multiple) * self.row_multiple
        return num_ctx

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
