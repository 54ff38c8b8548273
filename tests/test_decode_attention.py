"""decode/decode_attention.py: attention of a few queries per row over the row's cached keys.

On CPU: how a span is split, which calls take the kernel (marked modules, CUDA, half dtypes,
few query rows), the setting. On CUDA (marked gpu): the kernel against ``gqa_attention`` in
fp32 over ragged band masks (left padding, a sliding window, rows of other lengths), grouped
heads of 1, 2 and 4 queries per K/V head, one query and a verify block, one program per row
and a span split over several, non-contiguous cache views; the op's schema; and a bf16
target's decode with the kernel against the same target without it, compiled and captured
(eval/lossless.py's near-tie rule: the kernel sums in another order than cuDNN)."""

import numpy as np
import pytest
import torch
from torch import nn

from dflash_ipc.bench.assets import build_random_target
from dflash_ipc.decode import decode_attention
from dflash_ipc.decode.decode_attention import ATTENTION_ENV, KEYS_PER_SPLIT, num_splits
from dflash_ipc.decode.engine import DecodeEngine, EngineSettings
from dflash_ipc.decode.ragged_attention import band_mask, gqa_attention
from dflash_ipc.decode.requests import Request, RequestList
from dflash_ipc.errors import ConfigError

cuda = pytest.mark.skipif(not (torch.cuda.is_available() and decode_attention.triton is not None),
                          reason="needs CUDA and Triton")


def test_a_span_is_split_only_where_programs_are_few_and_keys_many():
    assert num_splits(programs=4096, span=4096, sms=132) == 1  # 512 rows x 8 heads fill the GPU
    assert num_splits(programs=8, span=KEYS_PER_SPLIT, sms=132) == 1  # one split's worth of keys
    assert num_splits(programs=8, span=4 * KEYS_PER_SPLIT + 1, sms=132) == 5
    assert num_splits(programs=8, span=10 ** 6, sms=132) == 17  # about one program per SM


def test_only_marked_attention_modules_on_cuda_take_the_kernel():
    layers = [nn.Module() for _ in range(3)]
    for layer in layers[:2]:
        layer.self_attn = nn.Module()
    assert decode_attention.mark_attention(layers) == 2
    q, k = torch.randn(1, 4, 1, 8, dtype=torch.bfloat16), torch.randn(1, 2, 5, 8, dtype=torch.bfloat16)
    mask = torch.ones(1, 1, 1, 5, dtype=torch.bool)
    assert not decode_attention.applies(layers[0].self_attn, q, k, k, mask)  # CPU
    assert not decode_attention.applies(nn.Module(), q, k, k, mask)  # not marked


def test_a_mask_of_another_shape_is_refused_by_the_kernel_entry():
    q, k = torch.randn(1, 4, 2, 8, dtype=torch.float16), torch.randn(1, 2, 5, 8, dtype=torch.float16)
    with pytest.raises(ValueError, match="mask"):
        decode_attention.triton_decode_attention(q, k, k, torch.ones(1, 1, 1, 5, dtype=torch.bool))  # one row for 2 queries
    with pytest.raises(ValueError, match="mask"):
        decode_attention.triton_decode_attention(q, k, k, torch.ones(1, 1, 2, 4, dtype=torch.bool))  # fewer keys


def test_the_setting(monkeypatch):
    monkeypatch.setenv(ATTENTION_ENV, "sometimes")
    with pytest.raises(ConfigError, match="DFLASH_DECODE_ATTENTION.*auto"):
        decode_attention.enabled("cuda:0")
    monkeypatch.setenv(ATTENTION_ENV, "off")
    assert not decode_attention.enabled("cuda:0")
    monkeypatch.delenv(ATTENTION_ENV)
    assert not decode_attention.enabled("cpu")


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
    (5, 32, 8, 1, 128, 700, 1), (3, 32, 8, 16, 128, 1100, 3), (4, 8, 8, 2, 64, 300, 2), (2, 12, 4, 3, 80, 129, None)])
def test_the_kernel_matches_attention_in_fp32(b, hq, hkv, nq, d, span, splits):
    q, k, v, mask = _case(b, hq, hkv, nq, d, span, seed=span + nq)
    want = gqa_attention(q.float(), k.float(), v.float(), mask).transpose(1, 2)
    got = decode_attention.triton_decode_attention(q, k, v, mask, splits=splits)
    assert got.shape == (b, nq, hq, d) and got.dtype == torch.bfloat16
    assert torch.allclose(got.float(), want, atol=2e-2, rtol=2e-2), float((got.float() - want).abs().max())
    scale = 0.3
    want = gqa_attention(q.float(), k.float(), v.float(), mask, scale).transpose(1, 2)
    got = torch.ops.dflash.decode_attention(q, k, v, mask, scale)
    assert torch.allclose(got.float(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@cuda
def test_the_op_checks_out():
    q, k, v, mask = _case(2, 8, 4, 3, 64, 200, seed=1)
    torch.library.opcheck(torch.ops.dflash.decode_attention.default, (q, k, v, mask, 0.125))


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("rows", [1, 4])
def test_a_bf16_decode_with_the_kernel_matches_it_without(tmp_path, monkeypatch, rows):
    from dflash_ipc.decode.target import BatchedTarget
    from dflash_ipc.eval.lossless import compare

    path = str(tmp_path / "target")
    build_random_target(path, shape="tiny", dtype="bfloat16", num_layers=2, seed=5)
    rng = np.random.default_rng(0)
    batch = [Request(key=(i, 0), prompt_ids=rng.integers(10, 1000, size=int(rng.integers(3, 300))),
                     max_new_tokens=int(rng.integers(1, 40))) for i in range(8)]
    runs = {}
    for setting in ("off", "auto"):
        monkeypatch.setenv(ATTENTION_ENV, setting)
        torch._dynamo.reset()
        target = BatchedTarget(path, device="cuda:0", dtype="bfloat16")
        assert (target.num_kernel_attention == target.num_layers) == (setting == "auto")
        engine = DecodeEngine(target, settings=EngineSettings(max_rows=rows, check_every=3, compile="on",
                                                              keep_margins=True))
        runs[setting] = {g.request.key: g for g in engine.run(RequestList(batch)).generations}
        assert engine.graphs.enabled and not target._compiled_extend.failed
    verdicts = [compare(runs["auto"][k], runs["off"][k], dtype=torch.bfloat16).verdict for k in runs["off"]]
    assert all(v in ("identical", "near_tie") for v in verdicts), verdicts
    assert verdicts.count("identical") >= len(verdicts) - 2
    torch._dynamo.reset()
