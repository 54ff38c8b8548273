"""The drafter's block and context append through the fused ops (eval/drafter_context.py): on CPU
(the ops' torch code, float32) the values and cache contents of the unfused path bit for bit; on
CUDA in bf16 (the kernels) the same drafts up to rounding, and lossless speculative decoding."""

import numpy as np
import pytest
import torch

from dflash_ipc.decode.requests import Request, RequestList
from dflash_ipc.decode.row_cache import RowKV
from dflash_ipc.decode.target import BatchedTarget
from dflash_ipc.errors import ConfigError, DataError
from dflash_ipc.eval import drafter_context
from dflash_ipc.eval.drafter_context import FUSE_DRAFTER_ENV, DrafterContext
from eval_helpers import LAYER_IDS, random_drafter

torch.set_num_threads(1)


def _context(monkeypatch, model, head, setting: str) -> DrafterContext:
    monkeypatch.setenv(FUSE_DRAFTER_ENV, setting)
    return DrafterContext(model, head)


def _fill(context: DrafterContext, feats: torch.Tensor, pieces: list[int]) -> None:
    """Row 0's context from ``feats`` ``[T, F]`` appended in pieces of the given sizes."""
    lo = 0
    for size in pieces:
        pos = torch.arange(lo, lo + size)[None]
        context.append(torch.tensor([0]), feats[None, lo: lo + size], pos, pos)
        lo += size


@pytest.mark.parametrize("window", [None, 6])
def test_fused_blocks_and_appends_equal_the_unfused_ones(monkeypatch, target_dir, legacy, window):
    """float32 on CPU: a block drafted through the fused ops gives the unfused path's logits and
    hidden states, and the appends (pieces of up to 16 rows fused, a longer prefill not) and the
    block write the same K/V into the cache, bit for bit; also with a sliding_attention layer."""
    kinds = None if window is None else ["sliding_attention", "full_attention"]
    model = random_drafter(target_dir, seed=5, block_size=8, num_layers=2, layer_types=kinds, sliding_window=window)
    rng = np.random.default_rng(2)
    feats = legacy.prefill(torch.as_tensor(rng.integers(10, 1000, size=45)))[1]
    results = {}
    for setting in ("off", "on"):
        context = _context(monkeypatch, model, legacy.head, setting)
        calls, writes = [], []
        fused_layer = context._fused_layer
        monkeypatch.setattr(context, "_fused_layer", lambda *a, **k: calls.append(1) or fused_layer(*a, **k))
        context.reset(num_rows=1, capacity=64)
        write = context.kv.write  # the unfused path's cache writes (the fused one writes in qk_rope_write)
        monkeypatch.setattr(context.kv, "write", lambda *a, **k: writes.append(a[0]) or write(*a, **k))
        _fill(context, feats, [20, 8, 16, 1])  # the 20-row prefill is past the fused rows: unfused either way
        appended = len(writes)
        anchors, starts = torch.tensor([123]), torch.tensor([45])
        logits = context.draft_logits(anchors, starts, max_start=45)
        hidden = context.draft_hidden(anchors, starts, max_start=45)
        caches = [t.clone() for t in context.kv.keys + context.kv.values]
        results[setting] = (logits, hidden, caches)
        assert context.fused == (setting == "on")
        assert len(calls) == (2 * len(model.layers) if setting == "on" else 0)  # two blocks (logits, hidden)
        assert appended == (1 if setting == "on" else 4) * len(model.layers)  # fused: the 20-row prefill only
        assert len(writes) == appended + (0 if setting == "on" else 2 * len(model.layers))
    (l_off, h_off, c_off), (l_on, h_on, c_on) = results["off"], results["on"]
    assert l_on.shape == (1, 7, legacy.head.lm_head_weight.shape[0])
    assert torch.equal(l_on, l_off) and torch.equal(h_on, h_off)
    assert all(torch.equal(a, b) for a, b in zip(c_on, c_off))


def test_blocks_of_more_rows_than_the_fused_limit_run_unfused(monkeypatch, target_dir, legacy):
    model = random_drafter(target_dir, seed=6, block_size=8, num_layers=1)
    monkeypatch.setenv("DFLASH_DECODE_FUSE_LAYER_ROWS", "4")
    context = _context(monkeypatch, model, legacy.head, "on")
    monkeypatch.setattr(context, "_fused_layer", lambda *a, **k: pytest.fail("fused past the row limit"))
    context.reset(num_rows=1, capacity=32)
    feats = legacy.prefill(torch.arange(10, 20))[1]
    _fill(context, feats, [10])
    assert context.draft_logits(torch.tensor([3]), torch.tensor([10]), max_start=10).shape[1] == 7


