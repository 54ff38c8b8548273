"""A static, pre-sized per-row K/V cache: allocated once, never moved, so CUDA graphs can hold it.

The layout is the growable row cache's (``decode/row_cache.py``): per layer ``K, V``
``[rows, capacity + 1, heads, head_dim]``, position ``t`` of a row at index ``t``, the last
index a scratch slot for padding writes. What differs: the storage of every layer is allocated once, for the most
rows the engine may run (``max_rows``), and a decode step runs over a *prefix* of it,
``[:num_rows]`` (the batch-size bucket). A step captured as a CUDA graph records the
addresses of that prefix, so nothing here may ever reallocate: ``compact`` moves busy rows
to the front in place instead of ``index_select`` into new tensors, and there is no
``grow`` (the engine builds a bigger cache between runs, and drops its graphs with the old one).

Storage is allocated per layer on the first write (a prefill, always eager), with the K/V
dtype and head shape the model produces, and zeroed: masked keys are always finite.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dflash_ipc.errors import DataError
from dflash_ipc.decode.row_cache import MASK_ALIGN, RaggedCache, round_up


class StaticRowKV:
    """K/V storage of ``num_layers`` layers for ``max_rows`` rows of ``capacity`` positions.

    The interface :class:`~dflash_ipc.decode.row_cache.RaggedCache` expects of its ``kv``:
    ``num_rows`` (rows a step runs over: the prefix bucket), ``capacity``, ``scratch``,
    ``write``, ``view``.
    """

    def __init__(self, num_layers: int, max_rows: int, capacity: int) -> None:
        if max_rows < 1 or capacity < 1:
            raise DataError(f"StaticRowKV: max_rows={max_rows} and capacity={capacity} must be >= 1")
        self.max_rows, self.capacity = max_rows, round_up(capacity, MASK_ALIGN)
        self.num_rows = max_rows
        self.keys: list[Tensor | None] = [None] * num_layers
        self.values: list[Tensor | None] = [None] * num_layers

    @property
    def scratch(self) -> int:
        """Index that padding tokens write to; never below any row's length."""
        return self.capacity

    def write(self, layer: int, rows: Tensor, pos: Tensor, k: Tensor, v: Tensor) -> None:
        """k/v ``[R, q, heads, D]`` of storage rows ``rows`` ``[R]`` at indices ``pos`` ``[R, q]``."""
        if self.keys[layer] is None:
            shape = (self.max_rows, self.capacity + 1)
            self.keys[layer] = k.new_zeros(*shape, *k.shape[2:])
            self.values[layer] = v.new_zeros(*shape, *v.shape[2:])
        index = (rows[:, None], pos)
        self.keys[layer].index_put_(index, k)
        self.values[layer].index_put_(index, v)

    def view(self, layer: int, length: int) -> tuple[Tensor, Tensor]:
        """(K, V) ``[num_rows, heads, length, D]`` of the prefix rows: views, no copy."""
        if length > self.capacity:
            raise DataError(f"StaticRowKV.view({length}) beyond the capacity {self.capacity}")
        n = self.num_rows
        return (self.keys[layer][:n, :length].transpose(1, 2), self.values[layer][:n, :length].transpose(1, 2))

    def compact(self, keep: Tensor, length: int) -> None:
        """Rows ``keep`` ``[n]`` (ascending storage indices) move to rows ``0..n-1``, in place;
        only their first ``length`` positions are copied (the rest is past every row's length)."""
        n, length = int(keep.numel()), min(length, self.capacity)
        for store in (self.keys, self.values):
            for t in store:
                if t is not None:
                    # The gather makes a copy first, so overlapping source and target rows are safe.
                    t[:n, :length] = t[:, :length].index_select(0, keep.to(t.device))

    def copy_rows(self, src: Tensor, dst: Tensor, length: int) -> None:
        """The first ``length`` positions of rows ``src`` ``[n]`` into rows ``dst`` ``[n]`` (disjoint
        from ``src``), every layer written so far: prompts prefilled once, shared by several rows."""
        length = min(length, self.capacity)
        for store in (self.keys, self.values):
            for t in store:
                if t is not None:
                    t[dst.to(t.device), :length] = t[src.to(t.device), :length]

    def nbytes(self) -> int:
        """Bytes allocated so far."""
        return sum(t.numel() * t.element_size() for store in (self.keys, self.values) for t in store if t is not None)


def static_cache(num_layers: int, max_rows: int, capacity: int) -> RaggedCache:
    """A transformers ``Cache`` (row_cache.RaggedCache: plan_fresh / plan_extend) over static storage."""
    cache = RaggedCache(num_layers, 1, 1)
    cache.kv = StaticRowKV(num_layers, max_rows, capacity)
    return cache


def kv_bytes_per_token(text_config, dtype: torch.dtype) -> int:
    """K and V bytes of one position over all layers (what a step reads per cached token)."""
    heads = getattr(text_config, "num_key_value_heads", None) or text_config.num_attention_heads
    head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * int(text_config.num_hidden_layers) * int(heads) * int(head_dim) * itemsize
