"""Masks of the drafter: dense == brute force, flex BlockMask == dense, kernels agree."""

import warnings

import pytest
import torch
import torch.nn.functional as F

from dflash_ipc.drafter import attention as att
from dflash_ipc.drafter.attention import BlockLayout, attention, build_mask, dense_mask, flex_block_mask
from dflash_ipc.errors import ConfigError, DataError

torch.set_num_threads(1)


def make_layout(lengths: list[int], anchors: list[list[int]], bs: int) -> BlockLayout:
    """A layout from plain lists, written independently of objective.build_training_batch."""
    q_seq, q_anchor, q_block, c_seq, c_pos, cu = [], [], [], [], [], [0]
    block = 0
    for s, (n, seq_anchors) in enumerate(zip(lengths, anchors)):
        c_seq += [s] * n
        c_pos += list(range(n))
        cu.append(cu[-1] + n)
        for a in seq_anchors:
            q_seq += [s] * bs
            q_anchor += [a] * bs
            q_block += [block] * bs
            block += 1

    def i32(x):
        return torch.tensor(x, dtype=torch.int32)

    return BlockLayout(query_seq=i32(q_seq), query_anchor=i32(q_anchor), query_block=i32(q_block),
                       ctx_seq=i32(c_seq), ctx_pos=i32(c_pos), cu_seqlens=i32(cu), block_size=bs)


