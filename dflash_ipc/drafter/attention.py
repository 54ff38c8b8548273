"""Attention masks of the DFlash drafter and the attention call that uses them.

Keys are laid out as ``[all context tokens of the packed batch (T_ctx)] + [all block
tokens (Q)]``; queries are the Q block tokens. A block query may attend to

* context keys of the SAME sequence at positions ``< anchor`` of its block, and
* every key of its own block (bidirectional inside the block),

and to nothing else. One boolean rule covers both parts, over per-key tables where a
context key has ``block = -1`` and a block key has ``seq = -1``:

    visible(q, kv) = (key_seq[kv] == q_seq[q] & key_pos[kv] < q_anchor[q])
                   | (key_block[kv] == q_block[q])

A ``sliding_attention`` layer with window ``w`` adds HF transformers' sliding-window rule
(causal and windowed) on absolute positions, query i = anchor + k (k = its offset in the
block) and key j (a context key's position, or a block key's anchor + offset):

    visible_w(q, kv) = visible(q, kv) & (0 <= i - j < w)

so block slot k sees its block's slots 0..k and the context ``[i - w + 1, anchor)``: w keys
at most, the block's included. That is what the servers run for a sliding DFlash layer
(SGLang: a causal RadixAttention with window w - 1; vLLM: causal iff the layer slides,
FlashAttention window (w - 1, 0)) and what SpecForge trains; full_attention layers keep the
bidirectional block. Layers of one type share one mask: :func:`build_layer_masks`.

Two equivalent backends:

* ``dense``: a bool ``[Q, T_ctx + Q]`` mask for ``scaled_dot_product_attention``. Used on
  CPU (FlexAttention has no backward on CPU in torch 2.13) and as the reference.
* ``flex``: a FlexAttention ``BlockMask``. ``create_block_mask`` evaluates the mask
  element-wise and its first call compiles (26 s measured for 32,768 queries), and the
  mask changes every step, so :func:`flex_block_mask` builds the 128x128 tile lists
  directly from the anchor layout: each block sees two key intervals (its sequence's
  context prefix and its own keys), so per-(block, kv tile) overlap counts and prefix
  sums over blocks give the partial and full tiles with a few tensor ops, no compilation
  (measured: 2.5-3.3 ms on an H200, ~40 ms on one CPU thread, for 32,768 queries and
  8,192 context tokens).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from dflash_ipc.errors import ConfigError, DataError

logger = logging.getLogger(__name__)

try:  # FlexAttention exists from torch 2.5; the dense path never needs it.
    from torch.nn.attention.flex_attention import BlockMask, flex_attention
except ImportError:  # pragma: no cover - torch < 2.5 is outside the supported range
    BlockMask = None  # type: ignore[assignment,misc]
    flex_attention = None  # type: ignore[assignment]

BACKENDS = ("dense", "flex")
FLEX_TILE = 128  # FlexAttention's default (and most tuned) tile edge, queries and keys
# The number of queries and context keys changes from step to step (sequence lengths,
# a short last step). A static compile recompiles on the first change (6.8 s measured
# on an H200) and dynamo then makes the sizes dynamic anyway; compiling dynamic from the
# start gives one graph for every shape. The cost: the kernel can no longer assume
# lengths divisible by 128 (IS_DIVISIBLE=False adds bounds checks to its loads).
FLEX_COMPILE_OPTIONS = {"dynamic": True}
_compiled_flex = None


@dataclass
class BlockLayout:
    """Where every query and key of one training step belongs.

    Invariants (``build_training_batch`` produces them; :meth:`check` verifies them):
    context keys are the packed sequences in order, sequence ``s`` occupying
    ``cu_seqlens[s]:cu_seqlens[s+1]`` with positions ``0..len-1``; queries are grouped by
    block, block ``b`` occupying query rows ``b*block_size:(b+1)*block_size``.
    """

    query_seq: Tensor  # [Q] int32: sequence of the query's block
    query_anchor: Tensor  # [Q] int32: anchor position (within its sequence) of the block
    query_block: Tensor  # [Q] int32: global block index
    ctx_seq: Tensor  # [T_ctx] int32: sequence of each context key
    ctx_pos: Tensor  # [T_ctx] int32: position of each context key within its sequence
    cu_seqlens: Tensor  # [S+1] int32: packed sequence boundaries of the context
    block_size: int

    @property
    def num_queries(self) -> int:
        return int(self.query_seq.shape[0])

    @property
    def num_ctx(self) -> int:
        return int(self.ctx_seq.shape[0])

    @property
    def device(self) -> torch.device:
        return self.query_seq.device

    def to(self, device: torch.device | str) -> "BlockLayout":
        """The same layout with every tensor on ``device``."""
        return BlockLayout(
            query_seq=self.query_seq.to(device),
            query_anchor=self.query_anchor.to(device),
            query_block=self.query_block.to(device),
            ctx_seq=self.ctx_seq.to(device),
            ctx_pos=self.ctx_pos.to(device),
            cu_seqlens=self.cu_seqlens.to(device),
            block_size=self.block_size,
        )

    def check(self) -> None:
        """Raise DataError if the invariants the flex builder relies on do not hold."""
        bs, q = self.block_size, self.num_queries
        if q % bs:
            raise DataError(f"BlockLayout: {q} queries is not a multiple of block_size={bs}")
        rows = torch.arange(q, device=self.device)
        if not torch.equal(self.query_block.long(), rows // bs):
            raise DataError("BlockLayout.query_block: block b must occupy query rows b*bs..(b+1)*bs-1")
        cu = self.cu_seqlens.long()
        lengths = cu[1:] - cu[:-1]
        seq = torch.repeat_interleave(torch.arange(lengths.numel(), device=self.device), lengths)
        if int(cu[-1]) != self.num_ctx or not torch.equal(self.ctx_seq.long(), seq):
            raise DataError("BlockLayout.ctx_seq does not follow cu_seqlens")
        if not torch.equal(self.ctx_pos.long(), torch.arange(self.num_ctx, device=self.device) - cu[seq]):
            raise DataError("BlockLayout.ctx_pos must be 0..len-1 within each sequence")
        if q and bool((self.query_anchor.long() > lengths[self.query_seq.long()]).any()):
            raise DataError("BlockLayout.query_anchor lies beyond its sequence end")


def _key_tables(layout: BlockLayout) -> tuple[Tensor, Tensor, Tensor]:
    """Per-key (seq, pos, block) over all T_ctx + Q keys; -1 where a part does not apply."""
    dev, q = layout.device, layout.num_queries
    minus = torch.full((q,), -1, dtype=torch.int32, device=dev)
    key_seq = torch.cat([layout.ctx_seq.int(), minus])  # [K]
    key_pos = torch.cat([layout.ctx_pos.int(), torch.zeros_like(minus)])  # [K]
    key_block = torch.cat([torch.full_like(layout.ctx_seq, -1, dtype=torch.int32), layout.query_block.int()])
    return key_seq, key_pos, key_block


def query_positions(layout: BlockLayout) -> Tensor:
    """``[Q]`` int32: absolute position of every query, anchor + offset in its block."""
    rows = torch.arange(layout.num_queries, device=layout.device, dtype=torch.int32)
    return layout.query_anchor.int() + rows % layout.block_size


def _absolute_key_positions(layout: BlockLayout) -> Tensor:
    """``[K]`` int32: absolute position of every key (a block key sits where its query does)."""
    return torch.cat([layout.ctx_pos.int(), query_positions(layout)])


def _check_window(window: int | None) -> None:
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ConfigError(f"sliding window {window!r} must be an integer >= 1 (or None for full attention)")


def dense_mask(layout: BlockLayout, window: int | None = None) -> Tensor:
    """Bool ``[Q, T_ctx + Q]`` mask, True where the query may attend to the key; ``window``:
    a sliding_attention layer's (see the module docstring), None for full attention."""
    _check_window(window)
    key_seq, key_pos, key_block = _key_tables(layout)
    qs = layout.query_seq.int()[:, None]  # [Q, 1]
    qa = layout.query_anchor.int()[:, None]
    qb = layout.query_block.int()[:, None]
    ctx_ok = (key_seq[None, :] == qs) & (key_pos[None, :] < qa)  # [Q, K]
    visible = ctx_ok | (key_block[None, :] == qb)
    if window is not None:
        distance = query_positions(layout)[:, None] - _absolute_key_positions(layout)[None, :]  # [Q, K] i - j
        visible &= (distance >= 0) & (distance < window)
    return visible


