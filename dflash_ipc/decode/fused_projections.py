"""One weight for the projections that read one input: q|k|v of attention, gate|up of the MLP.

A transformers decoder layer multiplies its attention input by three weights (q, k, v) and its
MLP input by two (gate, up); with o and down, seven weight reads per layer. At a decode step's few rows each
read is a matrix-vector product bound by the weight's streaming rate, and the small ones
stream worst (a Qwen3-1.7B k or v weight is 4 MB). One product per group streams the same
bytes in two launches instead of five: benchmarks/matvec.py prints the step's matmul time
both ways (docs/benchmarks.md, "Batch 1: a matrix-vector kernel, fused projections").

:func:`fuse_projections` concatenates each group's weights (and biases) into one tensor, makes
the members' parameters views of it (no memory added), and replaces the members by
:class:`FusedMember` modules sharing a :class:`FusedGroup`. The first member called computes
the whole product and keeps it, with its input, on the group; the others, called with that
same input tensor, take their columns of it; the last of them lets both go. A member called
with another input (a model that feeds its projections different tensors) computes the
product again: the same columns, only slower. A layer that calls only some members keeps the
last product until its next call (and, compiled, costs one more graph for that state). The members are ``nn.Linear`` subclasses with
their own ``weight``/``bias`` views, so code that reads them (a dtype, a shape) still works.

The layer's forward stays transformers' own, so this works for any architecture that names
its projections as GROUPS does (Llama, Qwen2/3, Mistral and Gemma among them); a layer whose
names differ, or whose members differ in input size, dtype or bias, is left as it is.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dflash_ipc.decode.matvec import cuda_switch, decode_linear, max_rows

GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
"""Sibling ``nn.Linear`` modules that a decoder layer calls on one input, by their HF names."""
FUSE_ENV = "DFLASH_DECODE_FUSE"


def enabled(device) -> bool:
    """Whether a target on ``device`` fuses its projections ($DFLASH_DECODE_FUSE: ``auto``, the
    default, fuses on CUDA; ``off``). CPU runs keep the model as loaded: the reference path."""
    return cuda_switch(FUSE_ENV, device)


class FusedGroup:
    """The concatenated weight ``[sum N_i, K]`` (and bias) of a group, each member's column
    range, and the product of the last input while its members read it."""

    def __init__(self, weight: Tensor, bias: Tensor | None, bounds: tuple[tuple[int, int], ...],
                 matvec: bool) -> None:
        self.weight, self.bias, self.bounds, self.matvec = weight, bias, bounds, matvec
        self.rows_limit = max_rows()
        self.x: Tensor | None = None
        self.y: Tensor | None = None
        self.reads = 0

    def product(self, x: Tensor) -> Tensor:
        """x ``[..., K]`` times every member's weight ``[..., sum N_i]``: CUDA inputs of a few
        rows through decode/matvec.py's kernels where ``matvec``, else ``F.linear``."""
        if self.matvec:
            return decode_linear(x, self.weight, self.bias, self.rows_limit)
        return F.linear(x, self.weight, self.bias)


class FusedMember(nn.Linear):
    """Member ``index`` of a :class:`FusedGroup`: its columns of the group's product."""

    def __init__(self, group: FusedGroup, index: int, weight: Tensor, bias: Tensor | None) -> None:
        nn.Module.__init__(self)
        self.out_features, self.in_features = weight.shape
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.group, self.index = group, index

    def forward(self, x: Tensor) -> Tensor:
        group = self.group
        if group.x is not x:  # the first member called on this input (or another input)
            group.x, group.y, group.reads = x, group.product(x), 0
        y = group.y
        group.reads += 1
        if group.reads == len(group.bounds):  # every member has read it: let the product go
            group.x, group.y, group.reads = None, None, 0
        lo, hi = group.bounds[self.index]
        return y[..., lo:hi]


def _group_of(parent: nn.Module, names: tuple[str, ...]) -> list[nn.Linear] | None:
    members = [getattr(parent, name, None) for name in names]
    if not all(type(m) is nn.Linear for m in members):
        return None
    first = members[0]
    same = all(m.in_features == first.in_features and m.weight.dtype == first.weight.dtype
               and m.weight.device == first.weight.device and (m.bias is None) == (first.bias is None)
               for m in members)
    return members if same else None


@torch.no_grad()
def fuse_projections(model: nn.Module, *, matvec: bool = False) -> int:
    """Fuse every GROUPS group of plain ``nn.Linear`` siblings under ``model`` (a frozen target,
    already on its device); how many groups were fused. ``matvec``: the groups' products of a
    few rows go through decode/matvec.py's kernels."""
    count = 0
    for parent in list(model.modules()):
        for names in GROUPS:
            members = _group_of(parent, names)
            if members is None:
                continue
            weight = torch.cat([m.weight for m in members])
            bias = torch.cat([m.bias for m in members]) if members[0].bias is not None else None
            edges = [0]
            for m in members:
                edges.append(edges[-1] + m.out_features)
            bounds = tuple(zip(edges[:-1], edges[1:]))
            group = FusedGroup(weight, bias, bounds, matvec)
            for index, (name, (lo, hi)) in enumerate(zip(names, bounds)):
                setattr(parent, name, FusedMember(group, index, weight[lo:hi], None if bias is None else bias[lo:hi]))
            count += 1
    return count
