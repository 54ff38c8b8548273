"""The drafter's linear layers at inference: its modules, or fused products through the decode kernels.

A drafted block at batch 1 is 16 rows, and at that size each product is bound by its launch
and its weight read: a Qwen3-1.7B-shaped drafter layer's k and v weights are 4 MB each, read
in about as long as its 8-MB q weight (docs/benchmarks.md, "Batch 1: a matrix-vector kernel,
fused projections"). :class:`FusedProjections` runs each layer as four products over weights
that are concatenated once: q|k|v of the block (k|v of the context rows: the rows at the end
of the same weight), o, gate|up and down, each through decode/matvec.py's kernels where they
take the rows (``matvec.decode_linear``). The concatenation is done in place: each module's
weight becomes a view of its group's tensor (``param.data``), so the model keeps its
parameters, their values and their memory. :class:`ModuleProjections` calls the modules
themselves: the reference, and what CPU runs.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from dflash_ipc.decode import matvec
from dflash_ipc.drafter.model import DFlashAttention, DFlashDecoderLayer, fused_swiglu


class ModuleProjections:
    """One drafter layer's products by its own modules."""

    def __init__(self, layer: DFlashDecoderLayer) -> None:
        self.attn, self.mlp = layer.self_attn, layer.mlp

    def qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``[N, Hq*D]``, ``[N, Hkv*D]``, ``[N, Hkv*D]`` of the block's rows ``x`` ``[N, H]``."""
        return self.attn.q_proj(x), *self.kv(x)

    def kv(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """k and v of rows ``x`` (the context's, which need no q)."""
        return self.attn.k_proj(x), self.attn.v_proj(x)

    def o(self, x: Tensor) -> Tensor:
        return self.attn.o_proj(x)

    def mlp_forward(self, x: Tensor) -> Tensor:
        return self.mlp(x)


def _concatenate_in_place(owner: nn.Module, name: str, linears: list[nn.Linear]) -> Tensor:
    """One tensor ``[sum N_i, K]`` holding the weights of ``linears``, each module's weight made
    a view of its rows (same Parameter, same values); kept on ``owner`` as ``name`` (a plain
    attribute: no state_dict entry), so a second context over the same model reuses it while
    the weights are still its views (they stop being after ``model.to(...)`` moves them)."""
    whole = getattr(owner, name, None)
    if whole is not None and _views_of(whole, linears):
        return whole
    whole = torch.cat([m.weight.detach() for m in linears])
    start = 0
    for m in linears:
        rows = m.weight.shape[0]
        m.weight.data = whole[start:start + rows]
        start += rows
    setattr(owner, name, whole)
    return whole


def _views_of(whole: Tensor, linears: list[nn.Linear]) -> bool:
    start = 0
    for m in linears:
        rows = m.weight.shape[0]
        part = whole[start:start + rows]
        if m.weight.shape != part.shape or m.weight.data_ptr() != part.data_ptr() or m.weight.dtype != whole.dtype:
            return False
        start += rows
    return start == whole.shape[0]


class FusedProjections(ModuleProjections):
    """One drafter layer's products over its concatenated weights, through the decode kernels."""

    def __init__(self, layer: DFlashDecoderLayer) -> None:
        super().__init__(layer)
        attn, mlp = self.attn, self.mlp
        with torch.no_grad():
            self.w_qkv = _concatenate_in_place(attn, "dflash_qkv_weight", [attn.q_proj, attn.k_proj, attn.v_proj])
            self.w_gate_up = _concatenate_in_place(mlp, "dflash_gate_up_weight", [mlp.gate_proj, mlp.up_proj])
        self.q_rows = attn.q_proj.out_features
        self.w_kv = self.w_qkv[self.q_rows:]  # k|v: the last rows, contiguous
        self.kv_rows = attn.k_proj.out_features
        self.inter = mlp.gate_proj.out_features
        self.rows_limit = matvec.max_rows()

    def qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        qkv = matvec.decode_linear(x, self.w_qkv, rows_limit=self.rows_limit)
        q, kv = qkv[..., :self.q_rows], qkv[..., self.q_rows:]
        return q, kv[..., :self.kv_rows], kv[..., self.kv_rows:]

    def kv(self, x: Tensor) -> tuple[Tensor, Tensor]:
        kv = self.kv_product(x)
        return kv[..., :self.kv_rows], kv[..., self.kv_rows:]

    def kv_product(self, x: Tensor) -> Tensor:
        """k|v ``[N, 2 Hkv*D]`` of rows ``x``: one product, k's columns first."""
        return matvec.decode_linear(x, self.w_kv, rows_limit=self.rows_limit)

    def o(self, x: Tensor) -> Tensor:
        return matvec.decode_linear(x, self.attn.o_proj.weight, rows_limit=self.rows_limit)

    def mlp_forward(self, x: Tensor) -> Tensor:
        gate_up = matvec.decode_linear(x, self.w_gate_up, rows_limit=self.rows_limit)
        hidden = fused_swiglu(gate_up[..., :self.inter], gate_up[..., self.inter:])
        return matvec.decode_linear(hidden, self.mlp.down_proj.weight, rows_limit=self.rows_limit)


def fusable(layer: DFlashDecoderLayer) -> bool:
    """Whether a layer's projections can be concatenated: no biases, one dtype and device."""
    attn = layer.self_attn
    linears = [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, layer.mlp.gate_proj, layer.mlp.up_proj,
               layer.mlp.down_proj]
    first = linears[0].weight
    return (isinstance(attn, DFlashAttention) and all(m.bias is None for m in linears)
            and all(m.weight.dtype == first.dtype and m.weight.device == first.device for m in linears))


def layer_projections(layers, *, kernels: bool) -> list[ModuleProjections]:
    """Each layer's projections: fused through the kernels where ``kernels`` (CUDA) and the layer
    is :func:`fusable`, else by its modules."""
    return [FusedProjections(layer) if kernels and fusable(layer) else ModuleProjections(layer) for layer in layers]
