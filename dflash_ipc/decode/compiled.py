"""torch.compile of the target's decode forward: its small kernels fused (on a GPU by default).

A captured decode step (graphs.py) removes the launch overhead but not the kernels: a
transformers decoder layer is dozens of them (each RMS norm is a cast, a square, a mean, an
rsqrt, two multiplies; rotary is slices, a concat and four element-wise ops), and at batch 1
their fixed cost is as large as the weight reads. Inductor fuses each such chain into one
kernel. With ``DFLASH_DECODE_TUNE=1`` it also gets ``coordinate_descent_tuning``, under which
Inductor turns a one-row matmul (batch 1: ``[1, H] @ W``) into a reduction kernel tuned for the
weight's read bandwidth and fused with the norm that feeds it.

The decoders run this under ``compile`` "on", or "auto" (their default) where the step is a CUDA
graph: on a GPU. Measured on an H200 (docs/benchmarks.md, "Batched regenerate"), layer scope
compiles in ~10 s and makes the Qwen3-1.7B-shaped step 1.66x faster at batch 1, 1.2x at 256 rows.
:meth:`BatchedTarget.extend` is compiled (the step of the decoding core and the verify pass of
speculative decoding both go through it), and under the layer scope a prefill runs the same
layer through :func:`prefill_layer_step` (its K/V written as plan_fresh's; graphs of its own:
one for rows 2+ and one for a single row, each again for a one-token prompt and, on CUDA, for
prompts short enough for decode_attention.py's kernel; every other width shares them): eagerly,
a deep target's prefill is bound by the host's dispatch of every op of every layer. What is
compiled is the scope (SCOPES; the target's ``compile_scope``,
else ``$DFLASH_DECODE_COMPILE_SCOPE``, else layer):

    layer    one decoder layer's forward (:func:`layer_step`), which every layer runs: the
             compile costs one layer's, whatever the depth. Each layer's ``forward`` is a
             :class:`LayerForward` that calls it only while a compiled extend or prefill runs
             (else the class's forward); the text stack's final norm and rotary table run
             compiled functions of their own (:class:`EdgeForward`; $DFLASH_DECODE_COMPILE_EDGES=off:
             eagerly); the embedding, masks and head run eagerly.
             The layer's cache is a :class:`LayerKV` of that layer's K/V storage, whose
             ``update`` ignores the layer index, so no guard names a layer and no layer compiles
             again (tests/test_decode_compiled.py: as many graphs for 4 layers as for 2). The
             module's forward hooks (target.py LayerCapture) run around it, eagerly. A layer
             that decode/fused_layer.py fuses runs its steps of a few rows through
             :func:`fused_layer_step` instead (one more compiled function, shared the same way).
    forward  extend's whole body (positions, masks, the cache write plan, the model forward
             with every layer unrolled, the captured layers): one graph, fused across layers,
             compiled in time that grows with the depth (measured on an H200, Qwen3-1.7B shape,
             28 layers: 275 s for batch 1). The prefill stays eager under it.

Shapes are dynamic (``dynamic=True``, no duck sizing), so one compile serves every rows
bucket, key span and cache size; torch specialises sizes of 1, so batch 1 (and the one-token
step) get a program of their own. The compiled calls run inside the CUDA graphs: the first call
of a shape compiles during the graph's eager warm-up, the capture records the fused kernels.
Tested on CPU through ``aot_eager`` (tests/test_decode_compiled.py);
``python3 -m benchmarks.compile_decode qwen3-1.7b --scope layer,forward`` measures compile
time and step time on a GPU.

A compile that fails (an op Dynamo or Inductor cannot handle in some model) logs once and
the target runs the same forward eagerly from then on.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import torch
from torch import Tensor

from dflash_ipc.decode import fused_layer
from dflash_ipc.decode.matvec import HALF_DTYPES
from dflash_ipc.decode.row_cache import RaggedCache
from dflash_ipc.errors import ConfigError

log = logging.getLogger(__name__)

COMPILE = ("auto", "on", "off")  # the decoders' default is auto (decode/engine.py EngineSettings.compile)
"""auto: compiled where the step is a CUDA graph (a CUDA device); on: compiled (any device: CPU
needs a C++ compiler); off: eager."""
BACKEND = "inductor"
"""torch.compile backend (tests swap in ``aot_eager``: the same tracing without code generation)."""
SCOPES = ("layer", "forward")
"""layer: one decoder layer's forward compiled, every layer runs it; forward: extend's whole body."""
SCOPE_ENV = "DFLASH_DECODE_COMPILE_SCOPE"
"""Environment variable that picks the scope (SCOPES) where the target's constructor is not told."""
PREFILL_ENV = "DFLASH_DECODE_COMPILE_PREFILL"
"""``auto`` (unset): a prefill runs the compiled layers where the steps do (layer scope); ``off``: eagerly."""