def _interval_overlap(lo: Tensor, hi: Tensor, tile_lo: Tensor, tile_hi: Tensor) -> Tensor:
    """Length of each row's [lo, hi) intersected with each tile [tile_lo, tile_hi): [rows, KT]."""
    left = torch.maximum(lo[:, None], tile_lo[None, :])
    right = torch.minimum(hi[:, None], tile_hi[None, :])
    return (right - left).clamp_min(0)


def _tile_lists(partial: Tensor) -> tuple[Tensor, Tensor]:
    """(count [1,1,QT], indices [1,1,QT,KT]) with the selected kv tiles first, in order."""
    count = partial.sum(-1, dtype=torch.int32)
    # Stable sort of the negated flags puts selected tiles first, keeping their order.
    order = torch.argsort((~partial).to(torch.int8), dim=-1, stable=True)
    # contiguous: a transposed input (the query-side lists) sorts into a strided result
    return count.contiguous()[None, None], order.to(torch.int32, memory_format=torch.contiguous_format)[None, None]


def _prefix_over_blocks(flags: Tensor) -> Tensor:
    """``[KT, B+1]`` int32: per kv tile, how many of the blocks before each block (and of all)
    are flagged in ``flags`` ``[B, KT]``. Scanned along rows of the transpose: a scan over the
    outer dimension of ``[B, KT]`` ran as a slow kernel on CUDA (0.35 ms per call at the bench
    step's 2,048 blocks on an H100, two per step)."""
    counts = flags.mT.contiguous().int().cumsum(-1, dtype=torch.int32)  # [KT, B]
    return torch.cat([counts.new_zeros(counts.shape[0], 1), counts], dim=1)


