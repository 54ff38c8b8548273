"""A static, pre-sized per-row K/V cache: allocated once, never moved, so CUDA graphs can hold it.

The layout and the reads and writes are the growable row cache's (``decode/row_cache.py``
RowStorage): per layer ``K, V``
``[rows, capacity + 1, heads, head_dim]``, position ``t`` of a row at index ``t``, the last
index a scratch slot for padding writes. What differs: the storage of every layer is allocated once, for the most
rows the engine may run (``max_rows``), and a decode step runs over a *prefix* of it,
``[:num_rows]`` (the batch-size bucket). A step captured as a CUDA graph records the
addresses of that prefix, so nothing here may ever reallocate: ``compact`` moves busy rows
to the front in place instead of ``index_select`` into new tensors, and there is no
``grow`` (the engine builds a bigger cache between runs, and drops its graphs with the old one).

Storage is allocated per layer on the first write (a cache's first prefill, which runs eagerly
even where later ones run the compiled layers), with the K/V dtype and head shape the model
produces, and zeroed: masked keys are always finite.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dflash_ipc.decode.row_cache import RaggedCache, RowStorage


class StaticRowKV(RowStorage):
    """Row storage of ``max_rows`` rows, never reallocated; a step runs over the prefix
    ``[:num_rows]`` (the rows bucket, set by the engine before each step)."""

    @property
    def max_rows(self) -> int:
        """Rows allocated: the most a step may run over."""
        return self.storage_rows

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
