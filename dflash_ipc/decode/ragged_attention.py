"""Attention over per-row caches: band masks, and grouped-query attention without copies.

Every sequence of a batch sits at its own length, so a query sees the keys of an index band
``lo <= t < hi`` of its own row (``hi`` = its position + 1 for a causal target, ``anchor +
block_size`` for the drafter's block, ``lo`` > 0 only for left padding or a sliding
window). One boolean ``[B, 1, q, T]`` mask per forward expresses all of it.

transformers' SDPA path copies K and V to every query head (``repeat_kv``) whenever a mask
is given and more than one token is queried, which for a 16-token verify over a long
batched cache moves more memory than the weights. :func:`gqa_attention` instead folds the
query heads that share a K/V head into the query length (``[B, Hkv, rep*q, D]``, the
single-token ``pack_gqa`` of transformers, for any q), so no K/V byte is copied. It is
registered with transformers as :data:`ATTN_IMPLEMENTATION`. On a GPU, the decode steps and
verify passes of the attention modules a BatchedTarget marks take decode_attention.py's kernel
instead (a few queries per row, each row's keys read up to its own length).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import Tensor

from dflash_ipc.decode import band_mask as band_mask_kernel
from dflash_ipc.decode import decode_attention
from dflash_ipc.errors import ConfigError

logger = logging.getLogger(__name__)

ATTN_IMPLEMENTATION = "ragged_packed_gqa"  # no "flash" in the name: transformers would look for a kernel
MASKED_LAYER_TYPES = ("full_attention", "sliding_attention")


def band_mask(lo: Tensor | None, hi: Tensor, length: int, window: int | None = None) -> Tensor:
    """``[B, 1, q, length]`` bool: key t visible to query (b, i) iff ``lo[b, i] <= t < hi[b, i]``
    (``lo`` None: 0) and, with a ``window``, ``t >= hi[b, i] - window``. On CUDA one launch
    (band_mask.py)."""
    if band_mask_kernel.takes(lo, hi):
        return band_mask_kernel.triton_band_mask(lo, hi, length, window)
    if lo is None:
        lo = torch.zeros_like(hi)
    if window is not None:
        lo = torch.maximum(lo, hi - window)
    t = torch.arange(length, device=hi.device)
    return ((t >= lo[..., None]) & (t < hi[..., None]))[:, None]


def layer_masks(layer_types: list[str], sliding_window: int | None, lo: Tensor | None, hi: Tensor,
                length: int) -> dict[str, Tensor]:
    """The mask of every layer type a model has, as transformers takes a prepared mapping
    (``lo`` None: every row from key 0)."""
    masks = {}
    for kind in dict.fromkeys(layer_types):
        if kind == "full_attention":
            masks[kind] = band_mask(lo, hi, length)
        elif kind == "sliding_attention" and sliding_window:
            masks[kind] = band_mask(lo, hi, length, window=sliding_window)
        else:
            raise ConfigError(f"target layer type {kind!r} (sliding_window={sliding_window}) is not supported by "
                              f"batched evaluation; supported: {list(MASKED_LAYER_TYPES)} (sliding with a window)")
    return masks


def gqa_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float | None = None) -> Tensor:
    """q ``[B, Hq, q, D]``, k/v ``[B, Hkv, T, D]``, mask ``[B, 1, q, T]`` -> ``[B, Hq, q, D]``.

    Query head h uses K/V head ``h // rep`` (transformers' ``repeat_kv`` order).
    """
    b, hq, nq, d = q.shape
    hkv, length = k.shape[1], k.shape[2]
    rep = hq // hkv
    if rep > 1:
        q = q.reshape(b, hkv, rep * nq, d)
        mask = mask[:, :, None].expand(b, 1, rep, nq, length).reshape(b, 1, rep * nq, length)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return out.reshape(b, hq, nq, v.shape[-1])


def hf_attention(module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                 dropout: float = 0.0, scaling: float | None = None, **kwargs) -> tuple[Tensor, None]:
    """transformers attention interface: ``[B, q, Hq, D]`` output, no weights."""
    if attention_mask is None or attention_mask.dtype != torch.bool:
        # Not one of our band masks (a plain forward of the same model): transformers' own SDPA.
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    mask = attention_mask[..., : key.shape[-2]]
    softcap, sinks = kwargs.get("softcap"), kwargs.get("s_aux")
    if softcap is not None or sinks is not None:  # Gemma 2 style softcapping, gpt-oss sinks
        out = explicit_attention(query, key, value, mask, scaling, softcap=softcap, sinks=sinks)
    elif decode_attention.applies(module, query, key, value, mask):  # a decode step or verify pass on a GPU
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        return torch.ops.dflash.decode_attention(query, key, value, mask, float(scale)), None
    else:
        out = gqa_attention(query, key, value, mask, scaling)
    return out.transpose(1, 2).contiguous(), None


def explicit_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float | None, *,
                       softcap: float | None = None, sinks: Tensor | None = None) -> Tensor:
    """The eager attention math of models SDPA cannot express, on our band masks: scores
    softcapped (``tanh(s / c) * c``), and per-head sink logits that take part in the softmax
    and are then dropped (gpt-oss), as transformers' own eager functions compute them."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * (scale if scale is not None else q.shape[-1] ** -0.5)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    if sinks is not None:
        sink = sinks.reshape(1, -1, 1, 1).expand(scores.shape[0], -1, scores.shape[2], 1).to(scores.dtype)
        scores = torch.cat([scores, sink], dim=-1)
        scores = scores - scores.max(dim=-1, keepdim=True).values
        probs = torch.softmax(scores, dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs.to(v.dtype), v)


def register_attention() -> str:
    """Register :func:`hf_attention`; the ``attn_implementation`` to load targets with."""
    try:
        from transformers import AttentionInterface
    except ImportError:  # pragma: no cover - transformers too old for custom attention
        logger.warning("transformers has no AttentionInterface; batched evaluation falls back to sdpa")
        return "sdpa"
    AttentionInterface.register(ATTN_IMPLEMENTATION, hf_attention)
    try:  # plain forwards of the same model (no masks of ours) then get sdpa's masks, sliding windows included
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
        AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)
    except ImportError:  # pragma: no cover - masking_utils predates AttentionMaskInterface
        pass
    return ATTN_IMPLEMENTATION