def flex_tile_flags(layout: BlockLayout, tile: int = FLEX_TILE, window: int | None = None) -> tuple[Tensor, Tensor]:
    """(partial, full) bool ``[QT, KT]``: tiles with some / with all pairs visible.

    Without a window all queries of a block share one visibility row, so rows are
    computed per block (``[num_blocks, KT]``), and a query tile reduces over the
    contiguous run of blocks it intersects with prefix sums; this also covers block sizes
    that do not divide the tile. With a window, query k of a block (anchor a) sees the
    context ``[a + k - w + 1, a)`` and block offsets ``k - w + 1 .. k``: a block's "some
    visible" row takes the union over its queries (context from k = 0, the whole block)
    and its "all visible" row the intersection (context from k = bs - 1, block offset 0
    when w >= bs); exact when every block lies inside one query tile (block sizes dividing
    the tile), conservative otherwise (a tile may be called partial where it is empty or
    full: the mask_mod still decides every pair). ``partial`` excludes
    ``full``. A ragged last tile (query or key) is never called full, so the kernel
    always applies the mask_mod at sequence ends.
    """
    _check_window(window)
    q, t, bs = layout.num_queries, layout.num_ctx, layout.block_size
    k, nb = t + q, q // bs
    dev = layout.device
    qt, kt = -(-q // tile), -(-k // tile)
    cu = layout.cu_seqlens.long()
    seq_lo = cu[layout.query_seq[::bs].long()]  # [B] first context key of the block's sequence
    anchor = layout.query_anchor[::bs].long()  # [B]
    ctx_hi = seq_lo + anchor  # [B] positions < anchor
    blk_lo = t + torch.arange(nb, device=dev) * bs  # [B] the block's own keys
    tile_lo = torch.arange(kt, device=dev) * tile  # [KT]
    tile_hi = (tile_lo + tile).clamp_max(k)
    if window is None:
        any_lo = all_lo = seq_lo
        blk_all_hi = blk_lo + bs
    else:  # the first visible context position of the block's first and of its last query
        any_lo = seq_lo + (anchor - window + 1).clamp_min(0)
        all_lo = seq_lo + (anchor + bs - window).clamp_min(0)
        blk_all_hi = blk_lo + (1 if window >= bs else 0)  # causal: only slot 0 is seen by all
    seen_any = _interval_overlap(any_lo, ctx_hi, tile_lo, tile_hi)  # [B, KT]
    seen_any += _interval_overlap(blk_lo, blk_lo + bs, tile_lo, tile_hi)
    seen_all = _interval_overlap(torch.minimum(all_lo, ctx_hi), ctx_hi, tile_lo, tile_hi)
    seen_all += _interval_overlap(blk_lo, blk_all_hi, tile_lo, tile_hi)
    any_cum = _prefix_over_blocks(seen_any > 0)  # [KT, B+1]
    all_cum = _prefix_over_blocks(seen_all == (tile_hi - tile_lo))
    rows = torch.arange(qt, device=dev) * tile  # [QT] first query row of each tile
    b_lo = rows // bs  # first block touching the tile
    b_hi = ((rows + tile).clamp_max(q) + bs - 1) // bs  # one past the last block touching it
    n_any = (any_cum[:, b_hi] - any_cum[:, b_lo]).mT  # [QT, KT] blocks in the tile that see some key
    n_all = (all_cum[:, b_hi] - all_cum[:, b_lo]).mT  # blocks that see every key of the kv tile
    full = n_all == (b_hi - b_lo)[:, None]
    full &= ((tile_hi - tile_lo) == tile)[None, :]
    full &= (rows + tile <= q)[:, None]
    return (n_any > 0) & ~full, full


def flex_block_mask(layout: BlockLayout, device: torch.device | str | None = None,
                    window: int | None = None, memory: "MaskMemory | None" = None) -> "BlockMask":
    """FlexAttention BlockMask of the layout, built from tile overlap counts (no compile);
    ``window``: a sliding_attention layer's, None for full attention. ``memory``: its tensors
    in that :class:`MaskMemory`'s buffers (steps replayed as CUDA graphs)."""
    if BlockMask is None:  # pragma: no cover
        raise ConfigError("attention backend 'flex' needs torch.nn.attention.flex_attention (torch>=2.5)")
    if device is not None:
        layout = layout.to(device)
    cuda_arch(layout.device)  # known to flex_kernel_options inside the drafter's graph from here on
    partial, full = flex_tile_flags(layout, window=window)
    tables: dict[str, Tensor] = {}
    tables["kv_num_blocks"], tables["kv_indices"] = _tile_lists(partial)
    tables["full_kv_num_blocks"], tables["full_kv_indices"] = _tile_lists(full)
    # The query-side lists (the backward's) straight from the transposed flags: what
    # BlockMask.from_kv_blocks derives from the kv lists, through a dense scatter under
    # vmap and a sort per list: launches and functorch overhead on the host before every step.
    tables["q_num_blocks"], tables["q_indices"] = _tile_lists(partial.mT)
    tables["full_q_num_blocks"], tables["full_q_indices"] = _tile_lists(full.mT)
    tables["key_seq"], tables["key_pos"], tables["key_block"] = _key_tables(layout)
    tables["q_seq"], tables["q_anchor"] = layout.query_seq.int(), layout.query_anchor.int()
    tables["q_block"] = layout.query_block.int()
    if window is not None:
        tables["q_pos"], tables["key_abs"] = query_positions(layout), _absolute_key_positions(layout)
    seq_lengths = (layout.num_queries, layout.num_ctx + layout.num_queries)

    def make(t: dict[str, Tensor]) -> "BlockMask":
        return _block_mask(t, seq_lengths, window)
    if memory is None:
        return make(tables)
    return memory.place(("flex", window), tables, make, static=seq_lengths)


def _block_mask(t: dict[str, Tensor], seq_lengths: tuple[int, int], window: int | None) -> "BlockMask":
    """The BlockMask over :func:`flex_block_mask`'s tables: its tile lists and, in its
    mask_mod, the per-query and per-key tables of the module docstring's rule."""
    key_seq, key_pos, key_block = t["key_seq"], t["key_pos"], t["key_block"]
    q_seq, q_anchor, q_block = t["q_seq"], t["q_anchor"], t["q_block"]

    def mask_mod(b, h, q_idx, kv_idx):  # noqa: ARG001 - FlexAttention's signature
        ctx_ok = (key_seq[kv_idx] == q_seq[q_idx]) & (key_pos[kv_idx] < q_anchor[q_idx])
        return ctx_ok | (key_block[kv_idx] == q_block[q_idx])

    if window is not None:
        q_pos, key_abs, full_mod = t["q_pos"], t["key_abs"], mask_mod

        def mask_mod(b, h, q_idx, kv_idx):  # noqa: ARG001, F811 - causal and windowed on top of the rule
            distance = q_pos[q_idx] - key_abs[kv_idx]
            return full_mod(b, h, q_idx, kv_idx) & (distance >= 0) & (distance < window)

    lists = {name: t[name] for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
                                        "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")}
    return BlockMask(seq_lengths=seq_lengths, **lists, BLOCK_SIZE=(FLEX_TILE, FLEX_TILE), mask_mod=mask_mod)