def test_the_switch_and_what_auto_asks_for(monkeypatch, target_dir):
    monkeypatch.setenv(FUSE_DRAFTER_ENV, "sometimes")
    with pytest.raises(ConfigError, match="DFLASH_DECODE_FUSE_DRAFTER.*allowed"):
        drafter_context.fused_drafter_enabled("cpu", torch.bfloat16, 64)
    monkeypatch.setenv(FUSE_DRAFTER_ENV, "auto")
    assert not drafter_context.fused_drafter_enabled("cpu", torch.bfloat16, 64)  # auto: CUDA only
    monkeypatch.setenv(FUSE_DRAFTER_ENV, "on")
    assert drafter_context.fused_drafter_enabled("cpu", torch.float32, 48)
    if torch.cuda.is_available():  # auto: what the kernels take, half dtypes and a head dim of a power of 2
        monkeypatch.setenv(FUSE_DRAFTER_ENV, "auto")
        assert drafter_context.fused_drafter_enabled("cuda:0", torch.bfloat16, 64)
        assert not drafter_context.fused_drafter_enabled("cuda:0", torch.float32, 64)
        assert not drafter_context.fused_drafter_enabled("cuda:0", torch.bfloat16, 48)
    model = random_drafter(target_dir, seed=7, num_layers=2).to(torch.bfloat16)
    assert drafter_context.drafter_fusable(model)
    model.layers[1].post_attention_layernorm.float()  # a norm the fused ops would not keep in bf16
    assert not drafter_context.drafter_fusable(model)


def test_k_and_v_alone_through_the_rotary_op():
    """qk_rope_write with no query heads (a context append) writes the k and v that a call with
    query heads writes, and returns an empty query."""
    from dflash_ipc.decode import qk_rope  # noqa: F401 - registers the op

    torch.manual_seed(0)
    hq, hkv, d, q = 4, 2, 8, 3
    qkv = torch.randn(1, q, (hq + 2 * hkv) * d)
    cos, sin = torch.randn(1, q, d), torch.randn(1, q, d)
    qw, kw = torch.randn(d), torch.randn(d)
    rows, pos = torch.tensor([1]), torch.tensor([[4, 5, 7]])
    full = [torch.zeros(2, 9, hkv, d) for _ in range(2)]
    alone = [torch.zeros(2, 9, hkv, d) for _ in range(2)]
    torch.ops.dflash.qk_rope_write(qkv, cos, sin, qw, kw, 1e-6, *full, rows, pos, hq, hkv)
    query = torch.ops.dflash.qk_rope_write(qkv[..., hq * d:], cos, sin, kw, kw, 1e-6, *alone, rows, pos, 0, hkv)
    assert query.shape == (1, 0, q, d)
    assert all(torch.equal(a, b) for a, b in zip(full, alone)) and full[0][1, 4].abs().sum() > 0


