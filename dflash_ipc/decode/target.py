"""The frozen target for batched decoding: one transformers model, a per-row KV cache, features.

Two kinds of forward, both over rows of a :class:`~dflash_ipc.decode.row_cache.RaggedCache`:

    prefill(rows, prompts)  new sequences in the given rows, left-padded to one length so
                            the logits of every row's last prompt token are the last column
                            (only those are computed); pads write to the scratch slot and
                            attend to themselves only.
    extend(tokens, lengths) q tokens for EVERY row after its ``lengths[b]`` cached
                            positions: a plain decoding step (q = 1) or a verify pass
                            (q = block size). Logits of all q tokens.

Forward hooks keep the outputs of the captured layers (HF ``hidden_states[id + 1]``, the
tensors target/capture.py sends to training), concatenated: the drafter's features.
Masks, positions and cache writes are explicit (see ragged_attention.py), so transformers
derives nothing from the cache.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from dflash_ipc.data.stops import stop_token_ids
from dflash_ipc.hf.target_head import FrozenTargetHead
from dflash_ipc.config.dtypes import resolve_dtype
from dflash_ipc.errors import ConfigError
from dflash_ipc.decode.compiled import compile_scope as _compile_scope, compiled_extend, prefill_compiled, stack_edges
from dflash_ipc.decode import aranges, decode_attention, fused_layer, fused_projections, matvec
from dflash_ipc.decode.prefill_sdpa import prefill_backends
from dflash_ipc.decode.ragged_attention import layer_masks, register_attention
from dflash_ipc.decode.row_cache import MASK_ALIGN, RaggedCache, round_up
from dflash_ipc.hf.text_stack import find_text_stack, has_recurrent_layers, load_causal_lm, text_config

logger = logging.getLogger(__name__)


def check_layer_ids(layer_ids: Sequence[int], num_layers: int, source: str) -> list[int]:
    ids = [int(i) for i in layer_ids]
    if not all(0 <= i < num_layers for i in ids):
        raise ConfigError(f"drafter target_layer_ids={ids}: allowed ids are 0..{num_layers - 1} for the target {source}")
    return ids


def pack_prompts(prompts: Sequence[np.ndarray], width: int, rows: Sequence[int]) -> np.ndarray:
    """A prefill's inputs in one int64 array (one copy to the device), :func:`unpack_prompts`'s
    layout: the prompts left-padded with 0 to ``width`` tokens, their lengths, their cache rows.
    ``rows`` past the prompts (a caller's padding) get length 0: pads only."""
    r = len(rows)
    packed = np.zeros(r * (width + 2), dtype=np.int64)
    ids = packed[: r * width].reshape(r, width)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = p
        packed[r * width + i] = len(p)
    packed[r * (width + 1):] = rows
    return packed


def unpack_prompts(packed: Tensor, num_rows: int, width: int) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`pack_prompts`'s array as contiguous views: ids ``[R, width]``, lengths ``[R]``, rows ``[R]``."""
    n = num_rows * width
    return packed[:n].view(num_rows, width), packed[n: n + num_rows], packed[n + num_rows:]


def model_layer_types(text_config, num_layers: int) -> list[str]:
    """Each layer's attention type as transformers runs it: the config's ``layer_types``; without
    them a ``sliding_window`` (not switched off by ``use_sliding_window``) slides in every layer, as
    Mistral, Mixtral and Phi-3 apply it; else full attention."""
    types = getattr(text_config, "layer_types", None)
    if types:
        return list(types)
    slides = getattr(text_config, "sliding_window", None) and getattr(text_config, "use_sliding_window", True) is not False
    return ["sliding_attention" if slides else "full_attention"] * num_layers


@dataclass(slots=True)
class Prefilled:
    """One prefill forward: R new rows, left-padded to P tokens."""

    logits: Tensor
    """``[R, V]`` after each row's last prompt token."""
    features: Tensor | None
    """``[R, P, F]`` captured layers (None without layer ids)."""
    write_pos: Tensor
    """``[R, P]`` cache index of each token (the scratch slot for pads)."""
    positions: Tensor
    """``[R, P]`` position of each token (0 for pads)."""


class LayerCapture:
    """Forward hooks that keep the outputs of some decoder layers (HF ``hidden_states[id + 1]``).

    ``on_features``, where set, is called with the concatenated features as soon as the last
    captured layer has run, while the forward goes on through the layers after it and the head
    (the speculative decoder starts the drafter's context there: eval/overlapped_append.py);
    :meth:`take` then returns that same tensor."""

    def __init__(self, layers, layer_ids: Sequence[int]) -> None:
        self.layer_ids = list(layer_ids)
        self._captured: dict[int, Tensor] = {}
        self._features: Tensor | None = None
        self.on_features: Callable[[Tensor], None] | None = None
        for layer_id in self.layer_ids:
            layers[layer_id].register_forward_hook(self._hook(layer_id))

    def _hook(self, layer_id: int):
        last = layer_id == max(self.layer_ids)  # layers run in order: every other one is kept by now

        def keep_output(module, args, output):
            self._captured[layer_id] = output[0] if isinstance(output, tuple) else output
            if last and self.on_features is not None:
                self._features = self._concatenated()
                self.on_features(self._features)
        return keep_output

    @contextlib.contextmanager
    def handing_on(self, on_features: Callable[[Tensor], None]):
        """``on_features`` set for the forwards inside; on leaving, unset, and features a forward
        that raised before :meth:`take` left behind forgotten."""
        self.on_features = on_features
        try:
            yield
        finally:
            self.on_features = None
            self._features = None

    def _concatenated(self) -> Tensor:
        return torch.cat([self._captured[i] for i in self.layer_ids], dim=-1)

    def take(self, keep: bool = True) -> Tensor | None:
        """The captured layers of the last forward, concatenated ``[B, q, F]`` (None if not
        ``keep`` or no layers); forgets them."""
        feats = None
        if keep and self.layer_ids:
            feats = self._features if self._features is not None else self._concatenated()
        self._captured.clear()
        self._features = None
        return feats


class TargetModel:
    """A frozen HF causal LM on one device: its text stack, captured layers, head and stop tokens."""

    def __init__(self, target_dir: str, *, layer_ids: Sequence[int], device: str | torch.device, dtype: str,
                 attn_implementation: str | None = None, model=None) -> None:
        from dflash_ipc.hf.target_config import load_target_config

        config = load_target_config(target_dir) if model is None else model.config  # a clear error for no model
        self.recurrent = has_recurrent_layers(config)
        self.device = torch.device(device)
        if model is not None:  # loaded by the caller (regenerate's hf backend): its dtype, our attention
            self.model, self.dtype = model, next(model.parameters()).dtype
            _set_attention(model, attn_implementation)
        else:
            self.dtype = resolve_dtype(dtype, device)
            try:
                self.model = load_causal_lm(target_dir, dtype=self.dtype, attn_implementation=attn_implementation)
            except (ValueError, KeyError) as exc:  # a transformers that refuses registered attention functions
                if not attn_implementation:
                    raise
                logger.warning("%s: attn_implementation=%s refused (%s); using sdpa (it copies K/V per query head)",
                               target_dir, attn_implementation, exc)
                self.model = load_causal_lm(target_dir, dtype=self.dtype, attn_implementation="sdpa")
        self.model.to(self.device).eval().requires_grad_(False)
        stack = find_text_stack(self.model)
        if stack.lm_head is None:
            raise ConfigError(f"target {target_dir}: {type(self.model).__name__} has no LM head to decode with")
        self.text_config = text_config(self.model.config)
        self.num_layers, self.hidden_size = len(stack.layers), int(self.text_config.hidden_size)
        self.layer_ids = check_layer_ids(layer_ids, self.num_layers, target_dir)
        self.capture = LayerCapture(stack.layers, self.layer_ids)
        self.head = FrozenTargetHead(stack.embed_tokens.weight, stack.lm_head.weight)
        self.stop_token_ids = stop_token_ids(target_dir, self.model)
        self.feature_dim = self.hidden_size * len(self.layer_ids)
        params = inspect.signature(self.model.forward).parameters
        # transformers 5.x renamed past_key_values to cache; we own the cache object either way.
        self.cache_kw = "cache" if "cache" in params else "past_key_values"
        self.keeps_logits = "logits_to_keep" in params
        self.num_forwards = 0
        """Target forwards run so far: the cost that tau amortises."""


def _set_attention(model, attn_implementation: str | None) -> None:
    """Switch a loaded model to ``attn_implementation`` where transformers lets us; else it keeps
    its own (sdpa takes our boolean band masks too, copying K/V per query head)."""
    setter = getattr(model, "set_attn_implementation", None)
    if not attn_implementation or not callable(setter):
        return
    try:
        setter(attn_implementation)
    except Exception as exc:  # noqa: BLE001 - whatever a transformers version raises, the model keeps working
        logger.warning("attn_implementation=%s refused by the loaded model (%s); keeping %s", attn_implementation,
                       exc, getattr(model.config, "_attn_implementation", "its own"))


class BatchedTarget(TargetModel):
    """A :class:`TargetModel` with a :class:`RaggedCache` of ``num_rows`` sequences."""

    def __init__(self, target_dir: str, *, layer_ids: Sequence[int] = (), device: str | torch.device = "cpu",
                 dtype: str = "auto", model=None, compile_scope: str | None = None) -> None:
        super().__init__(target_dir, layer_ids=layer_ids, device=device, dtype=dtype,
                         attn_implementation=register_attention(), model=model)
        if self.recurrent:
            # A row's cache is cut back after every rejected draft; a linear-attention state
            # cannot be (it would have to be recomputed from the kept prefix).
            raise ConfigError(f"target {target_dir}: batched evaluation needs attention K/V in every layer; this "
                              f"target has linear-attention (recurrent) layers, which it does not support yet")
        self.sliding_window = getattr(self.text_config, "sliding_window", None)
        self.layer_types = model_layer_types(self.text_config, self.num_layers)
        self.cache: RaggedCache | None = None
        self.compile_scope = _compile_scope(compile_scope)
        """What a compiled extend compiles (decode/compiled.py SCOPES): one decoder layer, or the whole forward."""
        self._compiled_extend = None
        """decode/compiled.py's CompiledLayers or CompiledForward, built by the first compiled extend."""
        use_matvec = matvec.enabled(self.device)
        self.num_fused_groups = (fused_projections.fuse_projections(self.model, matvec=use_matvec)
                                 if fused_projections.enabled(self.device) else 0)
        """q|k|v and gate|up groups computed as one product each (decode/fused_projections.py): on CUDA."""
        self.num_matvec_linears = matvec.route_matvec(self.model) if use_matvec else 0
        """Other linear layers whose products of at most 16 rows (a decode step at batch 1, a verify
        block) run decode/matvec.py's Triton kernels: all of them on CUDA, none elsewhere."""
        self.num_kernel_attention = (decode_attention.mark_attention(find_text_stack(self.model).layers)
                                     if decode_attention.enabled(self.device) else 0)
        """Attention modules whose decode and verify calls run decode/decode_attention.py's kernel: on CUDA."""
        self.num_fused_layers = (sum(map(fused_layer.fusable, find_text_stack(self.model).layers))
                                 if fused_layer.enabled(self.device) else 0)
        """Decoder layers that decode/fused_layer.py fuses: their steps of a few rows, where the decode
        forward is compiled at layer scope (the default on CUDA), run its four ops."""
        if self.num_fused_groups or self.num_matvec_linears or self.num_kernel_attention:
            logger.info("decode: %d q|k|v and gate|up groups as one product each, %d other linears through the "
                        "few-row Triton kernels, %d attention layers through the few-query kernel, %d layers' "
                        "few-row steps as four fused ops (%s=off, %s=off, %s=off, %s=off: as loaded)",
                        self.num_fused_groups, self.num_matvec_linears, self.num_kernel_attention,
                        self.num_fused_layers, fused_projections.FUSE_ENV, matvec.GEMV_ENV,
                        decode_attention.ATTENTION_ENV, fused_layer.FUSE_LAYER_ENV)

    def reset(self, num_rows: int, capacity: int) -> None:
        """A new, empty cache of ``num_rows`` rows of at least ``capacity`` positions."""
        self.cache = RaggedCache(self.num_layers, num_rows, capacity)

    @property
    def capacity(self) -> int:
        return self.cache.kv.capacity

    def _forward(self, ids: Tensor, positions: Tensor, masks: dict, keep: int,
                 features: bool) -> tuple[Tensor, Tensor | None]:
        kwargs = {self.cache_kw: self.cache, "use_cache": True}
        if self.keeps_logits:
            kwargs["logits_to_keep"] = keep
        # One layer type: the 4D mask itself, which every model takes as prepared (Llama's
        # forward takes no per-type mapping); several: the mapping, as the models that mix
        # layer types take it.
        mask = next(iter(masks.values())) if len(masks) == 1 else masks
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, **kwargs)
        logits = out.logits if keep == 0 or self.keeps_logits else out.logits[:, -keep:]
        return logits, self.capture.take(features)

    @torch.inference_mode()
    def prefill(self, rows: Sequence[int], prompts: Sequence[np.ndarray], *, features: bool = True,
                compiled: bool = False) -> Prefilled:
        """Start ``prompts`` (token ids) in cache ``rows``; see the module docstring. ``compiled``:
        under the layer scope, each decoder layer through its compiled forward (decode/compiled.py;
        eagerly, every op of every layer is dispatched from Python, and a prefill's time is that
        host's); under the forward scope, or with $DFLASH_DECODE_COMPILE_PREFILL=off, eagerly."""
        width = int(max(len(p) for p in prompts))
        packed = torch.from_numpy(pack_prompts(prompts, width, rows)).to(self.device)
        self.num_forwards += 1
        return self.prefill_packed(*unpack_prompts(packed, len(rows), width), features=features, compiled=compiled)

    def prefill_packed(self, ids: Tensor, lengths: Tensor, rows: Tensor, *, features: bool = True,
                       compiled: bool = False) -> Prefilled:
        """:meth:`prefill`'s forward from its inputs on the device: ``ids`` ``[R, P]`` left-padded,
        each row's prompt ``lengths`` ``[R]`` (0: a row of pads only, which writes the scratch slot of
        its cache row) and cache ``rows`` ``[R]``. Nothing in it reads the device from the host, so
        a CUDA graph can capture it (decode/prefill_graphs.py); ``num_forwards`` is the caller's."""
        dev, width = self.device, ids.shape[1]
        j = torch.arange(width, device=dev)[None, :]  # [1, P]; not kept (aranges.py): widths vary without bound
        pad = (width - lengths)[:, None]  # [R, 1]
        real = j >= pad
        positions = (j - pad).clamp_min(0)
        write_pos = torch.where(real, j - pad, self.cache.kv.scratch)
        lo = torch.where(real, pad, j)  # a pad sees itself only: no all-masked (NaN) row
        masks = layer_masks(self.layer_types, self.sliding_window, lo, j + 1, width)
        self.cache.plan_fresh(rows, write_pos)
        forward = self._forward
        if compiled and prefill_compiled(self.compile_scope):
            forward = functools.partial(self._compiled().run, self._forward)
        with prefill_backends(dev):  # no per-shape cuDNN plan for each new prompt width (prefill_sdpa.py)
            logits, feats = forward(ids, positions, masks, 1, features)
        return Prefilled(logits=logits[:, -1], features=feats, write_pos=write_pos, positions=positions)

    @torch.inference_mode()
    def extend(self, tokens: Tensor, lengths: Tensor, max_length: int, *, features: bool = True,
               compiled: bool = False) -> tuple[Tensor, Tensor | None]:
        """tokens ``[B, q]`` of every row after ``lengths`` ``[B]`` cached positions (``max_length``
        = their host-side maximum) -> (logits ``[B, q, V]``, features ``[B, q, F]`` or None).
        ``compiled``: through torch.compile (decode/compiled.py), the same computation fused."""
        q = tokens.shape[1]
        span = round_up(max_length + q, MASK_ALIGN)
        if span > self.capacity:
            raise ConfigError(f"BatchedTarget.extend: {max_length} + {q} positions exceed the cache capacity "
                              f"{self.capacity}")
        self.num_forwards += 1
        if compiled:
            return self._compiled()(tokens, lengths, span, features)
        return self._extend(tokens, lengths, span, features)

    def _compiled(self):
        """The compiled extend (decode/compiled.py), built at its first use."""
        if self._compiled_extend is None:
            stack = find_text_stack(self.model)
            self._compiled_extend = compiled_extend(self._extend, stack.layers, self.compile_scope, self.device,
                                                    stack_edges(stack.decoder))
        return self._compiled_extend

    def _extend(self, tokens: Tensor, lengths: Tensor, span: int, features: bool) -> tuple[Tensor, Tensor | None]:
        positions = lengths[:, None] + aranges.arange(tokens.shape[1], self.device)  # [B, q]
        masks = layer_masks(self.layer_types, self.sliding_window, None, positions + 1, span)
        self.cache.plan_extend(positions, span)
        return self._forward(tokens, positions, masks, keep=0, features=features)