class MaskMemory:
    """The same memory, and the same mask objects, for every step's masks: what steps replayed
    as CUDA graphs need (``drafter.compile: reduce-overhead``).

    torch.compile's CUDA graphs (cudagraph trees) take the tensors of a FlexAttention mask,
    and the tables its mask_mod reads, as static inputs: a graph replays only while they sit
    at the addresses it was recorded with, and a new address records the forward and
    backward graphs again. Built fresh each step, the masks land wherever the allocator puts
    them; with steps launched back to back (two steps' masks alive at once) the addresses
    alternate and steps re-recorded their graphs (measured on an H100, 135M-class drafter,
    ragged lengths: 12 graphs recorded for one shape, pipelined steps of 16.5 to 53.6 ms).
    Here a mask's tensors are copied into buffers of their own, and the mask object over
    those buffers is returned again, while its shapes hold (they do under step_shape.StepRows;
    a new shape gets new buffers, as it gets a new graph). The copies are queued on the
    device behind the last step that read the buffers.
    """

    def __init__(self) -> None:
        self._held: dict[object, tuple[tuple, dict[str, Tensor], object]] = {}

    def place(self, key: object, tensors: dict[str, Tensor], make, static: object = None) -> object:
        """``make(buffers)``'s object of ``key``, its buffers now holding ``tensors``. Built
        again (new buffers, the old ones dropped) when the tensors' shapes or ``static``, what
        else ``make`` depends on, change."""
        signature = (static, tuple((name, tuple(t.shape), t.dtype, t.device) for name, t in tensors.items()))
        held = self._held.get(key)
        if held is None or held[0] != signature:
            buffers = {name: t.clone() for name, t in tensors.items()}
            held = self._held[key] = (signature, buffers, make(buffers))
        else:
            for name, t in tensors.items():
                held[1][name].copy_(t)
        return held[2]


