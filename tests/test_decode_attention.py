"""decode/decode_attention.py: attention of a few queries per row over the row's cached keys.

On CPU: how a span is split, which shapes and dtypes the kernel takes and which calls go to it
(marked modules, CUDA), the setting. On CUDA (marked gpu): the kernel against ``gqa_attention``
in fp32 over ragged band masks (left padding, a sliding window, rows of other lengths), grouped
heads of 1, 2, 4 and 8 queries per K/V head, one query and a verify block, one program per row,
a span split over several, hidden blocks skipped where the rows fill the GPU, head dims of
64-256, non-contiguous cache views; fp16, a value head dim of its own, a mask wider than the
keys, a query that sees no key; a split span combined by its last split and by a launch of its
own (also in Triton's interpreter, on CPU); the op's schema; the drafter context's block
attention both ways; a bf16 target's decode with the kernel against the same target without it, compiled
and captured (eval/lossless.py's near-tie rule: the kernel sums in another order than cuDNN);
and bf16 speculative decoding with every decode kernel against plain decoding."""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from torch import nn

from dflash_ipc.decode import decode_attention
from dflash_ipc.errors import ConfigError
from dflash_ipc.decode.decode_attention import ATTENTION_ENV, KEYS_PER_SPLIT, fits, split_plan
from dflash_ipc.decode.ragged_attention import band_mask, gqa_attention
from dflash_ipc.decode.requests import Request, RequestList
from decode_switch_helpers import check_switch_setting, decode_verdicts

cuda = pytest.mark.skipif(not (torch.cuda.is_available() and decode_attention.triton is not None),
                          reason="needs CUDA and Triton")


def test_a_span_is_split_only_where_programs_are_few_and_keys_many(monkeypatch):
    monkeypatch.delenv(decode_attention.SPLIT_KEYS_ENV, raising=False)
    assert split_plan(programs=4096, span=4096, sms=132, block_t=64) == (1, 64)  # 512 rows x 8 heads fill the GPU
    blocks = KEYS_PER_SPLIT // 64
    assert split_plan(programs=8, span=KEYS_PER_SPLIT, sms=132, block_t=64) == (1, blocks)  # one split's worth of keys
    assert split_plan(programs=8, span=4 * KEYS_PER_SPLIT + 1, sms=132, block_t=64) == (5, blocks)  # the last: 1 key
    # About one program per SM (17 splits of 16 x 8 = 128 blocks), then as few as hold them: 16 of 8 blocks.
    assert split_plan(programs=8, span=8192, sms=132, block_t=64) == (16, 8)
    assert split_plan(programs=8, span=8192, sms=132, block_t=64, splits=3) == (3, 43)  # asked for
    assert split_plan(programs=8, span=130, sms=132, block_t=64, splits=10) == (3, 1)  # none left empty


def test_the_keys_per_split_can_be_set_and_a_bad_count_is_named(monkeypatch):
    monkeypatch.setenv(decode_attention.SPLIT_KEYS_ENV, "128")
    assert split_plan(programs=8, span=384, sms=132, block_t=64) == (3, 2)  # two blocks of 64 keys a program
    monkeypatch.delenv(decode_attention.SPLIT_KEYS_ENV)
    assert split_plan(programs=8, span=384, sms=132, block_t=64) == (6, 1)  # the default: one
    for bad in ("8", "many", "-64"):
        monkeypatch.setenv(decode_attention.SPLIT_KEYS_ENV, bad)
        with pytest.raises(ConfigError, match="DFLASH_DECODE_ATTENTION_SPLIT_KEYS.*at least 16"):
            split_plan(programs=8, span=384, sms=132, block_t=64)


