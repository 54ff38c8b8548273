"""Training precision of the drafter: bf16 as it is, or float8 matmuls on GPUs that have them.

`drafter.precision: fp8` changes two things and nothing else: master weights, optimizer
state, norms, attention, checkpoints and the bf16 export stay exactly as in bf16.

1. The drafter's linear layers (fc, q/k/v/o, gate/up/down) become torchao `Float8Linear`s
   (`convert_to_float8_training`, recipe `drafter.fp8_recipe`): the forward, input-gradient
   and weight-gradient matmuls run in float8 with dynamic scales. Each layer's forward goes
   through torch.compile, so the casts to float8 fuse into few kernels. The rows are
   zero-padded: the weight gradient's float8 GEMM sums over the rows, and
   ``torch._scaled_mm`` takes only inner dims that are multiples of 16 (zero rows change
   neither a scale nor a sum, and their outputs are cut off). Row counts that repeat (a
   step's block queries: anchors x block size, the same every step) get graphs compiled for
   that count, padded by up to ~3 % (`StaticRowCounts`); others one graph per weight
   shape with the count dynamic. Why: the tensorwise scale is the amax of a whole tensor, and
   inductor's reduction over a dynamic row count runs at a quarter of the static one's speed
   (measured on H200: 0.9 against 3.2-3.6 TB/s for a 40,960-row bf16 amax, 0.46 with the
   padding inside the graph), which cost ~40 ms of a 500 ms Qwen3-8B-shaped step. The weight
   stays the same float32 `nn.Parameter` under the same name, so `state_dict`, checkpoints
   and the export do not change. With ``drafter.fp8_shared_casts`` the layers that read one
   input run as one float8 matmul over their concatenated weights (`SharedInputFloat8`).
2. The frozen LM head's two matmuls in the chunked CE (`objective.weighted_ce_sum`), as
   `drafter.fp8_lm_head` says: `all` = the logits h @ W^T and dL/dh, `grad` = dL/dh only
   (the logits, hence the loss, stay bf16: float8 logits carry ~2 % of their spread as
   rounding noise, which a peaked softmax amplifies), `none` = neither. Through
   `torch._scaled_mm`, on float8 copies of W made once (it is frozen).
   dL/dh = (w * softmax) @ W - w * W[y]: only the softmax part goes through float8; the
   one-hot part is a row gather of W, exact. Why: while the drafter is wrong, the one-hot
   part is the largest term of dL/dh; through float8 it carries the rounding of both
   operands (~3 % each), and its ~1 sets the scale of the small softmax entries. Measured
   on random heads: 4-6 % error in dL/dh with the one-hot inside the float8 matmul, 0.1 %
   with the split (tests/test_drafter_precision.py).

Scaling follows the recipe in both parts: `tensorwise` is one scale per tensor, e4m3 in the
forward and e5m2 for gradients (torchao's tensorwise recipe); `rowwise` is one power-of-two
scale per row, e4m3 throughout (torchao's rowwise recipe); `delayed` is tensorwise's formats
with the layers' input and gradient scales taken from their abs-max over the last steps,
through layers of our own that cast in one pass and keep float8 copies for the backward
(float8_delayed.py: no torchao, no torch.compile; the LM head as tensorwise). A scale maps the absolute
maximum of its tensor (row) to the format's largest finite value, but for the LM head's
tensorwise probabilities, whose scale maps their bound, the largest loss weight
(`loss_and_quantized_probs`). `drafter.fp8_layers: false` keeps the layers bf16 and the head
in float8 (small drafters, where the head is most of the FLOPs and the layers' casts cost more
than float8 saves).

Needs a CUDA GPU of compute capability >= 8.9 (Ada, Hopper and newer) and torchao >= 0.18
(`pip install 'dflash-ipc[fp8]'`); anything else is a ConfigError that names the fix.
`DFLASH_FP8_EMULATE=1` runs the same code on any device with float8-rounded operands and
float32 matmuls (torchao's `emulate`): for tests and debugging, no speed.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dflash_ipc.config.schema import DrafterConfig
from dflash_ipc.drafter import float8_delayed
from dflash_ipc.drafter.float8_matmul import E4M3, E5M2, MM_MULTIPLE, float8_scale, scaled_matmul
from dflash_ipc.drafter.model import CudaCompiled, compile_enabled, each_linear
from dflash_ipc.drafter.objective import _acc_dtype, _fused_chunk_loss
from dflash_ipc.hf.target_head import FrozenTargetHead
from dflash_ipc.errors import ConfigError

logger = logging.getLogger(__name__)

EMULATE_ENV = "DFLASH_FP8_EMULATE"
"""Set to ``1`` to run fp8 on any device (CPU included) in emulation: for tests."""
MIN_TORCHAO = (0, 18)  # the release tested here (its rowwise transpose fix is not in 0.17)
MIN_CAPABILITY = (8, 9)  # float8 tensor cores: Ada (8.9), Hopper (9.0) and newer
FP8_FASTER_FROM_HIDDEN = 2048
"""The smallest drafter hidden size where an fp8 step has measured faster than a bf16 one in
``bench drafter``'s step of 2,048 anchors (docs/benchmarks.md, "fp8 drafter step": the
Qwen3-1.7B shape, hidden 2,048, 1.16x synchronised at fixed lengths, 1.06x synchronised and
1.28x pipelined with ragged ones, on H100s; 1.36x at hidden 4,096). At the 135M class, hidden
576, the float8 layers made the step slower and the float8 head alone no faster pipelined
(26.1 against 20.6 ms); ``bench precision``'s steps of 1,024 anchors at hidden 2,048, real lengths:
fp8's median step 1.09x bf16's, its first steps of each new row count seconds longer (compiles);
sizes between 576 and 2,048 are not measured. Below it :func:`apply_precision` warns."""
INSTALL_HINT = "pip install 'dflash-ipc[fp8]'"


def emulate_enabled() -> bool:
    return os.environ.get(EMULATE_ENV, "0") == "1"


def _version(text: str) -> tuple[int, int]:
    match = re.match(r"(\d+)\.(\d+)", text)
    return (int(match.group(1)), int(match.group(2))) if match else (0, 0)


def torchao_float8():
    """The `torchao.float8` module, or a ConfigError that says how to install it."""
    try:
        import torchao
        from torchao import float8
    except Exception as exc:  # ImportError, or a torchao built for another torch
        raise ConfigError(f"drafter.precision: fp8 needs torchao >= {'.'.join(map(str, MIN_TORCHAO))}, "
                          f"which does not import here ({type(exc).__name__}: {exc}); {INSTALL_HINT}, "
                          f"or set drafter.precision=bf16") from None
    found = getattr(torchao, "__version__", "unknown")
    if _version(found) < MIN_TORCHAO:
        raise ConfigError(f"drafter.precision: fp8 needs torchao >= {'.'.join(map(str, MIN_TORCHAO))}, "
                          f"found {found}; {INSTALL_HINT}, or set drafter.precision=bf16")
    return float8


def require_fp8(device: torch.device | str, *, torchao: bool = True) -> None:
    """ConfigError unless float8 training can run on `device`: a GPU with float8 tensor
    cores and, where ``torchao`` (its recipes' layers), torchao (emulation needs only that)."""
    device = torch.device(device)
    if not emulate_enabled():
        if device.type != "cuda":
            raise ConfigError(f"drafter.precision: fp8 needs a CUDA GPU of compute capability >= 8.9 "
                              f"(Ada, Hopper or newer), but the drafter runs on {device}; "
                              f"set drafter.precision=bf16")
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < MIN_CAPABILITY:
            raise ConfigError(f"drafter.precision: fp8 needs compute capability >= 8.9 (Ada, Hopper or "
                              f"newer); {device} is {torch.cuda.get_device_name(device)} ({major}.{minor}) "
                              f"without float8 tensor cores; set drafter.precision=bf16")
    if torchao:
        torchao_float8()


def lm_head_matmuls(setting: str, weighting: str) -> str:
    """``drafter.fp8_lm_head`` as applied: auto is all under decay weights, none under D-PACE
    (its per-row CE runs in the head's own dtype: drafter/objective.py)."""
    if setting != "auto":
        return setting
    return "none" if weighting == "dpace" else "all"


def apply_precision(cfg: DrafterConfig, model: nn.Module, head: FrozenTargetHead,
                    device: torch.device | str, *, weighting: str = "decay") -> "Fp8LMHead | None":
    """The trainer's hook, right after the model is built: converts ``model`` in place for
    ``cfg.precision`` and returns the LM-head matmuls for ``weighted_ce_sum`` (None: bf16).
    ``weighting``: objective.weighting, which decides ``fp8_lm_head: auto``."""
    if cfg.precision == "bf16":
        return None
    head_matmuls = lm_head_matmuls(cfg.fp8_lm_head, weighting)
    require_fp8(device, torchao=cfg.fp8_recipe != "delayed")
    hidden = model.config.hidden_size
    if hidden < FP8_FASTER_FROM_HIDDEN:
        logger.warning("precision fp8: the drafter's hidden size is %d; fp8 has measured no faster than bf16 "
                       "at 576 and faster from %d in bench drafter's step (docs/benchmarks.md, \"fp8 drafter "
                       "step\"): compare both with `dflash-ipc bench drafter --precision bf16,fp8` at your "
                       "shape before training in fp8", hidden, FP8_FASTER_FROM_HIDDEN)
    emulate = emulate_enabled()
    if cfg.fp8_recipe == "delayed":  # our layers, eager (float8_delayed.py); the schema keeps compile off
        converted, left = float8_delayed.convert_linears(model, emulate=emulate) if cfg.fp8_layers else ([], [])
        for name in left:
            logger.info("precision fp8: %s stays bf16: dims must be multiples of %d", name, MM_MULTIPLE)
    else:
        converted = convert_linears(model, cfg.fp8_recipe, emulate=emulate) if cfg.fp8_layers else []
        if cfg.compile == "off":
            compile_linears(converted)  # compiled on CUDA (unless compiling is off), eager elsewhere; rows padded
        else:  # traced into the drafter's one graph, where the compiler merges the casts of a shared input
            for module in converted:
                module.forward = _GraphForward(module)
    num_blocks = share_input_casts(model, in_graph=cfg.compile != "off") if cfg.fp8_shared_casts else 0
    fp8_head = None if head_matmuls == "none" else Fp8LMHead.create(
        head.lm_head_weight, rowwise=cfg.fp8_recipe == "rowwise", fp8_logits=head_matmuls == "all",
        emulate=emulate)
    if fp8_head is None and head_matmuls != "none":
        logger.info("precision fp8: LM head %s stays bf16: dims must be multiples of %d",
                    tuple(head.lm_head_weight.shape), MM_MULTIPLE)
    logger.info("precision fp8 (%s%s): %d linear layers in float8 (in %d blocks, layers that read one input cast it once), "
                "LM head matmuls in float8: %s", cfg.fp8_recipe, ", emulated" if emulate else "", len(converted),
                num_blocks, head_matmuls if fp8_head is not None else "none")
    return fp8_head


# --- the linear layers: torchao ---------------------------------------------------------------


def convert_linears(model: nn.Module, recipe: str, *, emulate: bool = False) -> list[nn.Module]:
    """Swaps every ``nn.Linear`` of ``model`` whose dims fit float8 matmuls for torchao's
    ``Float8Linear`` (same parameter, same name); returns the converted modules."""
    float8 = torchao_float8()
    config = float8.Float8LinearConfig.from_recipe_name(recipe)
    if emulate:
        config = dataclasses.replace(config, emulate=True)

    names = []  # Float8Linear is not public API: the converted layers are found by name

    def fits(module: nn.Module, name: str) -> bool:
        ok = module.in_features % MM_MULTIPLE == 0 and module.out_features % MM_MULTIPLE == 0
        if ok:
            names.append(name)
        else:
            logger.info("precision fp8: %s (%d -> %d) stays bf16: dims must be multiples of %d", name,
                        module.in_features, module.out_features, MM_MULTIPLE)
        return ok

    float8.convert_to_float8_training(model, module_filter_fn=fits, config=config)
    return [model.get_submodule(name) for name in names]


def compile_linears(modules: list[nn.Module]) -> None:
    """Each layer's forward through torch.compile: rows padded, a graph per repeating row
    count, else rows dynamic (module docstring)."""
    _allow_recompiles()
    for module in modules:
        module.forward = _CompiledForward(module)


def _on_rows_of_16(x: Tensor, run, layers) -> Tensor:
    """``run(flat, layers)`` on ``x``'s rows flattened and zero-padded to a multiple of 16, the
    padding cut off again."""
    lead, rows = x.shape[:-1], x.shape[:-1].numel()
    flat = F.pad(x.reshape(rows, x.shape[-1]), (0, 0, 0, -rows % MM_MULTIPLE))  # [rows rounded up to 16, in]
    out = run(flat, layers)
    return out[:rows].reshape(*lead, out.shape[-1])


def _float8_forward_padded(flat: Tensor, module: nn.Module) -> Tensor:
    """The layer on rows already padded (outside the graph): a graph per row count."""
    return type(module).forward(module, flat)  # the class's: the instance's forward is the wrapper


def _float8_forward(x: Tensor, module: nn.Module) -> Tensor:
    return _on_rows_of_16(x, _float8_forward_padded, module)


# One compiled function for every layer: dynamo shares a graph between layers of the same
# weight shape (their parameters are graph inputs), so 5 graphs serve every Qwen3 shape.
_fused_float8_forward = CudaCompiled(_float8_forward, dynamic_args=(0,))
_static_float8_forward = CudaCompiled(_float8_forward_padded, dynamic_args=(), dynamic=False)

MIN_STATIC_ROWS = 1024  # below, a call is cheap either way: no graph of its own
STATIC_ROW_SHARE = 32  # static counts are padded to a multiple of (their power of two) / 32: <= ~3 %
MAX_STATIC_ROW_COUNTS = 8  # at most this many padded counts get their own graphs (x 5 weight shapes)


def static_row_quantum(rows: int) -> int:
    """The multiple a static row count is padded to: 1,024 at 32,768 rows, 256 at 8,192."""
    return max(MM_MULTIPLE, (1 << (rows.bit_length() - 1)) // STATIC_ROW_SHARE)


class StaticRowCounts:
    """Which padded row counts a layer runs with graphs compiled for that count.

    A count is promoted the second time one layer sees it in a forward pass (it repeats: the
    block queries of every step), while fewer than ``limit`` counts are static or promoted, and
    runs static from the next step on (`next_step`); every other call takes the dynamic graph.
    So a one-off count never costs a compile, and the compiles are bounded. Within a step the
    static set does not change: gradient checkpointing's recompute of a layer takes the graph
    its forward took, even when a later call of the same forward promoted that count (k_proj
    and v_proj see the context rows and the block rows, which may pad to one count), or the
    tensors it saves would differ from the forward's. Nothing is promoted in a backward pass.
    """

    def __init__(self, limit: int = MAX_STATIC_ROW_COUNTS, min_rows: int = MIN_STATIC_ROWS) -> None:
        self.limit, self.min_rows = limit, min_rows
        self.static: set[int] = set()
        self._promoted: set[int] = set()  # static from the next step
        self._seen: set[tuple[object, int]] = set()  # (the caller's key, padded count)

    def next_step(self) -> None:
        """Between two steps (the trainer's): the counts promoted in the last one turn static."""
        self.static |= self._promoted
        self._promoted.clear()

    def padded(self, key: object, rows: int) -> int | None:
        """The padded count to run ``rows`` at with a static graph, or None (dynamic).
        ``key``: what makes the call, hashable (a layer, or (id of a group's first layer, size))."""
        if rows < self.min_rows:
            return None
        quantum = static_row_quantum(rows)
        padded = -(-rows // quantum) * quantum
        if padded in self.static:
            return padded
        if torch._C._current_graph_task_id() != -1:  # in a backward pass: a recompute
            return None
        seen = (id(key) if isinstance(key, nn.Module) else key, padded)  # ids: no reference kept
        if seen not in self._seen:
            self._seen.add(seen)
        elif len(self.static) + len(self._promoted) < self.limit:
            self._promoted.add(padded)
        return None


# Graphs per function: up to 6 weight shapes x (8 static counts + 1 dynamic) per recipe, two
# recipes in one process (bench precision compares them), and a margin.
RECOMPILE_LIMIT = 128


def _allow_recompiles() -> None:
    """dynamo compiles one function at most ``recompile_limit`` times (8 by default), then
    runs it eagerly (slowly, silently but for a warning): raised to what the layers need."""
    config = torch._dynamo.config
    for name in ("recompile_limit", "accumulated_recompile_limit"):
        if getattr(config, name, RECOMPILE_LIMIT) < RECOMPILE_LIMIT:
            setattr(config, name, RECOMPILE_LIMIT)


STATIC_ROWS = StaticRowCounts()


def next_step() -> None:
    """The trainer's call before each step: row counts promoted in the last one turn static, and
    the delayed recipe's abs-max histories take the last step's (float8_delayed.py)."""
    STATIC_ROWS.next_step()
    float8_delayed.next_step()


def discard_step() -> None:
    """After a forward and backward that was not a step (the memory probe): the delayed
    recipe forgets what it saw (float8_delayed.py)."""
    float8_delayed.discard_step()


def reset_compiled_layers() -> None:
    """Forget the float8 layers' graphs and row counts: between models of one process (a bench
    comparing precisions), so one model's graphs neither count against the next one's
    recompile limit nor decide its static counts."""
    global STATIC_ROWS
    STATIC_ROWS = StaticRowCounts()
    torch._dynamo.reset()


def _compiles(x: Tensor) -> bool:
    """Whether the layers' forward is compiled for ``x`` (as CudaCompiled decides): only then
    do static row counts pay (eagerly, padding is a copy for nothing)."""
    return x.is_cuda and compile_enabled()


class _CompiledForward:
    """A Float8Linear's forward through torch.compile: a graph for the row count where it
    repeats (`StaticRowCounts`), else rows dynamic. A class, not a closure: ``copy.deepcopy``
    of the model then points the copy's wrapper at the copied layer."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def __call__(self, x: Tensor) -> Tensor:
        return _run_float8(x, self.module, self.module, _fused_float8_forward, _static_float8_forward)


def _run_float8(x: Tensor, layers, key: object, dynamic: CudaCompiled, static: CudaCompiled) -> Tensor:
    """``layers`` (one Float8Linear or a tuple sharing ``x``) on ``x`` through ``static``'s graph
    for the padded row count where it repeats (`StaticRowCounts`, keyed by ``key``), else
    through ``dynamic``'s, which pads inside."""
    lead, rows = x.shape[:-1], x.shape[:-1].numel()
    padded = STATIC_ROWS.padded(key, rows) if _compiles(x) else None
    if padded is None:
        return dynamic(x, layers)
    flat = x.reshape(rows, x.shape[-1])
    if padded != rows:
        flat = F.pad(flat, (0, 0, 0, padded - rows))
    out = static(flat, layers)
    return (out[:rows] if padded != rows else out).reshape(*lead, out.shape[-1])


class _GraphForward:
    """A Float8Linear's forward under ``drafter.compile`` (compiled_forward.py): traced into the
    drafter's one graph, not compiled on its own. There every layer that reads the same input
    (q/k/v of the block, k/v of the context, gate/up) casts it to float8 with the same ops, and
    AOT autograd's common-subexpression pass (in the partitioner inductor uses) merges identical
    ones: the numbers of separate layers, the shared work done once (the CPU trace of the test
    model, tensorwise: abs-max reductions 20 -> 17 in the forward, 38 -> 13 in the backward).
    The context arrives padded to a multiple of 16 rows (DrafterForward); other counts are
    padded here (``rows % 16`` is a guard in the graph, not a copy)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def __call__(self, x: Tensor) -> Tensor:
        if x.shape[:-1].numel() % MM_MULTIPLE:
            return _float8_forward(x, self.module)
        return type(self.module).forward(self.module, x)


# --- layers that read one input: one float8 matmul -------------------------------------------


def _float8_class() -> type:
    return torchao_float8().float8_linear.Float8Linear


def _shared_input_matmul(x: Tensor, layers: tuple[nn.Module, ...]) -> Tensor:
    """``[rows, sum of out_features]``: ``x`` through every layer of ``layers`` (Float8Linears
    of one config, no bias) as one float8 matmul over their concatenated weights, so ``x`` is
    cast once and the gradient w.r.t. ``x`` is one matmul. The parameters stay separate (the
    concatenation is differentiable: each gets its own gradient). ``x``'s rows are a multiple
    of 16 (``torch._scaled_mm``)."""
    first = layers[0]
    if torch.is_autocast_enabled():  # Float8Linear.forward's own cast, so the numbers are its
        x = x.to(torch.get_autocast_dtype("cuda"))
    weight = torch.cat([layer.weight for layer in layers])  # [sum of out, in]
    matmul = torchao_float8().float8_linear.matmul_with_hp_or_float8_args
    return matmul.apply(x, weight.t(), first.linear_mm_config, first.config)


def _shared_input_forward(x: Tensor, layers: tuple[nn.Module, ...]) -> Tensor:
    return _on_rows_of_16(x, _shared_input_matmul, layers)


# As the single layers': dynamo shares a graph between groups of the same weight shapes.
_fused_shared_input = CudaCompiled(_shared_input_forward, dynamic_args=(0,))
_static_shared_input = CudaCompiled(_shared_input_matmul, dynamic_args=(), dynamic=False)


class SharedInputFloat8:
    """``project(x, layers)`` of an attention or MLP block (model.py's ``each_linear``) under
    ``drafter.fp8_shared_casts``: the layers that read ``x`` (q/k/v of the block, k/v of the
    context, gate/up) as one float8 matmul, split back into their outputs. What it saves is
    the casts: each Float8Linear casts its input on its own (an abs-max pass and a cast pass
    over [rows, H]), three times for the block's q/k/v; here once, and the three
    input-gradient matmuls and their sums are one matmul. Numbers: rowwise scales are per row
    of the input and per output row of the weight, so the forward and the weight gradients
    are those of separate layers (bit for bit in torchao's emulation,
    tests/test_drafter_precision.py; a GPU's float8 GEMM over more output columns may sum in
    another order) and the input gradient differs by the rounding of a sum; tensorwise takes
    one scale for the concatenated weights and for their output gradient (their largest
    abs-max), close to separate layers, not equal. Measured at the Qwen3-8B shape on an H100:
    0.8 GiB less memory, no step time saved (docs/benchmarks.md), hence off by default. Layers
    that did not become Float8Linears (dims not multiples of 16) run one by one. Compiled as
    the single layers are (``_CompiledForward``) or, under ``drafter.compile``, traced into the
    drafter's graph (``in_graph``)."""

    def __init__(self, *, in_graph: bool) -> None:
        self.in_graph = in_graph
        self.float8_linear = _float8_class()

    def __call__(self, x: Tensor, layers: tuple[nn.Module, ...]) -> list[Tensor]:
        if len(layers) < 2 or not all(type(layer) is self.float8_linear and layer.bias is None for layer in layers):
            return each_linear(x, layers)
        if self.in_graph:
            out = (_shared_input_forward(x, layers) if x.shape[:-1].numel() % MM_MULTIPLE
                   else _shared_input_matmul(x, layers))
        else:
            out = _run_float8(x, layers, (id(layers[0]), len(layers)), _fused_shared_input, _static_shared_input)
        return list(out.split([layer.out_features for layer in layers], dim=-1))


def share_input_casts(model: nn.Module, *, in_graph: bool) -> int:
    """Every attention and MLP block of ``model`` (their ``project`` hook, model.py) casts a
    shared input once (`SharedInputFloat8`); returns how many blocks."""
    blocks = [m for m in model.modules() if getattr(m, "project", None) is each_linear]
    for block in blocks:
        block.project = SharedInputFloat8(in_graph=in_graph)
    return len(blocks)


# --- the LM head: torch._scaled_mm --------------------------------------------------------------


def quantize(x: Tensor, dtype: torch.dtype, rowwise: bool) -> tuple[Tensor, Tensor]:
    """(``x`` in float8, inverse scale): ``x ~= q * inv``; inv ``[rows, 1]`` rowwise, ``[]``
    tensorwise, float32 (what ``torch._scaled_mm`` takes)."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True) if rowwise else xf.abs().amax()
    scale = float8_scale(amax, dtype, pow2=rowwise)
    fmax = torch.finfo(dtype).max
    return (xf * scale).clamp(-fmax, fmax).to(dtype), scale.reciprocal()


def loss_and_quantized_probs(logits: Tensor, labels: Tensor, weights: Tensor, dtype: torch.dtype,
                             rowwise: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(the chunk's loss, ``w * softmax(logits)`` ``[C, V]`` in float8, its inverse scale).

    The one-hot is left out (module docstring). Each scale is known before the probabilities
    are, so the loss, the softmax, its scale and the cast need nothing but each row's own
    reductions (the log-sum-exp shared by the loss and the softmax), which inductor can fuse
    into one kernel over the logits (whether it does is not profiled yet; the 135M-class step with
    the head alone in float8 is timed in docs/benchmarks.md, "CUDA graphs with steps launched
    back to back"): rowwise,
    a row's maximum of ``w * softmax`` is ``w * exp(max(x) - lse)``, from the row's own
    reductions; tensorwise, the scale maps the bound ``max(w)`` (a softmax entry is at most
    1) to the format's largest value instead of the tensor's maximum, which would need every
    row's reductions before any row is cast (a second kernel and a second read of the logits:
    on an H100, 4.8 ms for the two against 3.2 ms for bf16's one at the 135M-class step).
    float8's relative rounding does not depend on the scale; a scale below the tensor's own
    moves the smallest entries nearer float8's underflow: with e5m2 and ``w <= 1``, entries of
    ``w * softmax`` below ~3e-10 round to zero, together at most ~4e-5 of a row of W over a
    vocabulary of 150K.
    """
    x = logits.to(_acc_dtype(logits.dtype))  # [C, V] float32 (float64 for a float64 head)
    lse = torch.logsumexp(x, dim=-1, keepdim=True)  # [C, 1]
    loss = ((lse[:, 0] - x.gather(1, labels[:, None])[:, 0]) * weights).sum()
    if rowwise:
        amax = weights[:, None] * torch.exp(x.amax(dim=-1, keepdim=True) - lse)  # [C, 1]
    else:
        amax = weights.amax()  # [] the bound of every w * softmax entry
    scale = float8_scale(amax, dtype, pow2=rowwise)
    fmax = torch.finfo(dtype).max
    q = (torch.exp(x - lse) * (weights[:, None] * scale)).clamp(-fmax, fmax).to(dtype)
    return loss, q, scale.reciprocal()


_fused_quantize = CudaCompiled(quantize, dynamic_args=(0,))
_fused_loss_and_probs = CudaCompiled(loss_and_quantized_probs, dynamic_args=(0, 1, 2))


class Fp8LMHead:
    """The frozen LM head's matmuls of the chunked CE in float8: dL/dh, and the logits when
    ``fp8_logits`` (else those are ``F.linear`` in the head's dtype, as without float8).

    W ``[V, H]`` is quantized once: ``w_q`` for the logits (per vocabulary row when rowwise)
    and ``wt_q`` = W^T for dL/dh (per hidden channel when rowwise), each row-major, so
    ``w_q.t()`` and ``wt_q.t()`` are the column-major operands ``torch._scaled_mm`` wants.
    The logits GEMM uses fast accumulation (torchao does for forward GEMMs); the gradient
    GEMM, whose inner dimension is the vocabulary, does not.
    """

    def __init__(self, weight: Tensor, *, rowwise: bool, fp8_logits: bool = True, emulate: bool = False) -> None:
        self.weight = weight  # [V, H] the head's own: bf16 logits, the exact one-hot part of dL/dh
        self.rowwise, self.fp8_logits, self.emulate = rowwise, fp8_logits, emulate
        self.grad_dtype = E4M3 if rowwise else E5M2
        with torch.no_grad():
            # [V, H], [V, 1] | [] for the logits; [H, V], [H, 1] | [] for dL/dh
            self.w_q, self.w_inv = quantize(weight, E4M3, rowwise) if fp8_logits else (None, None)
            self.wt_q, self.wt_inv = quantize(weight.t().contiguous(), E4M3, rowwise)

    @classmethod
    def create(cls, weight: Tensor, **kwargs) -> "Fp8LMHead | None":
        """The float8 head, or None when W's dims are not multiples of 16 (the head then
        stays in its own dtype)."""
        if weight.dim() != 2 or weight.shape[0] % MM_MULTIPLE or weight.shape[1] % MM_MULTIPLE:
            return None
        return cls(weight, **kwargs)

    def _mm(self, a, b, a_inv, b_inv, out_dtype, fast_accum: bool) -> Tensor:
        return scaled_matmul(a, b, a_inv, b_inv, out_dtype, fast_accum=fast_accum, emulate=self.emulate)

    @torch.no_grad()
    def loss_and_input_grad(self, h: Tensor, labels: Tensor, weights: Tensor, *,
                            with_grad: bool) -> tuple[Tensor, Tensor | None]:
        """(``sum_i w_i * CE_i`` of one chunk, ``dL/dh`` ``[C, H]`` float32 or None).

        h ``[C, H]`` in the head's dtype, labels ``[C]`` long, weights ``[C]`` float32.
        """
        # Outside autocast: it would round the emulated float32 matmuls to bf16.
        with torch.autocast(h.device.type, enabled=False):
            if self.fp8_logits:
                h_q, h_inv = _fused_quantize(h, E4M3, self.rowwise)  # [C, H], [C, 1] | []
                logits = self._mm(h_q, self.w_q.t(), h_inv, self.w_inv.t(), self.weight.dtype, True)  # [C, V]
            else:
                logits = F.linear(h, self.weight)  # [C, V]
            if not with_grad:
                return _fused_chunk_loss(logits, labels, weights), None
            loss, p_q, p_inv = _fused_loss_and_probs(logits, labels, weights, self.grad_dtype, self.rowwise)
            del logits
            # bf16 out, as the bf16 path's dlogits @ W: the output type every scaled-mm kernel has
            soft = self._mm(p_q, self.wt_q.t(), p_inv, self.wt_inv.t(), torch.bfloat16, False)  # [C, H]
            dh = soft.float() - weights[:, None] * self.weight.index_select(0, labels).float()  # minus the one-hot
        return loss, dh