def prefill_compiled(scope: str) -> bool:
    """Whether a prefill of a target compiled at ``scope`` runs its compiled layers ($DFLASH_DECODE_COMPILE_PREFILL)."""
    setting = os.environ.get(PREFILL_ENV) or "auto"
    if setting not in ("auto", "off"):
        raise ConfigError(f"${PREFILL_ENV}={setting!r}; allowed: ['auto', 'off']")
    return setting == "auto" and scope == "layer"


def compile_enabled(setting: str, device, graphs: bool) -> bool:
    """Whether ``setting`` (COMPILE) compiles the decode forward on ``device`` (``graphs``: the
    steps are captured as CUDA graphs)."""
    if setting not in COMPILE:
        raise ConfigError(f"decode compile={setting!r}; allowed: {list(COMPILE)}")
    return setting == "on" or (setting == "auto" and graphs and torch.device(device).type == "cuda")


def compile_scope(scope: str | None = None) -> str:
    """``scope``, else $DFLASH_DECODE_COMPILE_SCOPE, else "layer"; checked against SCOPES."""
    scope = scope or os.environ.get(SCOPE_ENV) or "layer"
    if scope not in SCOPES:
        raise ConfigError(f"decode compile scope={scope!r} (${SCOPE_ENV}); allowed: {list(SCOPES)}")
    return scope


def compiled_extend(extend: Callable, layers, scope: str, device: torch.device, edges=()):
    """What a compiled extend calls in place of ``extend`` (BatchedTarget._extend, over the
    decoder ``layers``): the whole of it compiled, or it eager around compiled layers (and
    compiled ``edges``, (name, module) pairs: the stack's final norm and rotary table,
    :class:`EdgeForward`)."""
    if scope == "forward":
        return CompiledForward(extend, device)
    return CompiledLayers(extend, layers, device, edges)


EDGES_ENV = "DFLASH_DECODE_COMPILE_EDGES"
"""``auto`` (unset): under the layer scope the text stack's final norm and rotary table run
compiled too (:class:`EdgeForward`); ``off``: eagerly, as transformers wrote them."""
EDGE_NAMES = ("norm", "rotary_emb")
"""The text stack's modules around its layers that :class:`EdgeForward` compiles, where present
(``EDGE_STEPS``, below, has a function for each)."""


def edges_compiled() -> bool:
    """$DFLASH_DECODE_COMPILE_EDGES, read at each call (so that one process can time both)."""
    setting = os.environ.get(EDGES_ENV) or "auto"
    if setting not in ("auto", "off"):
        raise ConfigError(f"${EDGES_ENV}={setting!r}; allowed: ['auto', 'off']")
    return setting == "auto"