def build_mask(layout: BlockLayout, backend: str, window: int | None = None,
               memory: MaskMemory | None = None) -> Tensor | "BlockMask":
    """The mask object for :func:`attention`: ``"dense"`` -> bool Tensor, ``"flex"`` -> BlockMask;
    ``window``: a sliding_attention layer's, None for full attention; ``memory``: a flex mask
    built into that :class:`MaskMemory` (a dense mask is a plain input, which CUDA graphs copy
    in themselves)."""
    if backend == "dense":
        return dense_mask(layout, window)
    if backend == "flex":
        return flex_block_mask(layout, window=window, memory=memory)
    raise ConfigError(f"attention backend {backend!r} is not one of {BACKENDS}")


def build_layer_masks(layout: BlockLayout, backend: str, layer_types: list[str],
                      sliding_window: int | None, memory: MaskMemory | None = None) -> dict[str, Tensor | "BlockMask"]:
    """One mask per layer type the drafter has (``DFlashDraftModel.forward`` takes the dict):
    ``full_attention`` without a window, ``sliding_attention`` with ``sliding_window``;
    ``memory``: built into that :class:`MaskMemory` (CUDA graphs)."""
    masks = {}
    for kind in dict.fromkeys(layer_types):
        if kind == "full_attention":
            masks[kind] = build_mask(layout, backend, memory=memory)
        elif kind == "sliding_attention":
            if sliding_window is None:
                raise ConfigError("a sliding_attention layer needs a sliding_window (model.sliding_window)")
            masks[kind] = build_mask(layout, backend, sliding_window, memory=memory)
        else:
            raise ConfigError(f"layer type {kind!r} is not one of full_attention, sliding_attention")
    return masks


