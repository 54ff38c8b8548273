"""A decoder layer's few-row step as four fused ops that carry the layer's small ops.

At batch 1 a compiled decode layer (decode/compiled.py) runs its products through
decode/matvec.py's kernels and, between them, Inductor's fused element-wise kernels: the input
norm, q/k norms and rotary, the two cache writes, the residual add and the second norm, silu *
up, the last residual add. Each is a launch of its own that reads a few kilobytes
(docs/benchmarks.md, "Batch 1": eight per layer at the Qwen3-1.7B shape, 0.31 ms of a 1.9-ms
step, plus the time between launches). Here they run inside other launches (for 2..16 rows the
input norm and the add and norm before gate|up run in one short launch each, just before their
product: decode/matvec.py ``_rows_norm_kernel``):

    q|k|v    = norm_linear(x)                     the input norm in the product's prologue
    query    = qk_rope_write(q|k|v)               q/k norms, rotary, k and v into the cache (qk_rope.py)
    attn     = o_proj(attention(query, cache))    the target's attention function and o_proj, as unfused
    act, h   = add_norm_glu(attn, x)              h = x + attn, its norm, then silu(gate) * up
    out      = linear_add(act, down) + h          the residual in the down product's epilogue

The ops are custom ops, opaque to torch.compile like ``dflash::matvec_linear``; on CUDA they
run the kernels for up to ``rows_limit`` rows, elsewhere (and for more rows) the eager layer's
own torch ops, op for op, so on CPU the fused layer gives the unfused layer's output bit for
bit (tests/test_decode_fused_layer.py).

Which layers: the Llama family, whose layer forward, attention forward, RMS norm and gated MLP
are the same code in transformers (LAYERS, ATTENTIONS, NORMS, MLPS), loaded with our attention
function (decode/ragged_attention.py), with both projection groups fused, no MLP bias and a
SiLU gate. Others keep the compiled layer as it is. ``$DFLASH_DECODE_FUSE_LAYER``: ``auto``
(the default: CUDA targets whose products run the kernels), ``on`` (any device; CPU runs the
torch ops: tests) or ``off``.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import Tensor

from dflash_ipc.decode import matvec, ragged_attention
from dflash_ipc.decode import qk_rope  # noqa: F401 - registers dflash::qk_rope_write
from dflash_ipc.decode.fused_projections import FusedMember
from dflash_ipc.errors import ConfigError

FUSE_LAYER_ENV = "DFLASH_DECODE_FUSE_LAYER"
SETTINGS = ("auto", "on", "off")
ROWS_ENV = "DFLASH_DECODE_FUSE_LAYER_ROWS"
"""The most rows a step runs fused (1..16; default 16, the kernels' own limit): 1 keeps verify
passes and drafted blocks on the unfused compiled layer."""
LAYERS = ("LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer")
"""Decoder layers whose forward is norm -> attention -> + residual -> norm -> MLP -> + residual."""
ATTENTIONS = ("LlamaAttention", "MistralAttention", "Qwen2Attention", "Qwen3Attention")
"""Attention forwards: q|k|v as heads, (Qwen3: q/k RMS norms,) rotary from the layer's
``position_embeddings``, the cache's update, the attention function, o_proj."""
NORMS = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm")
"""RMS norms computed as :func:`rms_norm` does (fp32 mean of squares; weight times the cast result)."""
MLPS = ("LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP")
"""MLPs computed as down(act(gate(x)) * up(x))."""
SILU = ("SiLU", "SiLUActivation")


def setting(env: str) -> str:
    """The value of switch ``$env`` (SETTINGS; unset: auto), ConfigError for another."""
    value = os.environ.get(env) or "auto"
    if value not in SETTINGS:
        raise ConfigError(f"${env}={value!r}; allowed: {list(SETTINGS)}")
    return value


def enabled(device) -> bool:
    """Whether decode layers on ``device`` run fused ($DFLASH_DECODE_FUSE_LAYER; see the module)."""
    value = setting(FUSE_LAYER_ENV)
    if value == "auto":
        return matvec.enabled(device)
    return value == "on"


def max_rows() -> int:
    """``$DFLASH_DECODE_FUSE_LAYER_ROWS``, else matvec.MAX_ROWS (the kernels' limit)."""
    text = os.environ.get(ROWS_ENV) or str(matvec.MAX_ROWS)
    if not text.isdigit() or not 1 <= int(text) <= matvec.MAX_ROWS:
        raise ConfigError(f"${ROWS_ENV}={text!r}; allowed: an integer from 1 to {matvec.MAX_ROWS}")
    return int(text)


def _group(*members) -> object | None:
    """The FusedGroup that ``members`` are, in order, all of; else None."""
    if not all(isinstance(m, FusedMember) for m in members):
        return None
    group = members[0].group
    if any(m.group is not group or m.index != i for i, m in enumerate(members)) or len(group.bounds) != len(members):
        return None
    return group


def fusable(layer) -> bool:
    """Whether ``layer`` can run :func:`fused_forward`: a LAYERS layer with NORMS norms, an
    ATTENTIONS attention over our attention function with its q|k|v fused in head order, a
    gate|up fused of two equal halves, no MLP bias, a SiLU gate."""
    if type(layer).__name__ not in LAYERS:
        return False
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    norms = [getattr(layer, "input_layernorm", None), getattr(layer, "post_attention_layernorm", None)]
    if type(attn).__name__ not in ATTENTIONS or type(mlp).__name__ not in MLPS:
        return False
    if (getattr(attn.config, "_attn_implementation", None) != ragged_attention.ATTN_IMPLEMENTATION
            or not isinstance(getattr(attn, "o_proj", None), torch.nn.Linear)):
        return False
    if hasattr(attn, "q_norm") or hasattr(attn, "k_norm"):
        norms += [getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)]
    if not all(type(n).__name__ in NORMS and hasattr(n, "variance_epsilon") for n in norms):
        return False
    qkv = _group(*(getattr(attn, name, None) for name in ("q_proj", "k_proj", "v_proj")))
    gate_up = _group(getattr(mlp, "gate_proj", None), getattr(mlp, "up_proj", None))
    down = getattr(mlp, "down_proj", None)  # its weight is read as it is: no quantized linear
    if qkv is None or gate_up is None or type(down) not in (torch.nn.Linear, matvec.MatVecLinear):
        return False
    if down.bias is not None:
        return False
    if len(norms) == 4 and norms[2].variance_epsilon != norms[3].variance_epsilon:  # one eps for both in the kernel
        return False
    d, (hq, hkv) = attn.head_dim, heads(attn)
    if [hi - lo for lo, hi in qkv.bounds] != [hq * d, hkv * d, hkv * d]:
        return False
    (g0, g1), (u0, u1) = gate_up.bounds
    return (gate_up.bias is None and g1 - g0 == u1 - u0 and type(getattr(mlp, "act_fn", None)).__name__ in SILU
            and down.in_features == g1 - g0)