class CompiledForward:
    """``fn`` through torch.compile; the first failure that is not the caller's (out of memory,
    a CUDA graph capture in progress) logs once and ``fn`` runs eagerly from then on."""

    def __init__(self, fn: Callable, device: torch.device) -> None:
        self.fn = fn
        tune = BACKEND == "inductor" and device.type == "cuda" and os.environ.get("DFLASH_DECODE_TUNE") == "1"
        options = {"coordinate_descent_tuning": True} if tune else None
        self.compiled = torch.compile(fn, dynamic=True, backend=BACKEND, options=options)
        self.failed = False

    def __call__(self, *args):
        if self.failed:
            return self.fn(*args)
        try:
            # No duck sizing: the first step's rows often equal the cache's, and an equality
            # guard on that would compile again for every other rows bucket. Floats specialised:
            # a module's float (an RMS norm's eps, attention's scale) made a graph input fails
            # to become a tensor in some op, and Dynamo then traces the whole code a second time.
            with torch.fx.experimental._config.patch(use_duck_shape=False), \
                    torch._dynamo.config.patch(specialize_float=True):
                return self.compiled(*args)
        except torch.OutOfMemoryError:
            raise
        except Exception as e:  # noqa: BLE001 - any compiler failure: the eager forward is the same math
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                raise  # the capture is broken either way; StepGraphs turns graphs off and we retry then
            log.warning("decode: torch.compile of the target's decode forward (%s) failed (%s: %s); running it "
                        "eagerly", getattr(self.fn, "__name__", "extend"), type(e).__name__, str(e)[:300])
            self.failed = True
            return self.fn(*args)


class CompiledLayers:
    """``extend`` run eagerly, each decoder layer's forward in it through one
    :class:`CompiledForward` of :func:`layer_step`, or, for a layer that decode/fused_layer.py
    fuses and a call of a few rows, of :func:`fused_layer_step`; a prefill (:meth:`run`) through
    one of :func:`prefill_layer_step`. Outside a call of this (an eager prefill or extend) the
    layers run their own forward."""

    def __init__(self, extend: Callable, layers, device: torch.device, edges=()) -> None:
        self.extend = extend
        self.step = CompiledForward(layer_step, device)
        self.fused_step = CompiledForward(fused_layer_step, device)
        self.prefill_step = CompiledForward(prefill_layer_step, device)
        self.active = False
        fuse = fused_layer.enabled(device)
        self.num_fused = 0
        for position, layer in enumerate(layers):
            fused = fuse and fused_layer.fusable(layer)
            layer.forward = LayerForward(layer, cache_index(layer, position), self, fused)
            self.num_fused += fused
        self.edges = [EdgeForward(name, module, self, device) for name, module in edges]
        for edge in self.edges:
            edge.module.forward = edge

    @property
    def failed(self) -> bool:
        """Whether a compile failed (that function then runs eagerly, or the layer's own step)."""
        return (self.step.failed or self.fused_step.failed or self.prefill_step.failed
                or any(edge.step.failed for edge in self.edges))

    def __call__(self, *args):
        return self.run(self.extend, *args)

    def run(self, forward: Callable, *args):
        """``forward(*args)`` with the layers compiled: extend, or a prefill (target.py)."""
        self.active = True
        try:
            return forward(*args)
        finally:
            self.active = False


class EdgeForward:
    """A text-stack module outside the layers (its final norm, its rotary table: EDGE_NAMES), run
    by a :class:`CompiledForward` of its function in EDGE_STEPS while ``owner`` is active and
    $DFLASH_DECODE_COMPILE_EDGES allows, else by the class's forward. Eagerly each is several
    kernels of a few microseconds (an RMS norm: a cast, a square, a mean, an add, an rsqrt, two
    multiplies, a cast; the rotary table: a product, a concatenation, a cosine, a sine, their
    scaling and casts), in every decode step and verify pass; compiled, one or two.

    Both work row by row (a token's norm, a position's angles), so the compiled function gets the
    rows flattened: the norm ``[N, H]``, the rotary table the positions ``[1, N]`` (the hidden
    states, read for their dtype and device only, ``[N, H]``), and the results are viewed back.
    torch specialises a size of 1, so this makes two graphs each (one row, more rows) where the
    rows and the tokens per row would make four. A call of another form runs the class's forward."""

    def __init__(self, name: str, module, owner: CompiledLayers, device: torch.device) -> None:
        self.name, self.module, self.owner = name, module, owner
        self.step = CompiledForward(EDGE_STEPS[name], device)

    def __call__(self, *args, **kwargs):
        module = self.module
        x = args[0] if args else None
        if (not self.owner.active or self.step.failed or kwargs or not isinstance(x, Tensor) or x.dim() < 2
                or not edges_compiled()):
            return type(module).forward(module, *args, **kwargs)
        if self.name == "norm" and len(args) == 1:
            return self.step(module, x.reshape(-1, x.shape[-1])).view(x.shape)
        if self.name == "rotary_emb" and len(args) == 2 and isinstance(args[1], Tensor) and args[1].dim() == 2:
            positions = args[1]
            cos, sin = self.step(module, x.reshape(-1, x.shape[-1]), positions.reshape(1, -1))
            return cos.view(*positions.shape, -1), sin.view(*positions.shape, -1)
        return type(module).forward(module, *args, **kwargs)


