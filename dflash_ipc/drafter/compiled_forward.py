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
  compile costs 12-19 s (a 135M-class drafter), so every step runs at the largest shape the
  job has run (step_shape.py ``StepRows``: the context bucket and the blocks never below the
  largest so far, padded with keys no query sees and zero-weight filler blocks). One graph
  serves the job once its heaviest step has run (the start-up probe, drafter/fit.py, runs it
  first); a longer context later compiles once more, with a log line. Each graph is static,
  because a reduction over a dynamic row count, fp8's amax, runs at a quarter of the static
  speed (precision.py).

With ``drafter.precision: fp8`` the float8 layers are traced into the same graph instead of
compiled one by one (precision.py's ``_GraphForward`` and ``SharedInputFloat8``): the
compiler may merge identical casts of one input and fuse casts into the kernels that produce
their inputs. The context is padded to a multiple of 16 rows for them.

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
from torch import Tensor, nn

from dflash_ipc.config.schema import Compile
from dflash_ipc.drafter.attention import MaskMemory
from dflash_ipc.drafter.step_shape import StepRows, round_up

logger = logging.getLogger(__name__)

MODES = typing.get_args(Compile)  # drafter.compile's values
# reduce-overhead compiles once per new largest step shape (step_shape.StepRows): a handful per job
RECOMPILE_LIMIT = 64


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
        self._masks = MaskMemory()

    @property
    def cuda_graphs(self) -> bool:
        return self.enabled and self.mode == "reduce-overhead"

    @property
    def mask_memory(self) -> MaskMemory | None:
        """Where a step's masks are built under CUDA graphs: the same addresses every step
        (attention.MaskMemory), so no step records its graphs again; None otherwise."""
        return self._masks if self.cuda_graphs else None

    def step_rows(self, num_ctx: int, num_queries: int, *, tile: int, block_size: int) -> tuple[int, int]:
        """(context rows, query rows) a step runs at. Under CUDA graphs the largest so far
        (`StepRows`); else the context rounded up to ``row_multiple`` when compiled (16 for
        fp8 in the graph: ``torch._scaled_mm``'s inner dims, so no layer pads inside it), as
        it is when eager. ``tile``: both counts rounded up to whole attention tiles besides
        (FlexAttention's 128: its kernel then skips bounds checks, attention.flex_kernel_options),
        the queries in filler blocks of ``block_size``, where whole blocks make whole tiles."""
        if self.cuda_graphs:
            num_ctx, num_queries = self._rows.pad(num_ctx, num_queries)
        elif self.enabled:
            num_ctx = round_up(num_ctx, self.row_multiple)
        if tile > 1 and tile % block_size == 0:
            num_ctx, num_queries = round_up(num_ctx, tile), round_up(num_queries, tile)
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
            if self.cuda_graphs:  # static graphs, one per new largest step shape (the module docstring)
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
