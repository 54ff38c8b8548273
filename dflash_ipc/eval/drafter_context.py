"""The DFlash drafter at inference: context K/V cached per row, one block drafted per row.

KV injection (drafter/model.py) gives every drafter layer the keys and values
``[proj(ctx); proj(block)]``, and a context row's K/V depend only on that row's target
features and its position (``k = rope(k_norm(k_proj(hidden_norm(fc(f)))))``, ``v =
v_proj(...)``, no input norm). So they are computed once, when the target has produced
the features of a committed position, and kept in a :class:`RowKV` per row:

    append(rows, features, positions)   project new context positions into the cache
    draft(anchors, starts)              every row's block [anchor, MASK x (bs-1)] at
                                        positions s..s+bs-1, s = its anchor's position;
                                        queries see context < s and their whole block

The block's own K/V are written to the cache at s..s+bs-1 (the verified context K/V
overwrite them after the target's pass), so one mask ``t < s + bs`` covers both parts and
nothing is concatenated. A sliding_attention layer (window w) takes the band
``i - w < t <= i`` of its query at position i instead: causal and windowed, attention.py's
rule (cache index = position: a row's cache holds position t at index t). This is DFlashAttention.forward's math on cached context
(tests/test_eval_batched.py checks the two agree); the module's parameters are used as
they are, so any drafter checkpoint works. On CUDA (``$DFLASH_DECODE_GEMV`` not off) each
layer's products run fused through decode/matvec.py's few-row kernels (drafter_projections.py)
and so does the head.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from dflash_ipc.drafter.model import DFlashAttention, DFlashDraftModel, fused_rms_norm_rope
from dflash_ipc.hf.target_head import FrozenTargetHead
from dflash_ipc.decode import decode_attention, matvec
from dflash_ipc.eval.drafter_projections import ModuleProjections, layer_projections
from dflash_ipc.decode.ragged_attention import band_mask, gqa_attention
from dflash_ipc.decode.row_cache import MASK_ALIGN, RowKV, round_up


def project_kv(attn: DFlashAttention, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """K (k_norm + RoPE) and V ``[N, Hkv, D]`` of projected rows k, v ``[N, Hkv*D]`` at cos/sin ``[N, D]``."""
    n = k.shape[0]
    k = fused_rms_norm_rope(k.reshape(n, attn.num_kv_heads, attn.head_dim), attn.k_norm.weight, attn.k_norm.eps,
                            cos, sin)
    return k, v.reshape(n, attn.num_kv_heads, attn.head_dim)


class DrafterContext:
    """A drafter and its per-row context cache; ``reset`` before each batch of sequences."""

    def __init__(self, model: DFlashDraftModel, head: FrozenTargetHead) -> None:
        self.model = model.eval()
        self.head = head
        self.block_size = model.config.block_size
        self.mask_token_id = model.config.mask_token_id
        self.dtype = model.fc.weight.dtype
        self.kv: RowKV | None = None
        self.kernel_attention = decode_attention.enabled(model.fc.weight.device)
        """The block's attention through decode/decode_attention.py's kernel (on CUDA, where its
        shapes and dtypes fit), else SDPA."""
        self.kernel_linears = matvec.enabled(model.fc.weight.device)
        """fc and the head through decode/matvec.py's kernels, each layer's products fused through
        them (on CUDA, where the rows fit), else the modules themselves."""
        self.projections: list[ModuleProjections] = layer_projections(model.layers, kernels=self.kernel_linears)
        self.rows_limit = matvec.max_rows()

    def reset(self, num_rows: int, capacity: int) -> None:
        self.kv = RowKV(len(self.model.layers), num_rows, capacity)

    @torch.inference_mode()
    def append(self, rows: Tensor, features: Tensor, write_pos: Tensor, positions: Tensor) -> None:
        """Context K/V of features ``[R, q, F]`` of ``rows`` at ``positions`` ``[R, q]``, stored at
        ``write_pos`` ``[R, q]``."""
        r, q = positions.shape
        m = self.model
        ctx = m.hidden_norm(self._linear(m.fc.weight, features.reshape(r * q, -1).to(self.dtype), m.fc.bias))  # [N, H]
        cos, sin = m.rotary(positions.reshape(-1))
        for i, (layer, proj) in enumerate(zip(m.layers, self.projections)):
            k, v = project_kv(layer.self_attn, *proj.kv(ctx), cos, sin)
            self.kv.write(i, rows, write_pos, k.view(r, q, *k.shape[1:]), v.view(r, q, *v.shape[1:]))

    @torch.inference_mode()
    def draft_hidden(self, anchors: Tensor, starts: Tensor, max_start: int) -> Tensor:
        """Drafter output ``[B, bs, H]`` for every row's block; anchors/starts ``[B]`` (long),
        ``max_start`` their host-side maximum."""
        m, bs = self.model, self.block_size
        b, n = anchors.shape[0], anchors.shape[0] * bs
        block_ids = torch.full((b, bs), self.mask_token_id, dtype=torch.long, device=anchors.device)
        block_ids[:, 0] = anchors
        positions = starts[:, None] + torch.arange(bs, device=anchors.device)  # [B, bs]
        span = round_up(max_start + bs, MASK_ALIGN)
        masks = self._layer_masks(positions, span)
        cos, sin = m.rotary(positions.reshape(-1))
        rows = torch.arange(b, device=anchors.device)
        h = self.head.embed(block_ids).reshape(n, -1).to(self.dtype)  # [N, H]
        for i, (layer, proj) in enumerate(zip(m.layers, self.projections)):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            q, k, v = proj.qkv(x)
            q = fused_rms_norm_rope(q.reshape(n, attn.num_heads, attn.head_dim), attn.q_norm.weight, attn.q_norm.eps,
                                    cos, sin)
            k, v = project_kv(attn, k, v, cos, sin)
            self.kv.write(i, rows, positions, k.view(b, bs, *k.shape[1:]), v.view(b, bs, *v.shape[1:]))
            keys, values = self.kv.view(i, span)
            q4, mask = q.view(b, bs, *q.shape[1:]).transpose(1, 2), masks[layer.layer_type]
            if self.kernel_attention and q4.is_cuda and decode_attention.fits(q4, keys, values, mask):
                out = torch.ops.dflash.decode_attention(q4, keys, values, mask, q.shape[-1] ** -0.5)  # [B, bs, Hq, D]
            else:
                out = gqa_attention(q4, keys, values, mask).transpose(1, 2)
            h = h + proj.o(out.reshape(n, -1))
            h = h + proj.mlp_forward(layer.post_attention_layernorm(h))
        return m.norm(h).view(b, bs, -1)

    def _layer_masks(self, positions: Tensor, span: int) -> dict[str, Tensor]:
        """``[B, 1, bs, span]`` band mask of each layer type; positions ``[B, bs]``."""
        b, bs = positions.shape
        masks = {"full_attention": band_mask(torch.zeros_like(positions), positions[:, -1:].expand(b, bs) + 1, span)}
        window = self.model.config.sliding_window
        if window is not None:
            masks["sliding_attention"] = band_mask((positions - window + 1).clamp_min(0), positions + 1, span)
        return masks

    @torch.inference_mode()
    def draft_logits(self, anchors: Tensor, starts: Tensor, max_start: int) -> Tensor:
        """``[B, bs-1, V]``: the drafter's logits for positions s+1 .. s+bs-1."""
        hidden = self.draft_hidden(anchors, starts, max_start)[:, 1:]
        weight = self.head.lm_head_weight
        logits = self._linear(weight, hidden.reshape(-1, hidden.shape[-1]).to(weight.dtype))
        return logits.view(*hidden.shape[:2], -1)

    def _linear(self, weight: Tensor, x: Tensor, bias: Tensor | None = None) -> Tensor:
        return (matvec.decode_linear(x, weight, bias, self.rows_limit) if self.kernel_linears
                else F.linear(x, weight, bias))