def test_row_storage_hands_out_its_layers_and_refuses_another_layout():
    kv = RowKV(num_layers=2, num_rows=2, capacity=10)
    keys, values = kv.storage(1, 3, 8, torch.float32, torch.device("cpu"))
    assert keys.shape == (2, 17, 3, 8) and not keys.any() and values.shape == keys.shape  # capacity rounded to 16
    assert kv.storage(1, 3, 8, torch.float32, torch.device("cpu"))[0] is keys
    kv.write(0, torch.tensor([0]), torch.tensor([[2]]), torch.ones(1, 1, 3, 8), torch.ones(1, 1, 3, 8))
    assert kv.storage(0, 3, 8, torch.float32, torch.device("cpu"))[0][0, 2].eq(1).all()
    with pytest.raises(DataError, match=r"layer 1 holds \(3, 8\) torch.float32.*asked for \(4, 8\)"):
        kv.storage(1, 4, 8, torch.float32, torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bf16_fused_drafts_match_and_decoding_stays_lossless(monkeypatch, target_dir):
    """bf16 on CUDA (the kernels): the fused block's logits are the unfused ones' up to bf16
    rounding (the kernels round as the eager forward does, the unfused path's compiled functions
    once) and their argmax mostly agrees; graphed speculative decoding with the fused drafter
    gives plain decoding's tokens (or a near-tie, lossless.compare)."""
    from dflash_ipc.eval.decoding import PlainDecoder, SpeculativeDecoder
    from dflash_ipc.eval.lossless import compare

    cuda = BatchedTarget(target_dir, layer_ids=LAYER_IDS, device="cuda:0", dtype="bfloat16")
    model = random_drafter(target_dir, seed=1, block_size=16, num_layers=2).to("cuda:0", torch.bfloat16)
    rng = np.random.default_rng(3)
    prompt = torch.as_tensor(rng.integers(10, 1000, size=40), device="cuda:0")
    torch.manual_seed(0)
    feats = torch.randn(1, 40, model.fc.weight.shape[1], device="cuda:0", dtype=torch.bfloat16)
    out = {}
    for setting in ("off", "on"):
        context = _context(monkeypatch, model, cuda.head, setting)
        assert context.fused == (setting == "on")
        context.reset(num_rows=1, capacity=64)
        for lo in range(0, 40, 16):
            pos = torch.arange(lo, min(lo + 16, 40), device="cuda:0")[None]
            context.append(torch.tensor([0], device="cuda:0"), feats[:, lo: lo + 16], pos, pos)
        anchors, starts = prompt[-1:], torch.tensor([40], device="cuda:0")
        out[setting] = (context.draft_logits(anchors, starts, max_start=40).float(),
                        [t[:, :57].float().clone() for t in context.kv.keys + context.kv.values])
    (l_off, c_off), (l_on, c_on) = out["off"], out["on"]
    scale = l_off.abs().max()
    assert (l_on - l_off).abs().max() <= 0.05 * scale
    assert (l_on.argmax(-1) == l_off.argmax(-1)).float().mean() >= 0.8
    for a, b in zip(c_on, c_off):
        torch.testing.assert_close(a, b, atol=0.05, rtol=0.05)

    requests = [Request(key=(i, 0), prompt_ids=rng.integers(10, 1000, size=n), max_new_tokens=24)
                for i, n in enumerate((5, 17, 33))]
    plain = {g.request.key: g for g in PlainDecoder(cuda, batch_size=1).run(RequestList(requests)).generations}
    monkeypatch.setenv(FUSE_DRAFTER_ENV, "auto")
    decoder = SpeculativeDecoder(cuda, DrafterContext(model, cuda.head), batch_size=1, graphs="on")
    assert decoder.drafter.fused
    for gen in decoder.run(RequestList(requests)).generations:
        assert compare(gen, plain[gen.request.key], dtype=torch.bfloat16).verdict in ("identical", "near_tie")
    assert decoder.graphs.enabled and decoder.graphs.num_captures >= 1  # the fused cycle was captured


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_rotary_kernel_writes_k_and_v_alone_and_nothing_outside_the_storage():
    """The kernel (bf16, CUDA) with no query heads writes exactly the k and v of a call with them;
    rows and positions outside the storage are not written."""
    from dflash_ipc.decode import qk_rope

    torch.manual_seed(0)
    dev, dt, hq, hkv, d, q = "cuda:0", torch.bfloat16, 16, 8, 128, 16
    qkv = torch.randn(2, q, (hq + 2 * hkv) * d, device=dev, dtype=dt)
    angles = torch.rand(2, q, d, device=dev) * 6.3
    cos, sin = angles.cos().to(dt), angles.sin().to(dt)
    qw, kw = (1 + 0.2 * torch.randn(d, device=dev)).to(dt), (1 + 0.2 * torch.randn(d, device=dev)).to(dt)
    rows, pos = torch.tensor([1, 0], device=dev), torch.arange(q, device=dev)[None].repeat(2, 1) + 3
    full, alone = ([torch.zeros(3, 33, hkv, d, device=dev, dtype=dt) for _ in range(2)] for _ in range(2))
    qk_rope.triton_qk_rope_write(qkv, cos, sin, qw, kw, 1e-6, *full, rows, pos, hq, hkv)
    qk_rope.triton_qk_rope_write(qkv[..., hq * d:].contiguous(), cos, sin, kw, kw, 1e-6, *alone, rows, pos, 0, hkv)
    assert all(torch.equal(a, b) for a, b in zip(full, alone)) and full[0][1, 3].abs().sum() > 0
    before = [t.clone() for t in full]
    outside = torch.tensor([[40] * q, [-1] * q], device=dev)  # past capacity + 1 (33), negative
    qk_rope.triton_qk_rope_write(qkv, cos, sin, qw, kw, 1e-6, *full, rows, outside, hq, hkv)
    qk_rope.triton_qk_rope_write(qkv, cos, sin, qw, kw, 1e-6, *full, torch.tensor([3, 7], device=dev), pos, hq, hkv)
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(full, before))