def _flex_fn():
    """flex_attention compiled once per process on CUDA, shape-dynamic so a new number of
    queries or keys does not recompile; eager elsewhere (CPU: forward only)."""
    global _compiled_flex
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention, **FLEX_COMPILE_OPTIONS)
    return _compiled_flex


# Kernel tiles that beat inductor's defaults, by (GPU compute capability, head dim): one
# forward and backward of the bench step's attention (benchmarks/flex_attention.py, H100, one
# run): at the 135M-class drafter's heads of 64, 1.83 ms with the defaults (128x128 forward,
# 64/128/128/64 backward), 1.53 ms with 64x64 tiles and 4 warps in both; at heads of 128 the
# defaults were the fastest of those tried.
FLEX_TILES = {
    ((9, 0), 64): {"fwd_BLOCK_M": 64, "fwd_BLOCK_N": 64, "fwd_num_warps": 4, "fwd_num_stages": 3,
                   "bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 64,
                   "bwd_num_warps": 4, "bwd_num_stages": 3},
}
_cuda_arch: dict[int, tuple[int, int]] = {}  # device index -> compute capability, read on the host


def cuda_arch(device: torch.device) -> tuple[int, int] | None:
    """The compute capability of a CUDA device, looked up on the host and kept: inside a
    traced graph only what the host already looked up is known (None otherwise)."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _cuda_arch and not torch.compiler.is_compiling():
        _cuda_arch[index] = torch.cuda.get_device_capability(index)
    return _cuda_arch.get(index)


def flex_kernel_options(num_queries: int, num_keys: int, head_dim: int | None = None,
                        arch: tuple[int, int] | None = None) -> dict | None:
    """``kernel_options`` of a FlexAttention call compiled with dynamic shapes: ``IS_DIVISIBLE``
    where both lengths are whole tiles. The kernel then loads without bounds checks, as it does
    when compiled for static shapes; the compiler cannot know it from dynamic sizes and sets it
    False. Measured on an H100 (benchmarks/flex_attention.py, one forward and backward of the
    bench step): 10.8 -> 8.5 ms at the Qwen3-8B drafter's heads, 3.0 -> 1.9 ms at the 135M-class
    one's. The trainer pads the step to whole tiles for it (`DrafterForward.step_rows`). Plus
    the tiles of ``FLEX_TILES`` for this GPU (``arch``) and ``head_dim``."""
    tiles = FLEX_TILES.get((arch, head_dim), {})
    if num_queries % FLEX_TILE or num_keys % FLEX_TILE:
        return dict(tiles) or None
    return {"IS_DIVISIBLE": True, **tiles}


def attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | "BlockMask") -> Tensor:
    """Masked attention with GQA. q ``[Hq, Q, D]``, k/v ``[Hkv, T_ctx+Q, D]`` -> ``[Hq, Q, D]``.

    ``mask`` is what :func:`build_mask` returned; the type selects the kernel.
    """
    scale = q.shape[-1] ** -0.5
    gqa = q.shape[0] != k.shape[0]
    if isinstance(mask, Tensor):
        out = F.scaled_dot_product_attention(
            q[None], k[None], v[None], attn_mask=mask, scale=scale, enable_gqa=gqa
        )  # [1, Hq, Q, D]
        return out[0]
    if BlockMask is not None and isinstance(mask, BlockMask):
        # inside the drafter's one graph (drafter.compile) dynamo traces flex_attention itself (the
        # divisibility test is then a guard, which the trainer's whole-tile steps always pass);
        # CPU runs flex eagerly, where the option means nothing
        if not q.is_cuda:
            return flex_attention(q[None], k[None], v[None], block_mask=mask, scale=scale, enable_gqa=gqa)[0]
        fn = flex_attention if torch.compiler.is_compiling() else _flex_fn()
        options = flex_kernel_options(q.shape[-2], k.shape[-2], q.shape[-1], cuda_arch(q.device))
        return fn(q[None], k[None], v[None], block_mask=mask, scale=scale, enable_gqa=gqa, kernel_options=options)[0]
    raise ConfigError(f"attention mask must be a bool Tensor or a BlockMask, got {type(mask).__name__}")