def brute_force_mask(lengths: list[int], anchors: list[list[int]], bs: int, window: int | None = None) -> torch.Tensor:
    """The rule in words, one (query, key) pair at a time; ``window``: HF's sliding rule on
    absolute positions (query i sees key j iff 0 <= i - j < window) on top of it."""
    num_ctx = sum(lengths)
    blocks = [(s, a) for s, seq_anchors in enumerate(anchors) for a in seq_anchors]
    keys = [(s, p) for s, n in enumerate(lengths) for p in range(n)]
    q = len(blocks) * bs
    mask = torch.zeros(q, num_ctx + q, dtype=torch.bool)
    for qi in range(q):
        b = qi // bs
        s, a = blocks[b]
        for kj in range(num_ctx + q):
            i = a + qi % bs  # the query's position in its sequence
            if kj < num_ctx:
                ks, kp = keys[kj]
                mask[qi, kj] = ks == s and kp < a and (window is None or 0 <= i - kp < window)
            else:
                j = blocks[(kj - num_ctx) // bs][1] + (kj - num_ctx) % bs
                mask[qi, kj] = (kj - num_ctx) // bs == b and (window is None or 0 <= i - j < window)
    return mask


# several sequences; anchors at 0, at the last eligible position and at the very end;
# overlapping blocks (anchors closer than block_size); a sequence with no anchors
CASES = [
    ([7], [[0, 2, 3, 5]], 4),
    ([5, 9, 4], [[0, 3], [1, 2, 7, 8], [2]], 4),
    ([6, 3, 8], [[4], [], [0, 1, 6, 7]], 3),
]


@pytest.mark.parametrize("lengths,anchors,bs", CASES)
def test_dense_mask_matches_brute_force(lengths, anchors, bs):
    layout = make_layout(lengths, anchors, bs)
    layout.check()
    assert torch.equal(dense_mask(layout), brute_force_mask(lengths, anchors, bs))


@pytest.mark.parametrize("window", [1, 2, 3, 5, 100])
@pytest.mark.parametrize("lengths,anchors,bs", CASES)
def test_sliding_window_dense_mask_matches_brute_force(lengths, anchors, bs, window):
    layout = make_layout(lengths, anchors, bs)
    assert torch.equal(dense_mask(layout, window), brute_force_mask(lengths, anchors, bs, window))


def test_sliding_window_spot_values():
    # one sequence of 9, bs 3, anchor 6, window 4: query k=0 (pos 6) sees context 3..5 and
    # itself, query k=2 (pos 8) context 5 and block slots 0..2: causal, 4 keys each.
    layout = make_layout([9], [[6]], 3)
    m = dense_mask(layout, window=4)
    assert m[0, :9].tolist() == [False] * 3 + [True] * 3 + [False] * 3
    assert m[2, :9].tolist() == [False] * 5 + [True] + [False] * 3
    assert m[:, 9:].tolist() == [[True, False, False], [True, True, False], [True, True, True]]
    huge = dense_mask(layout, window=10**6)  # a window past the sequence: causal full attention
    assert torch.equal(huge[:, :9], dense_mask(layout)[:, :9]) and torch.equal(huge[:, 9:], m[:, 9:])
    m = dense_mask(layout, window=1)  # a query sees itself only
    assert not m[:, :9].any() and torch.equal(m[:, 9:], torch.eye(3, dtype=torch.bool))
    with pytest.raises(ConfigError, match="sliding window 0 must be an integer >= 1"):
        dense_mask(make_layout([9], [[6]], 3), window=0)


def test_dense_mask_spot_values():
    # seq0 len 5 (keys 0..4), seq1 len 4 (keys 5..8); bs 2; blocks: (0, a=3), (1, a=0), (1, a=2)
    layout = make_layout([5, 4], [[3], [0, 2]], 2)
    m = dense_mask(layout)  # [6, 9 + 6]
    assert m[0, :9].tolist() == [True, True, True, False, False, False, False, False, False]
    assert m[2, :9].tolist() == [False] * 9  # anchor 0 sees no context
    assert m[4, :9].tolist() == [False] * 5 + [True, True, False, False]
    assert m[1, 9:].tolist() == [True, True, False, False, False, False]  # own block, both ways
    assert m[5, 9:].tolist() == [False, False, False, False, True, True]


def test_check_rejects_broken_layouts():
    layout = make_layout([5, 4], [[3], [0, 2]], 2)
    bad = make_layout([5, 4], [[3], [0, 2]], 2)
    bad.query_block = bad.query_block.flip(0)
    with pytest.raises(DataError, match="query_block"):
        bad.check()
    bad = make_layout([5, 4], [[3], [0, 2]], 2)
    bad.ctx_pos = bad.ctx_pos + 1
    with pytest.raises(DataError, match="ctx_pos"):
        bad.check()
    bad = make_layout([5, 4], [[3], [0, 2]], 2)
    bad.query_anchor = bad.query_anchor + 5
    with pytest.raises(DataError, match="query_anchor"):
        bad.check()
    layout.check()


def big_layout(seed=0, lengths=(700, 130, 450), per_seq=37, bs=16) -> tuple[BlockLayout, list, list]:
    """Ragged sizes (Q and T_ctx not multiples of 128) with full, partial and empty tiles."""
    gen = torch.Generator().manual_seed(seed)
    anchors = []
    for n in lengths:
        k = min(n - 1, per_seq)
        anchors.append(sorted(torch.randperm(n - 1, generator=gen)[:k].tolist()))
    return make_layout(list(lengths), anchors, bs), list(lengths), anchors


def tile_reduce(mask: torch.Tensor, tile: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """(partial, full) tile flags of a dense mask; ragged tiles are never full."""
    q, k = mask.shape
    qt, kt = -(-q // tile), -(-k // tile)
    padded = torch.zeros(qt * tile, kt * tile, dtype=torch.bool)
    padded[:q, :k] = mask
    valid = torch.zeros_like(padded)
    valid[:q, :k] = True
    tiles = padded.view(qt, tile, kt, tile)
    any_ = tiles.any(dim=3).any(dim=1)
    full = tiles.all(dim=3).all(dim=1) & valid.view(qt, tile, kt, tile).all(dim=3).all(dim=1)
    return any_ & ~full, full


@pytest.mark.parametrize("bs", [16, 10, 7, 128])  # blocks that do and do not divide the 128 tile
def test_flex_tile_flags_match_dense_reduction(bs):
    layout, _, _ = big_layout(bs=bs, per_seq=37 if bs < 128 else 5)
    partial, full = att.flex_tile_flags(layout)
    want_partial, want_full = tile_reduce(dense_mask(layout))
    assert full.any() and partial.any() and not (partial | full).all()  # the case is not trivial
    assert torch.equal(partial, want_partial)
    assert torch.equal(full, want_full)


def _mask_mod_dense(bm, q: int, k: int) -> torch.Tensor:
    """Evaluates a BlockMask's mask_mod on every (query, key) pair."""
    zero = torch.zeros((), dtype=torch.int32)
    return bm.mask_mod(zero, zero, torch.arange(q, dtype=torch.int32)[:, None],
                       torch.arange(k, dtype=torch.int32)[None, :])


@pytest.mark.parametrize("window", [1, 9, 130, 300])
@pytest.mark.parametrize("bs", [16, 128, 10, 7])
def test_sliding_window_flex_mask_covers_the_dense_mask(bs, window):
    """Tiles: exact where every block lies in one query tile (bs divides 128), otherwise a
    superset of the visible pairs (partial | full) with only truly full tiles called full;
    the mask_mod is the dense mask pair by pair."""
    layout, _, _ = big_layout(bs=bs, per_seq=37 if bs < 128 else 5)
    dense = dense_mask(layout, window)
    partial, full = att.flex_tile_flags(layout, window=window)
    want_partial, want_full = tile_reduce(dense)
    if 128 % bs == 0:
        assert torch.equal(partial, want_partial) and torch.equal(full, want_full)
    assert not (want_partial & ~(partial | full)).any() and not (full & ~want_full).any()
    assert not ((want_full & ~full) & ~partial).any()  # a full tile is at least partial
    bm = flex_block_mask(layout, window=window)
    assert torch.equal(_mask_mod_dense(bm, layout.num_queries, layout.num_ctx + layout.num_queries), dense)
    if window < 300:
        assert not torch.equal(dense, dense_mask(layout))  # the window cuts something here


def test_block_mask_to_dense_matches_dense_mask():
    layout, _, _ = big_layout(seed=1)
    bm = flex_block_mask(layout)
    partial, full = tile_reduce(dense_mask(layout))
    assert bm.shape[-2:] == (layout.num_queries, layout.num_ctx + layout.num_queries)
    assert torch.equal(bm.to_dense()[0, 0].bool(), partial | full)
    assert torch.equal(bm.full_kv_num_blocks[0, 0], full.sum(-1).int())


@pytest.mark.parametrize("window", [None, 100])
def test_block_mask_query_lists_are_what_from_kv_blocks_derives(window):
    """flex_block_mask builds the query-side (backward) lists from the transposed tile flags;
    BlockMask.from_kv_blocks derives them from the kv lists: the same tensors."""
    from torch.nn.attention.flex_attention import BlockMask
    layout, _, _ = big_layout(seed=3, per_seq=37)
    bm = flex_block_mask(layout, window=window)
    derived = BlockMask.from_kv_blocks(bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices,
                                       BLOCK_SIZE=bm.BLOCK_SIZE, mask_mod=bm.mask_mod, seq_lengths=bm.seq_lengths)
    for name in ("q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices"):
        assert torch.equal(getattr(bm, name), getattr(derived, name)), name
        assert getattr(bm, name).dtype == torch.int32 and getattr(bm, name).is_contiguous()


def test_flex_forward_on_cpu_matches_dense():
    # FlexAttention runs forward (eager, unfused) on CPU; backward needs a GPU.
    layout, _, _ = big_layout(seed=2, lengths=(200, 90), per_seq=9)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(4, layout.num_queries, 16, generator=gen)
    k = torch.randn(2, layout.num_ctx + layout.num_queries, 16, generator=gen)
    v = torch.randn(2, layout.num_ctx + layout.num_queries, 16, generator=gen)
    out_dense = attention(q, k, v, build_mask(layout, "dense"))
    with warnings.catch_warnings():  # torch warns once per process that eager flex is unfused
        warnings.filterwarnings("ignore", message=".*without torch.compile")
        out_flex = attention(q, k, v, build_mask(layout, "flex"))
    torch.testing.assert_close(out_flex, out_dense, rtol=1e-5, atol=1e-5)


def test_sliding_flex_forward_on_cpu_matches_dense_and_layer_masks_per_type():
    layout, _, _ = big_layout(seed=4, lengths=(300, 90), per_seq=9)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(4, layout.num_queries, 16, generator=gen)
    k = torch.randn(2, layout.num_ctx + layout.num_queries, 16, generator=gen)
    v = torch.randn(2, layout.num_ctx + layout.num_queries, 16, generator=gen)
    out_dense = attention(q, k, v, build_mask(layout, "dense", 40))
    with warnings.catch_warnings():  # torch warns once per process that eager flex is slow
        warnings.simplefilter("ignore", UserWarning)
        out_flex = attention(q, k, v, build_mask(layout, "flex", 40))
    torch.testing.assert_close(out_flex, out_dense, rtol=1e-5, atol=1e-5)
    masks = att.build_layer_masks(layout, "dense", ["sliding_attention", "full_attention", "sliding_attention"], 40)
    assert list(masks) == ["sliding_attention", "full_attention"]
    assert torch.equal(masks["sliding_attention"], dense_mask(layout, 40))
    assert torch.equal(masks["full_attention"], dense_mask(layout))
    with pytest.raises(ConfigError, match="needs a sliding_window"):
        att.build_layer_masks(layout, "dense", ["sliding_attention"], None)


def test_dense_attention_is_masked_softmax_with_gqa():
    layout = make_layout([5, 4], [[3], [0, 2]], 2)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(4, 6, 8, generator=gen)
    k = torch.randn(2, 15, 8, generator=gen)
    v = torch.randn(2, 15, 8, generator=gen)
    mask = dense_mask(layout)
    kk, vv = k.repeat_interleave(2, dim=0), v.repeat_interleave(2, dim=0)  # head h uses kv head h // 2
    scores = (q @ kk.transpose(1, 2)) / 8**0.5
    want = F.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1) @ vv
    torch.testing.assert_close(attention(q, k, v, mask), want)


def test_build_mask_rejects_unknown_backend_and_mask_type():
    layout = make_layout([5], [[2]], 2)
    with pytest.raises(ConfigError, match="dense"):
        build_mask(layout, "sdpa")
    with pytest.raises(ConfigError, match="BlockMask"):
        attention(torch.zeros(1, 2, 4), torch.zeros(1, 7, 4), torch.zeros(1, 7, 4), object())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("window", [None, 100])
def test_flex_and_dense_agree_on_gpu_outputs_and_grads(window):
    layout, _, _ = big_layout(seed=3)
    layout = layout.to("cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    shape_q, shape_kv = (8, layout.num_queries, 64), (2, layout.num_ctx + layout.num_queries, 64)
    base = [torch.randn(s, generator=gen, device="cuda") for s in (shape_q, shape_kv, shape_kv)]
    results = []
    for backend in ("dense", "flex"):
        q, k, v = (t.clone().requires_grad_(True) for t in base)
        out = attention(q, k, v, build_mask(layout, backend, window))
        (out * torch.linspace(-1, 1, out.numel(), device="cuda").view_as(out)).sum().backward()
        results.append((out.detach(), q.grad, k.grad, v.grad))
    for dense_t, flex_t in zip(*results):
        torch.testing.assert_close(flex_t, dense_t, rtol=2e-3, atol=2e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_flex_on_whole_tiles_skips_bounds_checks_with_the_same_numbers():
    """A layout padded to whole 128-tiles (as the trainer pads a flex step: context keys no query
    sees, filler blocks) runs flex with IS_DIVISIBLE; the real queries' values and gradients are
    those of the unpadded layout, and dense agrees."""
    from dflash_ipc.drafter.attention import flex_kernel_options
    from dflash_ipc.drafter.step_shape import pad_layout, pad_query_blocks, round_up
    layout, _, _ = big_layout(seed=4)
    padded = pad_query_blocks(pad_layout(layout, round_up(layout.num_ctx, 128)), round_up(layout.num_queries, 128))
    assert flex_kernel_options(padded.num_queries, padded.num_ctx + padded.num_queries) == {"IS_DIVISIBLE": True}
    gen = torch.Generator(device="cuda").manual_seed(0)
    q0 = torch.randn(8, layout.num_queries, 64, generator=gen, device="cuda", dtype=torch.bfloat16)
    ctx0, blk0 = (torch.randn(2, n, 64, generator=gen, device="cuda", dtype=torch.bfloat16)
                  for n in (layout.num_ctx, layout.num_queries))
    grad = torch.randn(8, layout.num_queries, 64, generator=gen, device="cuda", dtype=torch.bfloat16)
    results = []
    for lay, backend in ((layout, "flex"), (padded, "flex"), (layout, "dense")):
        q, ctx, blk = (t.clone().requires_grad_(True) for t in (q0, ctx0, blk0))
        pad_q = lay.num_queries - layout.num_queries
        pad_c = lay.num_ctx - layout.num_ctx
        kv = torch.cat([ctx, ctx.new_zeros(2, pad_c, 64), blk, blk.new_zeros(2, pad_q, 64)], dim=1)
        qq = torch.cat([q, q.new_zeros(8, pad_q, 64)], dim=1)
        out = attention(qq, kv, kv, build_mask(lay.to("cuda"), backend))[:, :layout.num_queries]
        (out.float() * grad.float()).sum().backward()
        results.append((out.detach().float(), q.grad.float(), ctx.grad.float(), blk.grad.float()))
    for got, want, dense in zip(*results):
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(got, dense, rtol=3e-2, atol=3e-2)
