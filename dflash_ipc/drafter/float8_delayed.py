"""The drafter's linear layers in float8 with delayed scaling (``drafter.fp8_recipe: delayed``).

torchao's tensorwise recipe scales every tensor by its own abs-max, so each cast is two
passes (reduce, then cast), and its backward casts the saved bf16 input and the float32
weight again, transposed. At the Qwen3-8B shape that scaling took 65 ms of a 369-ms fp8
step's kernels on an H200 (docs/benchmarks.md, "fp8 drafter step"), half what the float8
GEMMs took. Here, as in Transformer Engine's default recipe:

- an input's and an output gradient's scale come from the abs-max of the same layer's
  tensors over the last ``AMAX_HISTORY`` steps (``fmax / (AMAX_MARGIN x max(history))``), so
  one pass casts the tensor in both layouts its matmuls need and folds its abs-max into the
  history (float8_cast.py): ~4 bytes an element against ~8;
- the forward saves the float8 input, transposed, for the weight gradient (1 byte an element
  where a bf16 input is 2), and the backward reuses the forward's float8 weight;
- the weight is cast once a step, with its own abs-max of that step (exact, as tensorwise),
  shared by the forward, a gradient-checkpointing recompute and the backward;
- layers that read the very same tensor (q/k/v of the block, k/v of the context, gate/up)
  share its cast: one pass where torchao's layers make one each.

Formats and GEMMs are torchao's tensorwise ones: e4m3 inputs and weights, e5m2 gradients,
fast accumulation in the forward GEMM only, bf16 outputs, float32 weight gradients. What
differs is the numbers: a tensor whose abs-max grew past its history saturates at the
format's largest value where a just-in-time scale would not (``bench precision`` measures
the loss against bf16). Until a layer has one step of history its casts scale by the
tensor's own abs-max (the first step runs as tensorwise does).

The histories of a model live in one :class:`AmaxHistory` (one tensor per kind), rolled by
:func:`next_step` between steps (the trainer calls it before each step, after the last one's
optimizer step is queued): within a step every scale is fixed, so a gradient-checkpointing
recompute casts exactly as the forward did. A layer called twice in a step (k/v read the
context and the block) keeps the larger abs-max. Each rank keeps its own histories (no
all-reduce: a rank's scales only have to fit its own tensors). The layers run eagerly, outside
torch.compile (``drafter.compile: off``), and the weights stay the same float32 parameters
under the same names, so checkpoints and exports do not change. The histories are not
checkpointed: a resumed job's first step scales each tensor by its own abs-max, as a new one's.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from dflash_ipc.drafter.float8_cast import cast_to_float8
from dflash_ipc.drafter.float8_matmul import AMAX_EPS, E4M3, E5M2, MM_MULTIPLE, float8_scale, scaled_matmul

AMAX_HISTORY = 16
"""Steps of abs-max a scale covers. Longer: fewer saturated steps after a spike, coarser
rounding for the small values of the steps after it (the scale stays down while the spike
is in the history)."""
AMAX_MARGIN = 2.0
"""A scale maps ``AMAX_MARGIN x max(history)`` to the format's largest value: a tensor whose
abs-max doubled since its history (the context of a batch of other sequences: the tiny test
drafter's k/v inputs went from 3.66 to 7.03 between two steps) still does not saturate. It costs
one binade at the small end (e4m3 keeps ~16 binades below its largest value)."""
INPUT, GRAD = 0, 1  # the two kinds of tensor a layer scales with history
FORMATS = (E4M3, E5M2)  # the float8 format of each kind

_HISTORIES: "weakref.WeakSet[AmaxHistory]" = weakref.WeakSet()


class AmaxHistory:
    """Abs-max histories and scales of ``num_layers`` layers, each for its inputs and its
    output gradients, on one device (made at the first cast)."""

    def __init__(self, num_layers: int, length: int = AMAX_HISTORY) -> None:
        self.num_layers, self.length = num_layers, length
        self.history: Tensor | None = None  # [L, 2, length] float32: newest first
        self.pending: Tensor | None = None  # [L, 2] this step's abs-max so far
        self.scales: Tensor | None = None  # [L, 2] float32: fmax of the kind's format / max(history)
        self.inverses: Tensor | None = None  # [L, 2] 1 / scales, set at the roll: no launch per cast
        self._sink: Tensor | None = None  # [1]: where a weight's abs-max goes (it has no history)
        self.ready = [[False, False] for _ in range(num_layers)]  # a step of history behind the scale
        self._used = [[False, False] for _ in range(num_layers)]  # cast this step
        self._weights: dict[int, tuple] = {}  # layer -> (weight key, w_q, w_qt, w_inv): this step's casts
        self._last_input: tuple | None = None  # (weakref to x, its version, rows, layer, q, qt, inv)
        _register(self)

    def __deepcopy__(self, memo) -> "AmaxHistory":
        """A copied model's own histories (the same values), registered to roll; no cached casts."""
        copy = AmaxHistory(self.num_layers, self.length)
        if self.history is not None:
            copy.history, copy.pending, copy.scales, copy.inverses, copy._sink = (
                t.clone() for t in (self.history, self.pending, self.scales, self.inverses, self._sink))
        copy.ready = [list(r) for r in self.ready]
        copy._used = [list(u) for u in self._used]
        memo[id(self)] = copy
        return copy

    def _ensure(self, device: torch.device) -> None:
        if self.history is None or self.history.device != device:
            with torch.inference_mode(False):  # state that outlives an inference-mode call stays updatable
                self.history = torch.zeros(self.num_layers, 2, self.length, device=device)
                self.pending = torch.zeros(self.num_layers, 2, device=device)
                self.scales = torch.ones(self.num_layers, 2, device=device)
                self.inverses = torch.ones(self.num_layers, 2, device=device)
                self._sink = torch.zeros(1, device=device)
            self.ready = [[False, False] for _ in range(self.num_layers)]

    def cast(self, layer: int, kind: int, x: Tensor, *, transpose: bool) -> tuple[Tensor, Tensor | None, Tensor]:
        """(x in the kind's float8 format, its transpose or None, the inverse scale) for layer
        ``layer``'s tensor of ``kind`` (INPUT or GRAD); its abs-max joins this step's."""
        self._ensure(x.device)
        dtype, x = FORMATS[kind], x.detach()  # a cast is not differentiated: the matmuls' Function is
        if self.ready[layer][kind]:
            scale, inverse = self.scales[layer, kind], self.inverses[layer, kind]
        else:  # no history yet: the tensor's own abs-max (one more pass, this step only)
            scale = float8_scale(_abs_max(x), dtype)
            inverse = scale.reciprocal()
        q, qt = cast_to_float8(x, scale, self.pending[layer, kind: kind + 1], dtype, transpose=transpose)
        self._used[layer][kind] = True
        return q, qt, inverse

    def input_cast(self, layer: int, x: Tensor, flat: Tensor, *,
                   transpose: bool) -> tuple[Tensor, Tensor | None, Tensor]:
        """:meth:`cast` of layer ``layer``'s input ``x`` (``flat``: its rows flattened and padded),
        or, where ``x`` is the very tensor the last input cast was made of (unchanged since),
        that cast: the layers that read one input (q/k/v, k/v of the context, gate/up) cast it
        once. Their histories then see the first layer's abs-max (the same tensor's), so each
        stays what it would have been; the scale is the first layer's, from the same inputs."""
        if x.is_inference():  # no version counter to trust: cast it, remember nothing
            return self.cast(layer, INPUT, flat, transpose=transpose)
        last = self._last_input
        if (last is not None and last[0]() is x and last[1] == x._version and last[2] == tuple(flat.shape)
                and (last[5] is not None or not transpose)):
            source = last[3]
            if source != layer:
                torch.maximum(self.pending[layer, INPUT], self.pending[source, INPUT], out=self.pending[layer, INPUT])
                self._used[layer][INPUT] = True
            return last[4], last[5], last[6]
        q, qt, inv = self.cast(layer, INPUT, flat, transpose=transpose)
        # A weak reference: the cache neither keeps x alive nor trusts an address a new tensor may reuse
        self._last_input = (weakref.ref(x), x._version, tuple(flat.shape), layer, q, qt, inv)
        return q, qt, inv

    def weight(self, layer: int, weight: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(weight ``[M, K]`` in e4m3, its transpose ``[K, M]``, the inverse scale), cast at the
        layer's first call of the step with the weight's own abs-max. Dropped at every roll and
        every optimizer step (a fused optimizer writes the weight without bumping its version)."""
        key = (weight.data_ptr(), weight._version, tuple(weight.shape))
        cached = self._weights.get(layer)
        if cached is None or cached[0] != key:
            w = weight.detach()
            scale = float8_scale(_abs_max(w), E4M3)
            self._ensure(w.device)
            w_q, w_qt = cast_to_float8(w, scale, self._sink, E4M3, transpose=True)
            cached = (key, w_q, w_qt, scale.reciprocal())
            if not torch.is_inference_mode_enabled():  # an inference tensor could not be saved for a backward
                self._weights[layer] = cached
        return cached[1:]

    def roll(self) -> None:
        """Between steps: this step's abs-maxes enter the histories, the scales follow, the
        weights' casts are dropped (the optimizer has changed them)."""
        self._weights.clear()
        self._last_input = None
        if self.history is None or not any(any(used) for used in self._used):
            return
        with torch.no_grad():
            self.history[:, :, 1:] = self.history[:, :, :-1].clone()
            self.history[:, :, 0] = self.pending
            self.pending.zero_()
            amax = self.history.amax(dim=-1)  # [L, 2]
            # Where the history holds no finite abs-max above 0 (all-zero gradients), the scale
            # stays as it was, as Transformer Engine keeps it: fmax / 0 would saturate everything.
            usable = torch.isfinite(amax) & (amax > 0)
            for kind, dtype in enumerate(FORMATS):  # Python scalars over tensors: no host-to-device copy, no wait
                new = torch.finfo(dtype).max / (AMAX_MARGIN * amax[:, kind].clamp_min(AMAX_EPS))
                torch.where(usable[:, kind], new, self.scales[:, kind], out=self.scales[:, kind])
            torch.reciprocal(self.scales, out=self.inverses)
        for layer, used in enumerate(self._used):
            for kind in (INPUT, GRAD):
                self.ready[layer][kind] |= used[kind]
                used[kind] = False

    def discard(self) -> None:
        """Forget this step's abs-maxes and casts, as if nothing had run since the last roll (a
        memory probe's forward and backward, drafter/fit.py: its made-up inputs must not set
        the first step's scales)."""
        if self.pending is not None:
            self.pending.zero_()
        self._used = [[False, False] for _ in range(self.num_layers)]
        self._weights.clear()
        self._last_input = None


def _register(history: AmaxHistory) -> None:
    global _HOOKED
    _HISTORIES.add(history)
    if not _HOOKED:  # any optimizer's step drops the weights' casts: they no longer match the weights
        register_optimizer_step_post_hook(_drop_weight_casts)
        _HOOKED = True


def _drop_weight_casts(optimizer, args, kwargs) -> None:
    for history in list(_HISTORIES):
        history._weights.clear()


_HOOKED = False


def _abs_max(x: Tensor) -> Tensor:
    """max |x| in one reduction (``x.abs().amax()`` writes and reads |x| first)."""
    return torch.linalg.vector_norm(x, float("inf"))


def next_step() -> None:
    """Roll every model's histories (precision.next_step, between two steps)."""
    for history in list(_HISTORIES):
        history.roll()


def discard_step() -> None:
    """Every model's :meth:`AmaxHistory.discard` (precision.discard_step)."""
    for history in list(_HISTORIES):
        history.discard()


class _DelayedMatmul(torch.autograd.Function):
    """``x @ weight.t()`` through float8 GEMMs; x ``[N, K]`` with N a multiple of 16."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, x_q: Tensor, x_qt: Tensor | None, x_inv: Tensor,
                layer: "DelayedFloat8Linear") -> Tensor:
        """x ``[N, K]``: the input, for autograd (its gradient); x_q / x_qt / x_inv its cast."""
        with torch.autocast(x.device.type, enabled=False):  # the emulated matmuls stay float32
            w_q, w_qt, w_inv = layer.history.weight(layer.history_index, weight)
            out = scaled_matmul(x_q, w_q.t(), x_inv, w_inv, x.dtype, fast_accum=True, emulate=layer.emulate)
        ctx.save_for_backward(x_qt, x_inv, w_qt, w_inv)
        ctx.layer, ctx.weight_dtype = layer, weight.dtype
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        x_qt, x_inv, w_qt, w_inv = ctx.saved_tensors
        layer = ctx.layer
        wants_x, wants_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1] and x_qt is not None
        grad_x = grad_w = None
        with torch.autocast(grad.device.type, enabled=False):
            # any strides: the cast reads them (a gradient that arrives transposed is not copied first)
            g_q, g_qt, g_inv = layer.history.cast(layer.history_index, GRAD, grad, transpose=wants_w)
            if wants_x:  # [N, M] @ [M, K]: the weight column-major is its transpose row-major
                grad_x = scaled_matmul(g_q, w_qt.t(), g_inv, w_inv, grad.dtype, fast_accum=False,
                                       emulate=layer.emulate)
            if wants_w:  # [M, N] @ [N, K]: both with N contiguous
                grad_w = scaled_matmul(g_qt, x_qt.t(), g_inv, x_inv, ctx.weight_dtype, fast_accum=False,
                                       emulate=layer.emulate)
        return grad_x, grad_w, None, None, None, None


class DelayedFloat8Linear(nn.Linear):
    """An ``nn.Linear`` whose product runs in float8 with delayed scaling (module docstring);
    the same ``weight`` and ``bias`` parameters as the layer it replaces."""

    @classmethod
    def from_linear(cls, linear: nn.Linear, history: AmaxHistory, index: int, *,
                    emulate: bool) -> "DelayedFloat8Linear":
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer.in_features, layer.out_features = linear.in_features, linear.out_features
        layer.weight, layer.bias = linear.weight, linear.bias  # the same Parameters, same names
        layer.history, layer.history_index, layer.emulate = history, index, emulate
        return layer

    def forward(self, x: Tensor) -> Tensor:
        if torch.is_autocast_enabled(x.device.type):  # as nn.Linear under autocast: the compute dtype
            x = x.to(torch.get_autocast_dtype(x.device.type))
        lead, rows = x.shape[:-1], x.shape[:-1].numel()
        flat = x.reshape(rows, x.shape[-1])
        if rows % MM_MULTIPLE:  # zero rows change neither an abs-max nor a weight-gradient sum
            flat = F.pad(flat, (0, 0, 0, -rows % MM_MULTIPLE))
        flat = flat.contiguous()
        wants_wgrad = torch.is_grad_enabled() and self.weight.requires_grad  # else no transposed input is kept
        x_q, x_qt, x_inv = self.history.input_cast(self.history_index, x, flat, transpose=wants_wgrad)
        out = _DelayedMatmul.apply(flat, self.weight, x_q, x_qt, x_inv, self)
        if out.shape[0] != rows:  # only where padded: a slice's backward writes a zeroed copy of the gradient
            out = out[:rows]
        out = out.reshape(*lead, self.out_features)
        return out if self.bias is None else out + self.bias.to(out.dtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, float8 delayed scaling"


def convert_linears(model: nn.Module, *, emulate: bool = False) -> tuple[list[DelayedFloat8Linear], list[str]]:
    """Swaps every ``nn.Linear`` of ``model`` with both dims multiples of 16 for a
    :class:`DelayedFloat8Linear` sharing one :class:`AmaxHistory`; returns (the new layers,
    the names of the layers left alone)."""
    names = [name for name, m in model.named_modules() if type(m) is nn.Linear]
    fits = [n for n in names if _fits(model.get_submodule(n))]
    history = AmaxHistory(len(fits))
    converted = []
    for index, name in enumerate(fits):
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        layer = DelayedFloat8Linear.from_linear(getattr(parent, child), history, index, emulate=emulate)
        setattr(parent, child, layer)
        converted.append(layer)
    return converted, [n for n in names if n not in fits]


def _fits(linear: nn.Linear) -> bool:
    return linear.in_features % MM_MULTIPLE == 0 and linear.out_features % MM_MULTIPLE == 0