# One function per edge: Dynamo keeps its graphs, and its recompile limit, per function's code.
def norm_step(module, x: Tensor) -> Tensor:
    """The final norm's own forward over rows ``[N, H]`` (what :class:`EdgeForward` compiles)."""
    return type(module).forward(module, x)


def rotary_step(module, x: Tensor, positions: Tensor):
    """The rotary table's own forward for positions ``[1, N]`` (what :class:`EdgeForward` compiles)."""
    return type(module).forward(module, x, positions)


EDGE_STEPS = {"norm": norm_step, "rotary_emb": rotary_step}


def stack_edges(decoder) -> list[tuple[str, torch.nn.Module]]:
    """(name, module) of a text ``decoder`` (a TextStack's) that EdgeForward compiles: EDGE_NAMES present on it."""
    return [(name, getattr(decoder, name)) for name in EDGE_NAMES
            if isinstance(getattr(decoder, name, None), torch.nn.Module)]


def cache_index(layer, position: int) -> int:
    """The cache slot ``layer`` writes: its attention's ``layer_idx``, which HF attention passes to
    ``Cache.update`` (the eager path's slot), else its position in the layer list."""
    index = getattr(getattr(layer, "self_attn", None), "layer_idx", None)
    return position if index is None else int(index)


class LayerForward:
    """Decoder layer ``index``'s forward: through ``owner.step`` (or, fused and a few rows,
    ``owner.fused_step``; under plan_fresh, ``owner.prefill_step``) while ``owner`` is active,
    else the class's. An instance attribute, so
    the module's hooks (target.py LayerCapture) still run around it, eagerly."""

    def __init__(self, layer, index: int, owner: CompiledLayers, fused: bool = False) -> None:
        self.layer, self.index, self.owner = layer, index, owner
        self.rows_limit = min(layer.self_attn.q_proj.group.rows_limit, fused_layer.max_rows()) if fused else 0
        """The most rows a call runs :func:`fused_layer_step` for (0: the layer is not fused)."""

    def _step(self, args, kwargs) -> CompiledForward:
        """The fused step for a call of at most ``rows_limit`` rows in a half dtype (or off CUDA),
        with the hidden states first (as models pass them); else the layer's own."""
        x = args[0] if len(args) == 1 else None if args else kwargs.get("hidden_states")
        if (self.rows_limit and x is not None and x.numel() <= self.rows_limit * x.shape[-1]
                and kwargs.get("position_embeddings") is not None and (x.dtype in HALF_DTYPES or not x.is_cuda)
                and not self.owner.fused_step.failed):  # a failed fused compile: the compiled unfused step
            return self.owner.fused_step
        return self.owner.step

    def __call__(self, *args, **kwargs):
        layer = self.layer
        found = [(k, v) for k, v in kwargs.items() if isinstance(v, RaggedCache)] if self.owner.active else []
        fresh = bool(found) and found[0][1]._plan is not None and found[0][1]._plan[0] == "fresh"
        step = self.owner.prefill_step if fresh else self._step(args, kwargs) if found else self.owner.step
        if not found or step.failed or found[0][1].kv.keys[self.index] is None:
            return type(layer).forward(layer, *args, **kwargs)  # not ours, compiling failed, or storage not allocated yet
        name, cache = found[0]
        _, rows, pos, length = cache._plan  # plan_extend's, or plan_fresh's (length 0: a prefill)
        kv = cache.kv
        others = {k: v for k, v in kwargs.items() if k != name}
        try:
            return step(layer, kv.keys[self.index], kv.values[self.index], rows, pos, length, name, args, others)
        except Exception:
            if not step.failed:
                raise
            # The compile failed and layer_step's eager run did too (a layer needing more of the
            # Cache API than LayerKV's update): the class's forward over the RaggedCache. Its
            # writes are the same K/V at the same places, so a partial first write is harmless.
            return type(layer).forward(layer, *args, **kwargs)