def heads(attn) -> tuple[int, int]:
    """(query heads, K/V heads) of an ATTENTIONS module."""
    config = attn.config
    return config.num_attention_heads, getattr(config, "num_key_value_heads", None) or config.num_attention_heads


def fused_forward(layer, kv, hidden_states: Tensor, *, attention_mask=None, position_embeddings=None,
                  **kwargs) -> Tensor:
    """``layer``'s forward (a :func:`fusable` one; keywords as its model passes them, the cache's
    left out) over ``kv``, decode/compiled.py's LayerKV of its cache storage, through the ops
    of the module docstring."""
    attn, mlp = layer.self_attn, layer.mlp
    norm1, norm2 = layer.input_layernorm, layer.post_attention_layernorm
    qkv, gate_up = attn.q_proj.group, mlp.gate_proj.group
    b, q = hidden_states.shape[:2]
    products = torch.ops.dflash.norm_linear(hidden_states, norm1.weight, norm1.variance_epsilon, qkv.weight, qkv.bias,
                                            qkv.rows_limit)
    q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
    num_heads, num_kv_heads = heads(attn)
    cos, sin = position_embeddings
    query = torch.ops.dflash.qk_rope_write(products, cos, sin, None if q_norm is None else q_norm.weight,
                                           None if k_norm is None else k_norm.weight,
                                           0.0 if q_norm is None else q_norm.variance_epsilon, kv.keys, kv.values,
                                           kv.rows, kv.pos, num_heads, num_kv_heads)
    keys, values = kv.view()
    out, _ = ragged_attention.hf_attention(attn, query, keys, values, attention_mask, dropout=0.0,
                                           scaling=attn.scaling, **kwargs)
    out = attn.o_proj(out.reshape(b, q, -1))
    act, h = torch.ops.dflash.add_norm_glu(out, hidden_states, norm2.weight, norm2.variance_epsilon, gate_up.weight,
                                           gate_up.rows_limit)
    return torch.ops.dflash.linear_add(act, mlp.down_proj.weight, h, gate_up.rows_limit)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Llama's RMSNorm, op for op (NORMS): what the kernels' NORM prologue computes."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _kernel_rows(x: Tensor, weight: Tensor, rows_limit: int) -> bool:
    return matvec.available() and matvec.takes(x, weight, min(rows_limit, matvec.MAX_ROWS))


