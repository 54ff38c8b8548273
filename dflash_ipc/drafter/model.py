"""The DFlash drafter: a few Qwen3-style decoder layers conditioned on target features.

Forward pass, for one packed step (all tensors unbatched, sequences packed):

    ctx = hidden_norm(fc(concat of captured target layers))          # [T_ctx, H]
    h   = target_embed([token_at_anchor, MASK x (bs-1)] per block)    # [Q, H]
    per layer:
        x = input_layernorm(h)
        q = rope(q_norm(q_proj(x)))                     at block positions anchor+0..bs-1
        k = rope(k_norm(k_proj([ctx; x])))              ctx at its own positions, no input norm
        v = v_proj([ctx; x])
        h = h + o_proj(attention(q, k, v, mask))        mask: see attention.py
        h = h + mlp(post_attention_layernorm(h))        SwiGLU
    out = norm(h)                                                     # [Q, H] -> target lm_head

Parameter names are the inference export names (``fc.weight``, ``layers.{i}.self_attn.
q_proj.weight``, ...), so ``state_dict()`` is the checkpoint as SGLang and vLLM load it.
The target's embedding and LM head are not part of this module (see target_head.py).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from dflash_ipc.drafter.attention import attention
from dflash_ipc.drafter.export_dir import ARCHITECTURE
from dflash_ipc.config.schema import LAYER_TYPES, MAX_BLOCK_SIZE
from dflash_ipc.errors import ConfigError
from dflash_ipc.hf.layer_ids import default_target_layer_ids
from dflash_ipc.hf.text_stack import text_config

logger = logging.getLogger(__name__)



def _cfg_get(cfg: Any, key: str, default: Any = None) -> Any:
    if isinstance(cfg, dict):
        return cfg.get(key, default)
    return getattr(cfg, key, default)


def _rope_from_target(cfg: Any) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) from a transformers 4.x (rope_theta/rope_scaling) or
    5.x (rope_parameters) config."""
    params = _cfg_get(cfg, "rope_parameters")
    if isinstance(params, dict) and isinstance(params.get("full_attention"), dict):
        params = params["full_attention"]  # per-layer-type RoPE (5.x): drafter layers are full attention
    if isinstance(params, dict) and "rope_theta" in params:
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
        if scaling.get("rope_type", "default") == "default":
            scaling = None
        return float(params["rope_theta"]), scaling
    theta = _cfg_get(cfg, "rope_theta")
    return float(1e6 if theta is None else theta), _cfg_get(cfg, "rope_scaling")