def test_tiles_that_would_overflow_shared_memory_take_fewer_stages_then_fewer_keys():
    tile_plan = decode_attention.tile_plan
    assert tile_plan(16, 128, 128, 64, skip=False) == (64, 3, 4)  # Qwen3 / Llama at batch 1: as measured
    assert tile_plan(16, 128, 128, 64, skip=True) == (64, 2, 4)
    assert tile_plan(32, 256, 256, 64, skip=False) == (64, 2, 8)  # head dim 256: two stages
    assert tile_plan(128, 256, 256, 64, skip=False) == (32, 2, 8)  # and a 64-KiB query tile: half the keys
    for block_m, d in ((16, 64), (64, 128), (128, 256)):
        t, stages, _ = tile_plan(block_m, d, d, 64, skip=False)
        assert 2 * (block_m * d + stages * t * 2 * d) <= decode_attention.SHARED_BYTES


def test_only_marked_attention_modules_on_cuda_take_the_kernel():
    layers = [nn.Module() for _ in range(3)]
    for layer in layers[:2]:
        layer.self_attn = nn.Module()
    assert decode_attention.mark_attention(layers) == 2
    q, k = torch.randn(1, 4, 1, 8, dtype=torch.bfloat16), torch.randn(1, 2, 5, 8, dtype=torch.bfloat16)
    mask = torch.ones(1, 1, 1, 5, dtype=torch.bool)
    assert not decode_attention.applies(layers[0].self_attn, q, k, k, mask)  # CPU
    assert not decode_attention.applies(nn.Module(), q, k, k, mask)  # not marked


def test_the_shapes_and_dtypes_the_kernel_takes():
    half = torch.float16
    q, k, mask = torch.randn(2, 8, 3, 16, dtype=half), torch.randn(2, 2, 7, 16, dtype=half), \
        torch.ones(2, 1, 3, 9, dtype=torch.bool)
    assert fits(q, k, k, mask)
    assert fits(q, k, torch.randn(2, 2, 7, 32, dtype=half), mask)  # V's head dim its own
    assert not fits(q.float(), k.float(), k.float(), mask)  # fp32: SDPA
    assert not fits(q, k, k, mask.half())  # an additive mask
    assert not fits(q, k, k, mask[:, :, :1])  # one mask row for 3 queries
    assert not fits(q, k, k, mask[..., :6])  # fewer mask columns than keys
    assert not fits(q, k[:1], k[:1], mask)  # a K/V batch to broadcast
    assert not fits(q, k, k[:, :1], mask)  # V of other heads
    assert not fits(torch.randn(2, 6, 3, 16, dtype=half), torch.randn(2, 4, 7, 16, dtype=half),
                    torch.randn(2, 4, 7, 16, dtype=half), mask)  # 6 query heads over 4 K/V heads
    many = torch.randn(1, 16, 16, 16, dtype=half)  # 8 heads per K/V head x 16 queries = 128 rows
    two = torch.randn(1, 2, 7, 16, dtype=half)
    assert fits(many, two, two, torch.ones(1, 1, 16, 7, dtype=torch.bool))
    more = torch.randn(1, 16, 17, 16, dtype=half)  # 136 rows: a prefill, SDPA's
    assert not fits(more, two, two, torch.ones(1, 1, 17, 7, dtype=torch.bool))
    wide = torch.randn(1, 2, 7, 512, dtype=half)
    assert not fits(torch.randn(1, 4, 1, 512, dtype=half), wide, wide, torch.ones(1, 1, 1, 7, dtype=torch.bool))


def test_a_mask_of_another_shape_is_refused_by_the_kernel_entry():
    q, k = torch.randn(1, 4, 2, 8, dtype=torch.float16), torch.randn(1, 2, 5, 8, dtype=torch.float16)
    with pytest.raises(ValueError, match="mask"):
        decode_attention.triton_decode_attention(q, k, k, torch.ones(1, 1, 1, 5, dtype=torch.bool))  # one row for 2 queries
    with pytest.raises(ValueError, match="mask"):
        decode_attention.triton_decode_attention(q, k, k, torch.ones(1, 1, 2, 4, dtype=torch.bool))  # fewer keys


