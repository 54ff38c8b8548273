"""Per-row static K/V caches for batched decoding: one row per sequence in flight.

Each layer keeps ``K, V`` ``[rows, capacity + 1, heads, head_dim]``; position ``t`` of a
row's sequence lives at index ``t``, and the last index is a scratch slot where writes of
padding tokens go (so a padded batch writes with one fixed-shape ``index_put_``, or on CUDA one
launch of kv_write.py for k and v). A row's
valid length is not stored here: the decoders keep it, every forward masks keys at or past
it, and a shorter length is how rejected drafts are forgotten (no data moves; the next
writes overwrite them). Storage starts zeroed and every later write is a real K/V, so
masked keys are always finite (a masked NaN would still poison ``softmax @ V``).

:class:`RaggedCache` puts one in front of a transformers model as its ``Cache``: before
each forward the caller says where the new tokens go (``plan_fresh`` for a prefill whose
rows start empty, ``plan_extend`` for every row at once after its cached prefix).
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers import Cache

from dflash_ipc.decode import aranges, kv_write
from dflash_ipc.errors import DataError

MASK_ALIGN = 16
"""Key lengths handed to attention are rounded up to this: memory-efficient SDPA wants the
mask's last dimension aligned (it pads a copy otherwise)."""


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class RowStorage:
    """K/V of ``num_layers`` layers in ``storage_rows`` rows of ``capacity`` positions (+ the
    scratch slot), allocated per layer on the first write with the dtype and head shape the
    model produces; a forward reads rows ``[:num_rows]``. What :class:`RaggedCache` expects
    of its ``kv``: ``num_rows``, ``capacity``, ``scratch``, ``write``, ``view``."""

    def __init__(self, num_layers: int, num_rows: int, capacity: int) -> None:
        if num_rows < 1 or capacity < 1:
            raise DataError(f"{type(self).__name__}: rows={num_rows} and capacity={capacity} must be >= 1")
        self.storage_rows = self.num_rows = num_rows
        self.capacity = round_up(capacity, MASK_ALIGN)
        self.keys: list[Tensor | None] = [None] * num_layers
        self.values: list[Tensor | None] = [None] * num_layers

    @property
    def scratch(self) -> int:
        """Index that padding tokens write to; never below any row's length."""
        return self.capacity

    def storage(self, layer: int, heads: int, head_dim: int, dtype: torch.dtype,
                device: torch.device) -> tuple[Tensor, Tensor]:
        """Layer ``layer``'s (K, V) ``[storage_rows, capacity + 1, heads, head_dim]``, allocated
        (zeroed) on the first call or write; for kernels that write into it themselves."""
        if self.keys[layer] is None:
            shape = (self.storage_rows, self.capacity + 1, heads, head_dim)
            self.keys[layer] = torch.zeros(shape, dtype=dtype, device=device)
            self.values[layer] = torch.zeros(shape, dtype=dtype, device=device)
        keys, values = self.keys[layer], self.values[layer]
        if keys.shape[2:] != (heads, head_dim) or keys.dtype != dtype or keys.device != torch.device(device):
            raise DataError(f"{type(self).__name__}: layer {layer} holds {tuple(keys.shape[2:])} {keys.dtype} on "
                            f"{keys.device}, asked for ({heads}, {head_dim}) {dtype} on {device}")
        return keys, values

    def write(self, layer: int, rows: Tensor, pos: Tensor, k: Tensor, v: Tensor) -> None:
        """k/v ``[R, q, heads, D]`` of storage rows ``rows`` ``[R]`` at indices ``pos`` ``[R, q]``
        (long, same device)."""
        self.storage(layer, k.shape[2], k.shape[3], k.dtype, k.device)
        if kv_write.takes(self.keys[layer], self.values[layer], rows, pos, k, v):  # CUDA: one launch for both
            kv_write.write(self.keys[layer], self.values[layer], rows, pos, k, v)
            return
        index = (rows[:, None], pos)
        self.keys[layer].index_put_(index, k)
        self.values[layer].index_put_(index, v)

    def view(self, layer: int, length: int) -> tuple[Tensor, Tensor]:
        """(K, V) ``[num_rows, heads, length, D]`` of rows ``[:num_rows]``: views, no copy."""
        if length > self.capacity:
            raise DataError(f"{type(self).__name__}.view({length}) beyond the capacity {self.capacity}")
        n = self.num_rows
        return (self.keys[layer][:n, :length].transpose(1, 2), self.values[layer][:n, :length].transpose(1, 2))


class RowKV(RowStorage):
    """Row storage whose rows are every row, growable: ``select_rows`` and ``grow`` reallocate."""

    def select_rows(self, keep: Tensor) -> None:
        """Keep only rows ``keep`` ``[R']`` (in that order): row i becomes keep[i]'s contents."""
        for store in (self.keys, self.values):
            for i, t in enumerate(store):
                if t is not None:
                    store[i] = t.index_select(0, keep.to(t.device))
        self.storage_rows = self.num_rows = int(keep.numel())

    def grow(self, capacity: int) -> None:
        """At least ``capacity`` positions per row (a copy; the scratch slot moves to the end)."""
        capacity = round_up(capacity, MASK_ALIGN)
        if capacity <= self.capacity:
            return
        for store in (self.keys, self.values):
            for i, t in enumerate(store):
                if t is not None:
                    bigger = t.new_zeros(t.shape[0], capacity + 1, *t.shape[2:])
                    bigger[:, : self.capacity] = t[:, : self.capacity]
                    store[i] = bigger
        self.capacity = capacity


class RaggedCache(Cache):
    """A transformers ``Cache`` over :class:`RowKV`; the model calls ``update`` once per layer.

    Deliberately skips ``Cache.__init__`` (its arguments changed across transformers
    versions): a model only calls ``update`` when the caller passes positions and masks.
    """

    is_compileable = False

    def __init__(self, num_layers: int, num_rows: int, capacity: int) -> None:  # noqa: D107 - see class
        self.layers = []
        self.layer_class_to_replicate = None
        self.offloading = False
        self.kv = RowKV(num_layers, num_rows, capacity)
        self._plan: tuple[str, Tensor, Tensor, int] | None = None

    def plan_fresh(self, rows: Tensor, pos: Tensor) -> None:
        """Next forward: rows ``[R]`` start empty; token j of row i goes to ``pos[i, j]``.
        Attention sees only the forward's own tokens."""
        self._plan = ("fresh", rows, pos, 0)

    def plan_extend(self, pos: Tensor, length: int) -> None:
        """Next forward: all rows, token j of row i at ``pos[i, j]``; attention sees the first
        ``length`` cache positions of every row (the caller's mask hides what is not valid)."""
        rows = aranges.arange(self.kv.num_rows, pos.device)
        self._plan = ("extend", rows, pos, length)

    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args, **kwargs):
        """key/value_states ``[R, heads, q, D]`` -> what attention runs on (see the plans)."""
        if self._plan is None:
            raise DataError("RaggedCache.update without plan_fresh/plan_extend before the forward")
        mode, rows, pos, length = self._plan
        self.kv.write(layer_idx, rows, pos, key_states.transpose(1, 2), value_states.transpose(1, 2))
        if mode == "fresh":
            return key_states, value_states
        return self.kv.view(layer_idx, length)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # lengths are per row and the caller passes positions; nothing may derive them here

    def __len__(self) -> int:
        return len(self.kv.keys)