@dataclass(kw_only=True, slots=True)
class DFlashConfig:
    """Shape of a DFlash drafter; the width fields are copied from the target."""

    hidden_size: int
    """Model width H (the target's)."""
    intermediate_size: int
    """SwiGLU inner width (the target's)."""
    num_hidden_layers: int = 5
    """Number of drafter decoder layers."""
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6
    rope_scaling: dict | None = None
    """HF rope_scaling dict (with ``rope_type``) or None for plain RoPE."""
    max_position_embeddings: int = 40960
    vocab_size: int
    block_size: int = 16
    """Tokens per draft block: the anchor token plus block_size-1 masks."""
    mask_token_id: int
    target_layer_ids: list[int]
    """0-based target layers whose outputs are concatenated into the context features."""
    num_target_layers: int
    initializer_range: float = 0.02
    layer_types: list[str] | None = None
    """Per layer ``full_attention`` or ``sliding_attention`` (attention.py has the masks);
    None: all full_attention."""
    sliding_window: int | None = None
    """Window of the sliding_attention layers (HF's: query i sees key j iff 0 <= i - j < window)."""

    def __post_init__(self) -> None:
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "vocab_size", "num_target_layers",
                     "max_position_embeddings"):
            if int(getattr(self, name)) < 1:
                raise ConfigError(f"DFlashConfig.{name}={getattr(self, name)} must be >= 1")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"DFlashConfig.num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        # A block is decoded in one forward ([rows, block, vocab] logits) at positions past the prompt:
        # more than MAX_BLOCK_SIZE (training's own limit) or the model's positions is a broken config.
        block_limit = min(MAX_BLOCK_SIZE, int(self.max_position_embeddings))
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) \
                or not 2 <= self.block_size <= block_limit:
            raise ConfigError(f"DFlashConfig.block_size={self.block_size!r} must be an integer in [2, {block_limit}] "
                              f"(at most {MAX_BLOCK_SIZE} and max_position_embeddings; DFlash uses 16)")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ConfigError(f"DFlashConfig.mask_token_id={self.mask_token_id} not in [0, {self.vocab_size})")
        self.target_layer_ids = [int(i) for i in self.target_layer_ids]
        if self.rope_scaling is not None:  # legacy "type" -> "rope_type", so round trips are exact
            scaling = dict(self.rope_scaling)
            scaling.setdefault("rope_type", scaling.pop("type", "default"))
            scaling.pop("type", None)
            self.rope_scaling = None if scaling["rope_type"] == "default" and len(scaling) == 1 else scaling
        if not self.target_layer_ids or not all(0 <= i < self.num_target_layers for i in self.target_layer_ids):
            raise ConfigError(
                f"DFlashConfig.target_layer_ids={self.target_layer_ids} must be non-empty ids in "
                f"[0, {self.num_target_layers})"
            )
        self.layer_types = list(self.layer_types or ["full_attention"] * self.num_hidden_layers)
        if len(self.layer_types) != self.num_hidden_layers or not set(self.layer_types) <= set(LAYER_TYPES):
            raise ConfigError(f"DFlashConfig.layer_types={self.layer_types} must be {self.num_hidden_layers} "
                              f"entries of {', '.join(LAYER_TYPES)}")
        if self.slides:
            if isinstance(self.sliding_window, bool) or not isinstance(self.sliding_window, int) or \
                    self.sliding_window < 1:
                raise ConfigError(f"DFlashConfig.sliding_window={self.sliding_window!r}: a sliding_attention "
                                  f"layer needs an integer window >= 1")
        else:
            self.sliding_window = None  # a window no layer uses is not part of the model

    @property
    def slides(self) -> bool:
        """Whether any layer is sliding_attention."""
        return "sliding_attention" in self.layer_types

    @property
    def num_context_features(self) -> int:
        return len(self.target_layer_ids)

    @classmethod
    def from_target_config(
        cls,
        target_config: Any,
        *,
        num_draft_layers: int = 5,
        block_size: int = 16,
        mask_token_id: int,
        target_layer_ids: list[int] | None = None,
        layer_types: list[str] | None = None,
        sliding_window: int | None = None,
    ) -> "DFlashConfig":
        """A drafter as wide as ``target_config`` (a transformers PretrainedConfig or dict)."""
        cfg = text_config(target_config)  # a multimodal target's text_config
        hidden = int(_cfg_get(cfg, "hidden_size"))
        heads = int(_cfg_get(cfg, "num_attention_heads"))
        num_target_layers = int(_cfg_get(cfg, "num_hidden_layers"))
        theta, scaling = _rope_from_target(cfg)
        head_dim = _cfg_get(cfg, "head_dim")
        kv_heads = _cfg_get(cfg, "num_key_value_heads")
        if target_layer_ids is None:
            target_layer_ids = default_target_layer_ids(num_target_layers, num_draft_layers)
        return cls(
            hidden_size=hidden,
            intermediate_size=int(_cfg_get(cfg, "intermediate_size")),
            num_hidden_layers=num_draft_layers,
            num_attention_heads=heads,
            num_key_value_heads=int(kv_heads if kv_heads is not None else heads),
            head_dim=int(head_dim if head_dim is not None else hidden // heads),
            rms_norm_eps=float(_cfg_get(cfg, "rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=dict(scaling) if scaling else None,
            max_position_embeddings=int(_cfg_get(cfg, "max_position_embeddings", 40960)),
            vocab_size=int(_cfg_get(cfg, "vocab_size")),
            block_size=block_size,
            mask_token_id=mask_token_id,
            target_layer_ids=list(target_layer_ids),
            num_target_layers=num_target_layers,
            layer_types=layer_types,
            sliding_window=sliding_window,
        )

    def rope_parameters(self) -> dict:
        """transformers 5.x ``rope_parameters``: rope_type, rope_theta and any scaling keys."""
        scaling = dict(self.rope_scaling or {})
        rope_type = scaling.pop("rope_type", scaling.pop("type", "default"))
        return {"rope_type": rope_type, "rope_theta": self.rope_theta, **scaling}

    def to_hf_dict(self, *, dtype: str = "bfloat16") -> dict:
        """config.json of the inference checkpoint (z-lab DFlash / SGLang / vLLM format)."""
        n = self.num_hidden_layers
        qwen2_window_layers = qwen2_max_window_layers(self.layer_types)
        return {
            "architectures": [ARCHITECTURE],
            "model_type": "qwen3",
            "block_size": self.block_size,
            "dflash_config": {"mask_token_id": self.mask_token_id, "target_layer_ids": list(self.target_layer_ids)},
            "num_target_layers": self.num_target_layers,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": n,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": dict(self.rope_scaling) if self.rope_scaling else None,
            "rope_parameters": self.rope_parameters(),
            "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab_size,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "tie_word_embeddings": False,
            # Serving reads these (inference_format.py lists where): layer_types per layer and
            # sliding_window (SGLang, vLLM, z-lab); use_sliding_window gates the window in
            # transformers' Qwen3Config, which every loader reads the file through.
            "layer_types": list(self.layer_types),
            "use_sliding_window": self.slides,
            "sliding_window": self.sliding_window,
            "max_window_layers": n if qwen2_window_layers is None else qwen2_window_layers,
            "initializer_range": self.initializer_range,
            "use_cache": True,
            "torch_dtype": dtype,
            "dtype": dtype,
        }

    @classmethod
    def from_hf_dict(cls, d: dict, *, source: str = "config.json") -> "DFlashConfig":
        """Inverse of :meth:`to_hf_dict`; also reads z-lab checkpoints (``source`` names the file)."""
        dflash = d.get("dflash_config") or {}
        if not isinstance(dflash, dict):
            raise ConfigError(f"{source}: dflash_config must be a JSON object, got {dflash!r:.60}")

        def need(key: str, *, nested: bool = False) -> Any:
            value = dflash.get(key, d.get(key)) if nested else d.get(key)
            if value is None:
                where = f"dflash_config.{key} or {key}" if nested else key
                raise ConfigError(f"{source}: missing '{where}'")
            return value

        def integer(key: str, value: Any, *, nested: bool = False) -> int:
            # int() would quietly read "8" as 8, 8.9 as 8 and true as 1: a config.json that says
            # such things was not written by an exporter, so it is refused, naming the field.
            if isinstance(value, bool) or not isinstance(value, int):
                where = f"dflash_config.{key}" if nested and key in dflash else key
                raise ConfigError(f"{source}: {where} must be an integer, got {value!r:.60}")
            return value

        def need_int(key: str, *, nested: bool = False) -> int:
            return integer(key, need(key, nested=nested), nested=nested)

        layer_ids = need("target_layer_ids", nested=True)
        if not isinstance(layer_ids, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in layer_ids):
            raise ConfigError(f"{source}: target_layer_ids must be a list of integers, got {layer_ids!r:.60}")
        theta, scaling = _rope_from_target(d)
        return cls(
            hidden_size=need_int("hidden_size"),
            intermediate_size=need_int("intermediate_size"),
            num_hidden_layers=need_int("num_hidden_layers"),
            num_attention_heads=need_int("num_attention_heads"),
            num_key_value_heads=integer("num_key_value_heads", d.get("num_key_value_heads")
                                        or need("num_attention_heads")),
            head_dim=integer("head_dim", d.get("head_dim") or need_int("hidden_size") // need_int("num_attention_heads")),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=dict(scaling) if scaling else None,
            max_position_embeddings=integer("max_position_embeddings", d.get("max_position_embeddings", 40960)),
            vocab_size=need_int("vocab_size"),
            block_size=need_int("block_size", nested=True),
            mask_token_id=need_int("mask_token_id", nested=True),
            target_layer_ids=layer_ids,
            num_target_layers=need_int("num_target_layers", nested=True),
            initializer_range=float(d.get("initializer_range", 0.02)),
            **_layer_types_from_hf(d, source),
        )




def qwen2_max_window_layers(layer_types: list[str]) -> int | None:
    """The layout in Qwen2's older form, which transformers' Qwen3Config still applies to a
    config without layer_types: layer i slides iff i >= max_window_layers. None when the
    sliding layers are not the last ones (SSSSF), which that form cannot state; the export
    then writes the layer count, as SpecForge does, and layer_types alone decides."""
    first = next((i for i, kind in enumerate(layer_types) if kind == "sliding_attention"), len(layer_types))
    return first if all(kind == "sliding_attention" for kind in layer_types[first:]) else None


def _layer_types_from_hf(d: dict, source: str) -> dict:
    """layer_types and sliding_window of a config.json, with transformers' Qwen3Config gate:
    without use_sliding_window the window is off (a config that names sliding layers and
    turns the window off is refused rather than read as full attention)."""
    layer_types = d.get("layer_types")
    if layer_types is None:
        return {}
    if not isinstance(layer_types, list) or not all(isinstance(t, str) for t in layer_types):
        raise ConfigError(f"{source}: layer_types must be a list of strings, got {layer_types!r:.80}")
    window = d.get("sliding_window")
    if "sliding_attention" in layer_types and not d.get("use_sliding_window", True):
        raise ConfigError(f"{source}: layer_types has sliding_attention layers but use_sliding_window is false")
    return {"layer_types": layer_types,
            "sliding_window": window if "sliding_attention" in layer_types else None}  # __post_init__ checks it


def rope_inv_freq(config: DFlashConfig) -> tuple[Tensor, float]:
    """(inv_freq float32 [head_dim/2], attention_scaling) for the config's RoPE.

    Plain RoPE is computed here exactly as transformers does; scaled variants (linear,
    yarn, llama3, ...) come from transformers' ROPE_INIT_FUNCTIONS, fed a Qwen3Config
    built with the legacy keys that both transformers 4.5x and 5.x accept. Dynamic
    scaling is taken at its initial frequencies (training never exceeds max positions).
    """
    scaling = dict(config.rope_scaling or {})
    rope_type = scaling.get("rope_type", "default")
    if rope_type == "default":
        dim = config.head_dim
        exponent = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
        return 1.0 / (config.rope_theta**exponent), 1.0
    from transformers import Qwen3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ConfigError(f"rope_scaling.rope_type={rope_type!r} not in {sorted(ROPE_INIT_FUNCTIONS)}")
    hf = Qwen3Config(
        hidden_size=config.hidden_size,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        max_position_embeddings=config.max_position_embeddings,
        rope_theta=config.rope_theta,
        rope_scaling=scaling,
    )
    inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](hf, torch.device("cpu"))
    return inv_freq.float(), float(attention_scaling)


class RotaryEmbedding:
    """cos/sin tables for absolute positions (HF "rotate_half" layout).

    Deliberately not an nn.Module with a buffer: ``model.to(bfloat16)`` would round the
    frequencies and spoil positions in the tens of thousands. Kept in float32 per device.
    """

    def __init__(self, config: DFlashConfig) -> None:
        with torch.device("cpu"):  # real numbers even when the model is built on "meta"
            self._inv_freq, self.attention_scaling = rope_inv_freq(config)
        self._per_device: dict[torch.device, Tensor] = {}

    def __call__(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """positions ``[N]`` -> (cos, sin) float32 ``[N, head_dim]``."""
        return rotary_table(positions, self.inv_freq(positions.device), self.attention_scaling)

    def inv_freq(self, device: torch.device) -> Tensor:
        """The float32 inverse frequencies ``[head_dim / 2]`` on ``device`` (copied there once)."""
        inv = self._per_device.get(device)
        if inv is None:
            inv = self._per_device[device] = self._inv_freq.to(device)
        return inv


def rotary_table(positions: Tensor, inv_freq: Tensor, scaling: float) -> tuple[Tensor, Tensor]:
    """(cos, sin) float32 ``[N, D]`` of positions ``[N]`` ("rotate_half" layout)."""
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [N, D/2]
    emb = torch.cat([freqs, freqs], dim=-1)  # [N, D]
    return emb.cos() * scaling, emb.sin() * scaling


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x`` ``[N, heads, D]`` by per-token ``cos``/``sin`` ``[N, D]``."""
    cos = cos[:, None, :].to(x.dtype)
    sin = sin[:, None, :].to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


# --- element-wise parts, fused by torch.compile on CUDA ---------------------------------------
#
# Eagerly, an RMSNorm is ~10 kernels with float32 temporaries, RoPE ~6 more, SwiGLU 2, and
# autograd saves every temporary: at 32,768 queries x 4,096 that is several GB of memory
# traffic per norm. Compiled, each is one kernel forward and one or two backward. The
# math (float32 statistics, the rounding points) is the eager code's; only the row count
# is dynamic, so a new number of queries or context tokens does not recompile.

COMPILE_ENV = "DFLASH_COMPILE"
"""Set to ``0`` to run the element-wise parts eagerly on CUDA too (A/B and debugging)."""


def compile_enabled() -> bool:
    return os.environ.get(COMPILE_ENV, "1") != "0"


class CudaCompiled:
    """``fn`` through ``torch.compile`` (dim 0 of the ``dynamic_args`` tensors dynamic)
    when its first argument is a CUDA tensor and compiling is enabled; eager otherwise
    (CPU: tests stay fast and the eager code is the reference)."""

    def __init__(self, fn: Callable, *, dynamic_args: tuple[int, ...], backend: str = "inductor",
                 dynamic: bool | None = None) -> None:
        self.fn = fn
        self.dynamic_args = dynamic_args
        self.backend = backend
        self.dynamic = dynamic  # torch.compile's: False compiles every shape it sees on its own
        self._compiled: Callable | None = None

    def __call__(self, *args: Any) -> Any:
        if torch.compiler.is_compiling():  # inside the drafter's one graph (drafter.compile): inlined
            return self.fn(*args)
        if args[0].is_cuda and compile_enabled():
            return self.compiled(*args)
        return self.fn(*args)

    def compiled(self, *args: Any) -> Any:
        """The compiled path, on any device (tests call it on CPU)."""
        if self._compiled is None:
            # Not fullgraph: past dynamo's recompile limit that would be an error, this a
            # fall back to eager. The tests check each function traces as one graph.
            self._compiled = torch.compile(self.fn, backend=self.backend, dynamic=self.dynamic)
        for i in self.dynamic_args:  # "maybe": a size 0/1 may still specialise, never an error
            torch._dynamo.maybe_mark_dynamic(args[i], 0)
        return self._compiled(*args)


def _normalize(x: Tensor, eps: float) -> Tensor:
    """x / rms(x) over the last dim, computed in float32, rounded back to x's dtype."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Qwen3 RMSNorm in x's dtype: ``weight * normalize(x)`` (in the promoted dtype, as HF)
    rounded to x's dtype. Under autocast every consumer is a Linear that would round it to
    bf16 anyway; rounding once here saves a cast per consumer (q/k/v, gate/up)."""
    return (weight * _normalize(x, eps)).to(x.dtype)


def rms_norm_rope(x: Tensor, weight: Tensor, eps: float, cos: Tensor, sin: Tensor) -> Tensor:
    """q/k norm then RoPE, ``x`` ``[N, heads, D]``: RoPE runs in the promoted (float32 for
    float32 norm weights) dtype, the result is rounded to x's dtype for the attention."""
    return apply_rope(weight * _normalize(x, eps), cos, sin).to(x.dtype)


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    return F.silu(gate) * up


fused_rms_norm = CudaCompiled(rms_norm, dynamic_args=(0,))
fused_rms_norm_rope = CudaCompiled(rms_norm_rope, dynamic_args=(0, 3, 4))
fused_swiglu = CudaCompiled(swiglu, dynamic_args=(0, 1))


Projection = Callable[[Tensor, tuple[nn.Module, ...]], list[Tensor]]
"""``project(x, layers)``: the outputs of ``layers``, linear layers that read the same ``x``."""


def each_linear(x: Tensor, layers: tuple[nn.Module, ...]) -> list[Tensor]:
    """The default ``project`` of every attention and MLP block: one call per layer. With
    ``drafter.fp8_shared_casts`` one float8 matmul over the layers' concatenated weights takes
    its place, so ``x`` is cast to float8 once (precision.py, ``SharedInputFloat8``)."""
    return [layer(x) for layer in layers]


class RMSNorm(nn.Module):
    """Qwen3 RMSNorm: normalise in float32, scale by ``weight``; returns the input dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return fused_rms_norm(x, self.weight, self.eps)


class DFlashAttention(nn.Module):
    """Block queries over KV = [context; block] with Qwen3 q/k norms, RoPE and GQA."""

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, d
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=False)
        self.q_norm = RMSNorm(d, config.rms_norm_eps)
        self.k_norm = RMSNorm(d, config.rms_norm_eps)
        self.project: Projection = each_linear

    def forward(self, x: Tensor, ctx: Tensor, cos: Tensor, sin: Tensor, mask: Any) -> Tensor:
        """x ``[Q, H]`` (normed block), ctx ``[T, H]``; cos/sin ``[T+Q, D]`` (ctx rows first)."""
        nq, nt = x.shape[0], ctx.shape[0]
        q, k_block, v_block = self.project(x, (self.q_proj, self.k_proj, self.v_proj))
        # Project context and block separately: concatenating the narrow K/V outputs
        # moves less memory than concatenating the H-wide inputs.
        k_ctx, v_ctx = self.project(ctx, (self.k_proj, self.v_proj))
        q = fused_rms_norm_rope(q.view(nq, self.num_heads, self.head_dim), self.q_norm.weight, self.q_norm.eps,
                                cos[nt:], sin[nt:])  # [Q, Hq, D]
        k = torch.cat([k_ctx, k_block]).view(nt + nq, self.num_kv_heads, self.head_dim)
        k = fused_rms_norm_rope(k, self.k_norm.weight, self.k_norm.eps, cos, sin)  # [T+Q, Hkv, D]
        v = torch.cat([v_ctx, v_block]).view(nt + nq, self.num_kv_heads, self.head_dim)
        q, k = q.to(v.dtype), k.to(v.dtype)  # a no-op unless the caller mixes dtypes
        out = attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), mask)  # [Hq, Q, D]
        return self.o_proj(out.transpose(0, 1).reshape(nq, self.num_heads * self.head_dim))


class DFlashMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)
        self.project: Projection = each_linear

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.project(x, (self.gate_proj, self.up_proj))
        return self.down_proj(fused_swiglu(gate, up))


class DFlashDecoderLayer(nn.Module):
    """Pre-norm block: attention with injected context KV, then SwiGLU, both residual."""

    def __init__(self, config: DFlashConfig, layer_type: str = "full_attention") -> None:
        super().__init__()
        self.layer_type = layer_type  # which of the step's masks it takes (attention.build_layer_masks)
        self.self_attn = DFlashAttention(config)
        self.mlp = DFlashMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, h: Tensor, ctx: Tensor, cos: Tensor, sin: Tensor, mask: Any) -> Tensor:
        h = h + self.self_attn(self.input_layernorm(h), ctx, cos, sin, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashDraftModel(nn.Module):
    """The trainable drafter. ``state_dict()`` names are the inference export names."""

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.fc = nn.Linear(config.num_context_features * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, config.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashDecoderLayer(config, kind) for kind in config.layer_types)
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config)
        self.gradient_checkpointing = False
        """Recompute each layer in backward (trades ~1/3 more compute for activation memory)."""
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """Linear weights ~ N(0, initializer_range), norm weights = 1 (HF Qwen3 init)."""
        for module in self.modules():
            if isinstance(module, nn.Linear) and module.weight.device.type != "meta":
                module.weight.normal_(0.0, self.config.initializer_range, generator=generator)
            elif isinstance(module, RMSNorm) and module.weight.device.type != "meta":
                module.weight.fill_(1.0)

    def forward(
        self,
        features: Tensor,
        context_positions: Tensor,
        block_embeds: Tensor,
        block_positions: Tensor,
        mask: Any,
    ) -> Tensor:
        """Drafter hidden states of the block tokens.

        features ``[T_ctx, n_layers*H]`` packed target features; context_positions
        ``[T_ctx]`` long; block_embeds ``[Q, H]`` target embeddings of the block tokens;
        block_positions ``[Q]`` long; mask: ``attention.build_layer_masks``' dict (one mask
        per layer type), or one ``attention.build_mask`` mask for a drafter whose layers are
        all full_attention. Returns ``[Q, H]`` after the final norm, ready for the target's
        LM head.
        """
        masks = self._masks(mask)
        ctx = self.hidden_norm(self.fc(self._input(features)))  # [T_ctx, H]
        cos, sin = self.rotary(torch.cat([context_positions, block_positions]))  # [T_ctx+Q, D]
        h = self._input(block_embeds)  # [Q, H]
        for layer in self.layers:
            layer_mask = masks[layer.layer_type]
            if self.gradient_checkpointing and torch.is_grad_enabled():
                h = checkpoint(layer, h, ctx, cos, sin, layer_mask, use_reentrant=False)
            else:
                h = layer(h, ctx, cos, sin, layer_mask)
        return self.norm(h)

    def _masks(self, mask: Any) -> dict[str, Any]:
        """The mask of each layer type; one plain mask stands for full_attention only, so a
        sliding layer never runs on a mask without its window."""
        if not isinstance(mask, dict):
            mask = {"full_attention": mask}
        missing = sorted(set(self.config.layer_types) - set(mask))
        if missing:
            raise ConfigError(f"drafter layers of type {missing} got no mask (masks for {sorted(mask)}): build "
                              f"them with attention.build_layer_masks(layout, backend, layer_types, sliding_window)")
        return mask

    def _input(self, x: Tensor) -> Tensor:
        """Inputs in the parameter dtype, except under autocast, which casts per op (and
        an upfront float32 copy of bf16 features would cost memory for nothing)."""
        if torch.is_autocast_enabled(x.device.type):
            return x
        return x.to(self.fc.weight.dtype)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def flops_per_step(self, num_ctx: int, num_queries: int, num_visible_keys: float) -> float:
        """Approximate training FLOPs (forward + backward = 3x forward) of the drafter body.

        ``num_visible_keys`` is the mean number of keys a query attends to; the LM head
        and cross-entropy are not included.
        """
        c = self.config
        h, qd, kvd = c.hidden_size, c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        per_query = 2 * (h * qd + 2 * h * kvd + qd * h + 3 * h * c.intermediate_size)
        per_query += 4 * qd * num_visible_keys  # QK^T and PV
        per_ctx = 2 * 2 * h * kvd  # context K and V projections
        fwd = c.num_hidden_layers * (num_queries * per_query + num_ctx * per_ctx)
        fwd += 2 * num_ctx * c.num_context_features * h * h  # fc
        return 3.0 * fwd