def layer_step(layer, keys: Tensor, values: Tensor, rows: Tensor, pos: Tensor, length: int, cache_kw: str,
               args: tuple, kwargs: dict):
    """``layer``'s forward with a :class:`LayerKV` of its K/V storage ``keys``/``values`` as its
    cache: the code every layer shares, with nothing in it that names the layer (Dynamo would
    specialise on an index and compile once per layer)."""
    return type(layer).forward(layer, *args, **{cache_kw: LayerKV(keys, values, rows, pos, length)}, **kwargs)


def prefill_layer_step(layer, keys: Tensor, values: Tensor, rows: Tensor, pos: Tensor, length: int, cache_kw: str,
                       args: tuple, kwargs: dict):
    """:func:`layer_step` for a prefill (``length`` 0, LayerKV): a function of its own, so that its
    graphs, dynamo's recompile limit and a failed compile are apart from the steps'."""
    return type(layer).forward(layer, *args, **{cache_kw: LayerKV(keys, values, rows, pos, length)}, **kwargs)


def fused_layer_step(layer, keys: Tensor, values: Tensor, rows: Tensor, pos: Tensor, length: int, cache_kw: str,
                     args: tuple, kwargs: dict):
    """:func:`layer_step` through decode/fused_layer.py's ``fused_forward`` (the hidden states are
    ``args[0]`` or a keyword)."""
    return fused_layer.fused_forward(layer, LayerKV(keys, values, rows, pos, length), *args, **kwargs)


class LayerKV:
    """One layer of a RaggedCache under ``plan_extend``, as HF attention calls it
    (``update(k, v, layer_idx)``): ``index_put_`` as RowStorage.write does outside CUDA (in the
    compiled step the compiler fuses it into its own kernels) then .view on this layer's storage
    ``[rows, capacity + 1, heads, D]``; the index is not read. ``length`` 0 is ``plan_fresh``'s
    (a prefill: ``rows`` are the new rows, attention sees the forward's own K/V): the same
    writes, and ``update`` returns the states it was given, as RaggedCache.update does. torch
    specialises a 0, so a prefill gets graphs of its own."""

    def __init__(self, keys: Tensor, values: Tensor, rows: Tensor, pos: Tensor, length: int) -> None:
        self.keys, self.values, self.rows, self.pos, self.length = keys, values, rows, pos, length

    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args, **kwargs):
        """key/value_states ``[R, heads, q, D]`` written at ``pos`` ``[R, q]`` -> K, V ``[R, heads, length, D]``
        (length 0: the given states)."""
        index = (self.rows[:, None], self.pos)
        self.keys.index_put_(index, key_states.transpose(1, 2))
        self.values.index_put_(index, value_states.transpose(1, 2))
        if self.length == 0:
            return key_states, value_states
        return self.view()

    def view(self) -> tuple[Tensor, Tensor]:
        """K, V ``[R, heads, length, D]`` of the step's rows (what ``update`` returns)."""
        n, length = self.rows.shape[0], self.length
        return self.keys[:n, :length].transpose(1, 2), self.values[:n, :length].transpose(1, 2)