def _launch(x: Tensor, weight: Tensor, bias: Tensor | None = None, **fusion) -> Tensor:
    if x.numel() == x.shape[-1]:
        return matvec.triton_matvec(x, weight, bias, **fusion)
    return matvec.triton_rows(x, weight, bias, **fusion)


@torch.library.custom_op("dflash::norm_linear", mutates_args=())
def norm_linear(x: Tensor, norm_weight: Tensor, eps: float, weight: Tensor, bias: Tensor | None,
                rows_limit: int) -> Tensor:
    """``F.linear(rms_norm(x), weight, bias)``: the kernels' NORM prologue where they take x's rows."""
    if _kernel_rows(x, weight, rows_limit) and norm_weight.dtype == x.dtype:
        return _launch(x, weight, bias, norm=norm_weight.contiguous(), eps=eps)
    return F.linear(rms_norm(x, norm_weight, eps), weight, bias)


@norm_linear.register_fake
def _norm_linear_shape(x, norm_weight, eps, weight, bias, rows_limit):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@torch.library.custom_op("dflash::add_norm_glu", mutates_args=())
def add_norm_glu(a: Tensor, residual: Tensor, norm_weight: Tensor, eps: float, weight: Tensor,
                 rows_limit: int) -> tuple[Tensor, Tensor]:
    """h = residual + a; gate|up = F.linear(rms_norm(h), weight) (gate rows over up rows) ->
    (silu(gate) * up, h): the kernels' ADD and NORM prologue and GLU epilogue where they take
    the rows."""
    if _kernel_rows(a, weight, rows_limit) and norm_weight.dtype == a.dtype == residual.dtype:
        a, residual = a.contiguous(), residual.contiguous()
        h = torch.empty_like(residual)
        act = _launch(a, weight, add=residual, norm=norm_weight.contiguous(), eps=eps, h=h, glu=True)
        return act, h
    h = residual + a
    gate, up = F.linear(rms_norm(h, norm_weight, eps), weight).chunk(2, dim=-1)
    return F.silu(gate) * up, h


@add_norm_glu.register_fake
def _add_norm_glu_shape(a, residual, norm_weight, eps, weight, rows_limit):
    return a.new_empty((*a.shape[:-1], weight.shape[0] // 2)), torch.empty_like(residual)


@torch.library.custom_op("dflash::linear_add", mutates_args=())
def linear_add(x: Tensor, weight: Tensor, residual: Tensor, rows_limit: int) -> Tensor:
    """``residual + F.linear(x, weight)``: the kernels' RESIDUAL epilogue where they take x's rows."""
    if _kernel_rows(x, weight, rows_limit) and residual.dtype == x.dtype:
        return _launch(x, weight, residual=residual.contiguous())
    return residual + F.linear(x, weight)


@linear_add.register_fake
def _linear_add_shape(x, weight, residual, rows_limit):
    return torch.empty_like(residual)
