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

A block of at most 16 rows (a block of 16 at batch 1; ``$DFLASH_DECODE_FUSE_LAYER_ROWS`` lowers
the limit for the drafter too) runs each layer as the target's fused decoder layer does
(decode/fused_layer.py's ops): the input norm just before the q|k|v product, q/k norms, rotary
and the block's K/V into the cache in one launch (decode/qk_rope.py), the residual add and the
second norm just before gate|up, silu * up after it, the residual in the down product's
epilogue; the final norm just before the head's product. A context append does k/v norm,
rotary and cache write in that launch too. That is 9 launches a block layer in place of 14 (the
attention's two included) and 2 an append layer in place of 3. Each op rounds where
the drafter's eager forward does, so on CPU (the ops' torch code) the values are the unfused
path's bit for bit; on CUDA the unfused path's compiled functions round less often, so the two
differ in last bits (drafts only: the verify decides what is kept).
``$DFLASH_DECODE_FUSE_DRAFTER``: ``auto`` (the default: a bf16/fp16 drafter where the target's
layers run fused, ``$DFLASH_DECODE_FUSE_LAYER``), ``on`` (any device and dtype: tests) or ``off``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from dflash_ipc.drafter.model import CudaCompiled, DFlashAttention, DFlashDraftModel, fused_rms_norm_rope, rotary_table
from dflash_ipc.hf.target_head import FrozenTargetHead
from dflash_ipc.decode import aranges, decode_attention, fused_layer, matvec
from dflash_ipc.eval import drafter_projections
from dflash_ipc.eval.drafter_projections import FusedProjections, ModuleProjections, layer_projections
from dflash_ipc.decode.ragged_attention import band_mask, gqa_attention
from dflash_ipc.decode.row_cache import MASK_ALIGN, RowKV, round_up


FUSE_DRAFTER_ENV = "DFLASH_DECODE_FUSE_DRAFTER"


def fused_drafter_enabled(device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether a drafter of ``dtype`` and ``head_dim`` on ``device`` runs its blocks through the
    fused ops ($DFLASH_DECODE_FUSE_DRAFTER; see the module). ``auto`` asks for what the kernels
    take too, a half dtype and a head dim that is a power of 2: elsewhere the ops run their
    torch code, slower than the compiled element-wise functions of the unfused path."""
    value = fused_layer.setting(FUSE_DRAFTER_ENV)
    if value == "auto":
        return fused_layer.enabled(device) and dtype in matvec.HALF_DTYPES and head_dim & (head_dim - 1) == 0
    return value == "on"


def drafter_fusable(model: DFlashDraftModel) -> bool:
    """Whether every layer of ``model`` can run fused: projections that concatenate
    (drafter_projections.fusable), q and k norms of one eps (the rotary kernel takes one), every
    norm weight of the projections' dtype (the fused ops keep the activations' dtype)."""
    for layer in model.layers:
        attn = layer.self_attn
        norms = (layer.input_layernorm, layer.post_attention_layernorm, attn.q_norm, attn.k_norm)
        if not (drafter_projections.fusable(layer) and attn.q_norm.eps == attn.k_norm.eps
                and all(n.weight.dtype == attn.q_proj.weight.dtype for n in norms)):
            return False
    return True


def _rotary_rounded(positions: Tensor, inv_freq: Tensor, scaling: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """The rotary table rounded to ``dtype``, as the eager rotation rounds it (drafter/model.py apply_rope)."""
    cos, sin = rotary_table(positions, inv_freq, scaling)
    return cos.to(dtype), sin.to(dtype)


rotary_rounded = CudaCompiled(_rotary_rounded, dynamic_args=(0,))
"""One launch on CUDA in place of the eager table's seven ops and two casts (the fused block and append
take their table so)."""


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
        self.fused = (fused_drafter_enabled(model.fc.weight.device, self.dtype, model.config.head_dim)
                      and drafter_fusable(model))
        """Blocks and context appends of at most ``fused_rows`` rows through the fused ops (module
        docstring)."""
        self.projections: list[ModuleProjections] = layer_projections(model.layers,
                                                                      kernels=self.kernel_linears or self.fused)
        self.rows_limit = matvec.max_rows()
        self.fused_rows = min(self.rows_limit, fused_layer.max_rows())

    def reset(self, num_rows: int, capacity: int) -> None:
        self.kv = RowKV(len(self.model.layers), num_rows, capacity)

    @torch.inference_mode()
    def append(self, rows: Tensor, features: Tensor, write_pos: Tensor, positions: Tensor) -> None:
        """Context K/V of features ``[R, q, F]`` of ``rows`` at ``positions`` ``[R, q]``, stored at
        ``write_pos`` ``[R, q]``."""
        r, q = positions.shape
        m = self.model
        ctx = m.hidden_norm(self._linear(m.fc.weight, features.reshape(r * q, -1).to(self.dtype), m.fc.bias))  # [N, H]
        fused = self._fuses(ctx)
        if fused:
            cos, sin = (t.view(r, q, -1) for t in self._rotary(positions.reshape(-1), ctx.dtype))
        else:
            cos, sin = m.rotary(positions.reshape(-1))
        for i, (layer, proj) in enumerate(zip(m.layers, self.projections)):
            attn = layer.self_attn
            if fused:  # k/v norm, rotary and the cache write: one launch
                keys, values = self.kv.storage(i, attn.num_kv_heads, attn.head_dim, ctx.dtype, ctx.device)
                torch.ops.dflash.qk_rope_write(proj.kv_product(ctx).view(r, q, -1), cos, sin, attn.k_norm.weight,
                                               attn.k_norm.weight, attn.k_norm.eps, keys, values, rows, write_pos, 0,
                                               attn.num_kv_heads)
                continue
            k, v = project_kv(attn, *proj.kv(ctx), cos, sin)
            self.kv.write(i, rows, write_pos, k.view(r, q, *k.shape[1:]), v.view(r, q, *v.shape[1:]))

    def _rotary(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """(cos, sin) ``[N, D]`` of positions ``[N]`` in ``dtype``: the fused ops' table."""
        rotary = self.model.rotary
        return rotary_rounded(positions, rotary.inv_freq(positions.device), rotary.attention_scaling, dtype)

    def _fuses(self, x: Tensor) -> bool:
        """Whether rows ``x`` ``[N, H]`` run through the fused ops: at most ``fused_rows`` of them."""
        return self.fused and x.shape[0] <= self.fused_rows

    @torch.inference_mode()
    def draft_hidden(self, anchors: Tensor, starts: Tensor, max_start: int) -> Tensor:
        """Drafter output ``[B, bs, H]`` for every row's block; anchors/starts ``[B]`` (long),
        ``max_start`` their host-side maximum."""
        h = self._residual(anchors, starts, max_start)
        return self.model.norm(h).view(anchors.shape[0], self.block_size, -1)

    def _residual(self, anchors: Tensor, starts: Tensor, max_start: int) -> Tensor:
        """The residual stream ``[B * bs, H]`` after the last layer (before the final norm)."""
        m, bs = self.model, self.block_size
        b, n = anchors.shape[0], anchors.shape[0] * bs
        block_ids = torch.full((b, bs), self.mask_token_id, dtype=torch.long, device=anchors.device)
        block_ids[:, 0] = anchors
        positions = starts[:, None] + aranges.arange(bs, anchors.device)  # [B, bs]
        span = round_up(max_start + bs, MASK_ALIGN)
        masks = self._layer_masks(positions, span)
        rows = aranges.arange(b, anchors.device)
        h = self.head.embed(block_ids).reshape(n, -1).to(self.dtype)  # [N, H]
        fused = self._fuses(h)
        if fused:
            cos, sin = (t.view(b, bs, -1) for t in self._rotary(positions.reshape(-1), h.dtype))
        else:
            cos, sin = m.rotary(positions.reshape(-1))
        for i, (layer, proj) in enumerate(zip(m.layers, self.projections)):
            mask = masks[layer.layer_type]
            if fused:
                h = self._fused_layer(i, layer, proj, h, cos, sin, rows, positions, span, mask)
                continue
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            q, k, v = proj.qkv(x)
            q = fused_rms_norm_rope(q.reshape(n, attn.num_heads, attn.head_dim), attn.q_norm.weight, attn.q_norm.eps,
                                    cos, sin)
            k, v = project_kv(attn, k, v, cos, sin)
            self.kv.write(i, rows, positions, k.view(b, bs, *k.shape[1:]), v.view(b, bs, *v.shape[1:]))
            out = self._attend(i, q.view(b, bs, *q.shape[1:]).transpose(1, 2), span, mask)
            h = h + proj.o(out.reshape(n, -1))
            h = h + proj.mlp_forward(layer.post_attention_layernorm(h))
        return h

    def _fused_layer(self, i: int, layer, proj: FusedProjections, h: Tensor, cos: Tensor, sin: Tensor, rows: Tensor,
                     positions: Tensor, span: int, mask: Tensor) -> Tensor:
        """One layer of the block ``h`` ``[N, H]`` through the fused ops (module docstring); cos/sin
        ``[B, bs, D]`` in h's dtype (the eager rotary rounds them so)."""
        attn, norm1, norm2 = layer.self_attn, layer.input_layernorm, layer.post_attention_layernorm
        b, bs = positions.shape
        qkv = torch.ops.dflash.norm_linear(h, norm1.weight, norm1.eps, proj.w_qkv, None, self.fused_rows)
        keys, values = self.kv.storage(i, attn.num_kv_heads, attn.head_dim, h.dtype, h.device)
        q4 = torch.ops.dflash.qk_rope_write(qkv.view(b, bs, -1), cos, sin, attn.q_norm.weight, attn.k_norm.weight,
                                            attn.q_norm.eps, keys, values, rows, positions, attn.num_heads,
                                            attn.num_kv_heads)  # [B, Hq, bs, D]
        out = proj.o(self._attend(i, q4, span, mask).reshape(h.shape[0], -1))
        act, h = torch.ops.dflash.add_norm_glu(out, h, norm2.weight, norm2.eps, proj.w_gate_up, self.fused_rows)
        return torch.ops.dflash.linear_add(act, proj.mlp.down_proj.weight, h, self.fused_rows)

    def _attend(self, i: int, q4: Tensor, span: int, mask: Tensor) -> Tensor:
        """Layer ``i``'s attention of the block's queries ``[B, Hq, bs, D]`` over the first ``span``
        cached keys -> ``[B, bs, Hq, D]``."""
        keys, values = self.kv.view(i, span)
        if self.kernel_attention and q4.is_cuda and decode_attention.fits(q4, keys, values, mask):
            return torch.ops.dflash.decode_attention(q4, keys, values, mask, q4.shape[-1] ** -0.5)
        return gqa_attention(q4, keys, values, mask).transpose(1, 2)

    def _layer_masks(self, positions: Tensor, span: int) -> dict[str, Tensor]:
        """``[B, 1, bs, span]`` band mask of each layer type; positions ``[B, bs]``."""
        b, bs = positions.shape
        masks = {"full_attention": band_mask(None, positions[:, -1:].expand(b, bs) + 1, span)}
        window = self.model.config.sliding_window
        if window is not None:  # keys from position - window + 1 (at least 0) on
            masks["sliding_attention"] = band_mask(None, positions + 1, span, window=window)
        return masks

    @torch.inference_mode()
    def draft_logits(self, anchors: Tensor, starts: Tensor, max_start: int) -> Tensor:
        """``[B, bs-1, V]``: the drafter's logits for positions s+1 .. s+bs-1."""
        b, bs, weight, norm = anchors.shape[0], self.block_size, self.head.lm_head_weight, self.model.norm
        h = self._residual(anchors, starts, max_start)
        if self._fuses(h) and h.dtype == weight.dtype == norm.weight.dtype:  # the final norm just before the head
            hidden = h.view(b, bs, -1)[:, 1:].reshape(b * (bs - 1), -1)
            logits = torch.ops.dflash.norm_linear(hidden, norm.weight, norm.eps, weight, None, self.fused_rows)
            return logits.view(b, bs - 1, -1)
        hidden = norm(h).view(b, bs, -1)[:, 1:]
        logits = self._linear(weight, hidden.reshape(-1, hidden.shape[-1]).to(weight.dtype))
        return logits.view(*hidden.shape[:2], -1)

    def _linear(self, weight: Tensor, x: Tensor, bias: Tensor | None = None) -> Tensor:
        return (matvec.decode_linear(x, weight, bias, self.rows_limit) if self.kernel_linears
                else F.linear(x, weight, bias))