def test_the_setting(monkeypatch):
    check_switch_setting(monkeypatch, ATTENTION_ENV, decode_attention.enabled)
    combine_block = lambda device: decode_attention.combine_in_kernel(device, queries=16)  # noqa: E731
    check_switch_setting(monkeypatch, decode_attention.COMBINE_ENV, combine_block)


def test_a_block_of_queries_is_combined_by_its_last_split_and_one_query_by_a_launch(monkeypatch):
    monkeypatch.delenv(decode_attention.COMBINE_ENV, raising=False)
    assert decode_attention.combine_in_kernel("cuda:0", queries=16)  # a verify pass, a drafted block
    assert decode_attention.combine_in_kernel("cuda:0", queries=2)
    assert not decode_attention.combine_in_kernel("cuda:0", queries=1)  # a decode step
    monkeypatch.setenv(decode_attention.COMBINE_ENV, "off")
    assert not decode_attention.combine_in_kernel("cuda:0", queries=16)


def _case(b, hq, hkv, nq, d, span, seed, dtype=torch.bfloat16, dev="cuda:0"):
    """q ``[B, Hq, q, D]`` (a transposed view, as transformers passes it), K/V views of a row
    storage ``[B, capacity + 1, Hkv, D]``, and a band mask: row 0 left-padded, row 1 in a
    sliding window of 40, the rest causal at random lengths."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, nq, hq, d, generator=g).to(dev, dtype).transpose(1, 2)
    store_k, store_v = (torch.randn(b, span + 9, hkv, d, generator=g).to(dev, dtype) for _ in range(2))
    k, v = store_k[:, :span].transpose(1, 2), store_v[:, :span].transpose(1, 2)
    length = torch.randint(1, span - nq + 1, (b,), generator=g)
    pos = length[:, None] + torch.arange(nq)
    lo = torch.zeros_like(pos)
    lo[0] = torch.minimum(pos[0], torch.tensor(span // 3))
    if b > 1:
        lo[1] = (pos[1] + 1 - 40).clamp_min(0)
    mask = band_mask(lo.to(dev), (pos + 1).to(dev), span + 64)[..., :span]
    return q, k, v, mask


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("b,hq,hkv,nq,d,span,splits", [
    (1, 16, 8, 1, 128, 384, None), (1, 16, 8, 1, 128, 4096, None), (1, 16, 8, 16, 128, 512, None),
    (5, 32, 8, 1, 128, 700, 1), (3, 32, 8, 16, 128, 1100, 3), (4, 8, 8, 2, 64, 300, 2), (2, 12, 4, 3, 80, 129, None),
    (17, 16, 8, 1, 128, 1024, None),  # 136 programs: the blocks no query sees are skipped
    (2, 16, 2, 16, 256, 300, None)])  # 8 heads per K/V head x 16 queries = 128 rows, head dim 256
def test_the_kernel_matches_attention_in_fp32(monkeypatch, b, hq, hkv, nq, d, span, splits):
    from dflash_ipc.decode import pdl
    q, k, v, mask = _case(b, hq, hkv, nq, d, span, seed=span + nq)
    want = gqa_attention(q.float(), k.float(), v.float(), mask).transpose(1, 2)
    got = decode_attention.triton_decode_attention(q, k, v, mask, splits=splits)
    assert got.shape == (b, nq, hq, d) and got.dtype == torch.bfloat16
    assert torch.allclose(got.float(), want, atol=2e-2, rtol=2e-2), float((got.float() - want).abs().max())
    # The splits combined by their last split and by a launch of their own: the same sums, in the same order
    last = decode_attention.triton_decode_attention(q, k, v, mask, splits=splits, combine_last=True)
    launched = decode_attention.triton_decode_attention(q, k, v, mask, splits=splits, combine_last=False)
    assert torch.equal(last, got) and torch.equal(launched, got)
    # K/V asked of L2 ahead of the wait (under PDL, where unseen blocks are not skipped): a hint only
    monkeypatch.setenv(pdl.PREFETCH_ENV, "off")
    assert torch.equal(decode_attention.triton_decode_attention(q, k, v, mask, splits=splits), got)
    monkeypatch.delenv(pdl.PREFETCH_ENV)
    scale = 0.3
    want = gqa_attention(q.float(), k.float(), v.float(), mask, scale).transpose(1, 2)
    got = torch.ops.dflash.decode_attention(q, k, v, mask, scale)
    assert torch.allclose(got.float(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@cuda
def test_fp16_a_value_head_dim_of_its_own_a_wider_mask_and_a_query_that_sees_nothing():
    q, k, v, mask = _case(3, 8, 4, 2, 64, 200, seed=2, dtype=torch.float16)
    v = torch.randn(3, 4, 200, 32, device="cuda:0", dtype=torch.float16)
    wide = torch.zeros(3, 1, 2, 256, dtype=torch.bool, device="cuda:0")
    wide[..., :200] = mask
    wide[2, 0, 1] = False  # row 2's second query sees no key
    want = gqa_attention(q.float(), k.float(), v.float(), wide[..., :200]).transpose(1, 2)
    got = decode_attention.triton_decode_attention(q, k, v, wide)
    assert got.shape == (3, 2, 8, 32) and got.dtype == torch.float16
    assert torch.equal(got[2, 1], torch.zeros_like(got[2, 1]))  # zeros where SDPA's softmax has nothing
    want[2, 1] = 0
    assert torch.allclose(got.float(), want, atol=2e-3, rtol=2e-3), float((got.float() - want).abs().max())


@pytest.mark.gpu
@cuda
def test_the_drafter_context_drafts_alike_with_the_kernel_and_with_sdpa(tiny_cache):
    from eval_helpers import random_drafter
    from dflash_ipc.decode.target import BatchedTarget
    from dflash_ipc.eval.drafter_context import DrafterContext

    target_dir = os.path.join(tiny_cache, "tiny-target")
    dev = "cuda:0"
    target = BatchedTarget(target_dir, device=dev, dtype="bfloat16")
    model = random_drafter(target_dir, seed=3, block_size=8).to(dev, torch.bfloat16)
    context = DrafterContext(model, target.head)
    assert context.kernel_attention
    g = torch.Generator().manual_seed(0)
    context.reset(num_rows=3, capacity=64)
    for row, n in enumerate((12, 30, 7)):
        pos = torch.arange(n, device=dev)[None]
        features = torch.randn(1, n, model.fc.in_features, generator=g).to(dev, torch.bfloat16)
        context.append(torch.tensor([row], device=dev), features, pos, pos)
    anchors, starts = torch.tensor([11, 22, 77], device=dev), torch.tensor([5, 29, 7], device=dev)
    got = context.draft_hidden(anchors, starts, max_start=29)  # the block's K/V written over 5.., 29.., 7..
    context.kernel_attention = False
    want = context.draft_hidden(anchors, starts, max_start=29)  # the same writes again, attended by SDPA
    torch.testing.assert_close(got.float(), want.float(), atol=5e-2, rtol=5e-2)


@pytest.mark.gpu
@cuda
def test_the_op_checks_out():
    q, k, v, mask = _case(2, 8, 4, 3, 64, 200, seed=1)
    torch.library.opcheck(torch.ops.dflash.decode_attention.default, (q, k, v, mask, 0.125))


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("rows", [1, 4])
def test_a_bf16_decode_with_the_kernel_matches_it_without(tmp_path, monkeypatch, rows):
    verdicts = decode_verdicts(tmp_path, monkeypatch, ATTENTION_ENV, rows=rows, max_prompt=300, max_new=40,
                               num_requests=8,
                               switched_on=lambda target: target.num_kernel_attention == target.num_layers)
    assert all(v in ("identical", "near_tie") for v in verdicts), verdicts
    assert verdicts.count("identical") >= len(verdicts) - 2


@pytest.mark.gpu
@cuda
def test_speculative_decoding_with_the_kernels_is_lossless_against_plain_decoding_in_bf16(tiny_cache):
    """bf16 on CUDA, every decode kernel on (attention, matrix-vector, fused projections) and the
    cycle a CUDA graph: speculative decoding gives plain decoding's tokens up to the near ties a
    16-token verify pass rounds otherwise than a one-token step (eval/lossless.py)."""
    from eval_helpers import LAYER_IDS, random_drafter
    from dflash_ipc.decode.target import BatchedTarget
    from dflash_ipc.eval.decoding import PlainDecoder, SpeculativeDecoder
    from dflash_ipc.eval.drafter_context import DrafterContext
    from dflash_ipc.eval.lossless import compare

    target_dir = os.path.join(tiny_cache, "tiny-target")
    target = BatchedTarget(target_dir, layer_ids=LAYER_IDS, device="cuda:0", dtype="bfloat16")
    assert target.num_kernel_attention == target.num_layers
    model = random_drafter(target_dir, seed=1, num_layers=1).to("cuda:0", torch.bfloat16)
    rng = np.random.default_rng(4)
    batch = [Request(key=(i, 0), prompt_ids=rng.integers(10, 1000, size=int(n)), max_new_tokens=int(m))
             for i, (n, m) in enumerate(zip(rng.integers(3, 200, size=6), rng.integers(10, 60, size=6)))]
    plain = {g.request.key: g for g in PlainDecoder(target, batch_size=3).run(RequestList(batch)).generations}
    for batch_size in (1, 3):
        context = DrafterContext(model, target.head)
        assert context.kernel_attention
        decoder = SpeculativeDecoder(target, context, batch_size=batch_size, graphs="on")
        spec = {g.request.key: g for g in decoder.run(RequestList(batch)).generations}
        assert decoder.graphs.enabled
        verdicts = [compare(spec[k], plain[k], dtype=torch.bfloat16).verdict for k in plain]
        assert all(v in ("identical", "near_tie") for v in verdicts), (batch_size, verdicts)


INTERPRETED = """
import torch
from dflash_ipc.decode import decode_attention
from dflash_ipc.decode.ragged_attention import band_mask, gqa_attention

g = torch.Generator().manual_seed(0)
for b, hq, hkv, nq, d, span, splits in ((1, 16, 8, 1, 128, 384, 3), (2, 8, 4, 16, 64, 300, 4), (1, 4, 2, 2, 64, 129, 2),
                                        (1, 4, 1, 1, 64, 576, 9)):  # 9 blocks in 9 splits: the sums in 3 rounds of 4
    # fp16: the interpreter runs on numpy, which has no bf16
    q = torch.randn(b, nq, hq, d, generator=g).half().transpose(1, 2)
    k, v = (torch.randn(b, span, hkv, d, generator=g).half().transpose(1, 2) for _ in range(2))
    pos = torch.randint(1, span - nq + 1, (b, 1), generator=g) + torch.arange(nq)
    mask = band_mask(pos // 3, pos + 1, span)
    want = gqa_attention(q.float(), k.float(), v.float(), mask).transpose(1, 2)
    last, launched, again = (decode_attention.triton_decode_attention(q, k, v, mask, splits=splits, combine_last=c)
                             for c in (True, False, True))
    assert (last.float() - want).abs().max() < 2e-3, (b, float((last.float() - want).abs().max()))
    assert torch.equal(last, launched) and torch.equal(last, again)
counts = decode_attention.SPLIT_BUFFERS.get(torch.device("cpu"), 0, 16)[1]
print("ok", int(counts.abs().sum()))
"""


@pytest.mark.skipif(decode_attention.triton is None, reason="needs Triton (its interpreter)")
def test_the_last_split_combines_as_the_combine_launch_does_in_tritons_interpreter():
    """Split spans combined by the split that counts last: SDPA's values, the combine launch's
    exactly, and every count back at 0 for the next launch (the interpreter runs the programs
    one after another, so the last program is the last split)."""
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join([os.path.dirname(__file__), *sys.path]))
    done = subprocess.run([sys.executable, "-c", INTERPRETED], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["ok", "0"]
