"""Objective: anchors, hand-checked blocks/labels/weights, chunked weighted CE."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from dflash_ipc.drafter import objective as objective_mod
from dflash_ipc.drafter.model import CudaCompiled
from dflash_ipc.drafter.objective import (
    _chunk_loss_and_grad,
    _chunk_loss_and_grad_eager,
    anchor_generator,
    block_loss_weights,
    build_training_batch,
    chunk_bounds,
    dpace_weights,
    lm_head_chunk_rows,
    sample_anchors,
    weighted_ce_sum,
)
from dflash_ipc.hf.target_head import FrozenTargetHead
from dflash_ipc.errors import DataError

torch.set_num_threads(1)

E1, E2 = 0.36787944117144233, 0.1353352832366127  # exp(-1), exp(-2)


def test_block_loss_weights_by_hand():
    assert block_loss_weights(4, 1.0).tolist() == pytest.approx([0.0, 1.0, E1, E2])
    w = block_loss_weights(16, 7.0)
    assert w[0] == 0 and w[1] == 1
    assert w[2].item() == pytest.approx(0.8668778997501817)  # exp(-1/7)
    assert w[15].item() == pytest.approx(E2)  # exp(-14/7)
    with pytest.raises(DataError):
        block_loss_weights(1, 7.0)


def test_build_training_batch_by_hand():
    # seq0: ids 10..14, loss on positions 1..3; seq1: ids 20..22, loss everywhere. bs 4, gamma 1.
    ids = torch.tensor([10, 11, 12, 13, 14, 20, 21, 22])
    lm = torch.tensor([0, 1, 1, 1, 0, 1, 1, 1], dtype=torch.bool)
    cu = torch.tensor([0, 5, 8], dtype=torch.int32)
    b = build_training_batch(ids, lm, cu, [torch.tensor([1, 2]), torch.tensor([0, 1])],
                             block_size=4, mask_token_id=99, gamma=1.0)
    M = 99
    assert b.num_anchors == 4
    assert b.block_ids.tolist() == [11, M, M, M, 12, M, M, M, 20, M, M, M, 21, M, M, M]
    assert b.block_positions.tolist() == [1, 2, 3, 4, 2, 3, 4, 5, 0, 1, 2, 3, 1, 2, 3, 4]
    want_w = [0, 1, E1, 0,   # a=1: 12 ok, 13 ok, 14 has loss_mask 0
              0, 1, 0, 0,    # a=2: 13 ok, 14 masked, position 5 beyond the end
              0, 1, E1, 0,   # a=0 in seq1: 21, 22, then beyond the end
              0, 1, 0, 0]    # a=1 in seq1: 22, then beyond
    assert b.weights.tolist() == pytest.approx(want_w)
    assert b.weights.dtype == torch.float32
    labels = b.labels.tolist()
    want_labels = {1: 12, 2: 13, 5: 13, 9: 21, 10: 22, 13: 22}
    assert {i: labels[i] for i in want_labels} == want_labels
    lay = b.layout
    assert lay.query_seq.tolist() == [0] * 8 + [1] * 8
    assert lay.query_anchor.tolist() == [1] * 4 + [2] * 4 + [0] * 4 + [1] * 4
    assert lay.query_block.tolist() == [0] * 4 + [1] * 4 + [2] * 4 + [3] * 4
    assert lay.ctx_seq.tolist() == [0, 0, 0, 0, 0, 1, 1, 1]
    assert lay.ctx_pos.tolist() == [0, 1, 2, 3, 4, 0, 1, 2]
    assert b.context_positions.tolist() == [0, 1, 2, 3, 4, 0, 1, 2]
    lay.check()


def test_build_training_batch_rejects_bad_anchors():
    ids, lm, cu = torch.arange(6), torch.ones(6, dtype=torch.bool), torch.tensor([0, 3, 6])
    with pytest.raises(DataError, match="sequence 1"):
        build_training_batch(ids, lm, cu, [torch.tensor([0]), torch.tensor([3])],
                             block_size=4, mask_token_id=0, gamma=7.0)
    with pytest.raises(DataError, match="entries"):
        build_training_batch(ids, lm, cu, [torch.tensor([0])], block_size=4, mask_token_id=0, gamma=7.0)


def test_build_training_batch_without_anchors():
    ids, lm, cu = torch.arange(6), torch.ones(6, dtype=torch.bool), torch.tensor([0, 3, 6])
    b = build_training_batch(ids, lm, cu, [torch.tensor([], dtype=torch.long)] * 2,
                             block_size=4, mask_token_id=0, gamma=7.0)
    assert b.num_anchors == 0 and b.block_ids.numel() == 0 and b.layout.num_ctx == 6


def test_sample_anchors_eligible_unique_bounded_sorted():
    gen = torch.Generator().manual_seed(0)
    mask = torch.rand(500, generator=gen) > 0.3
    eligible = {p for p in range(499) if mask[p] and mask[p + 1]}
    a = sample_anchors(mask, 40, anchor_generator(1, 0, 7))
    assert a.dtype == torch.long and len(a) == 40
    assert set(a.tolist()) <= eligible
    assert len(set(a.tolist())) == 40 and a.tolist() == sorted(a.tolist())
    everything = sample_anchors(mask.numpy(), 10_000, anchor_generator(1, 0, 7))
    assert set(everything.tolist()) == eligible
    assert sample_anchors(np.array([1, 1, 0, 1], dtype=bool), 5, anchor_generator(0, 0, 0)).tolist() == [0]
    assert sample_anchors(np.array([1]), 5, anchor_generator(0, 0, 0)).numel() == 0


def test_anchor_draws_are_reproducible_and_fresh_each_epoch():
    mask = torch.ones(2048, dtype=torch.bool)
    draw = lambda seed, epoch, sample: sample_anchors(mask, 512, anchor_generator(seed, epoch, sample)).tolist()
    assert draw(3, 0, 42) == draw(3, 0, 42)  # same key: same anchors, whatever rank or batch asks
    assert draw(3, 0, 42) != draw(3, 1, 42)  # next epoch: new anchors
    assert draw(3, 0, 42) != draw(3, 0, 43)
    assert draw(3, 0, 42) != draw(4, 0, 42)


def reference_ce_sum(hidden, head, labels, weights):
    ce = F.cross_entropy(head.logits(hidden).double(), labels, reduction="none")
    return (ce * weights).sum()


@pytest.mark.parametrize("chunk", [1, 5, 8192])
def test_weighted_ce_sum_matches_full_logits(chunk):
    gen = torch.Generator().manual_seed(0)
    head = FrozenTargetHead(torch.randn(50, 16, generator=gen, dtype=torch.float64))
    hidden = torch.randn(23, 16, generator=gen, dtype=torch.float64)
    labels = torch.randint(0, 50, (23,), generator=gen)
    weights = torch.rand(23, generator=gen, dtype=torch.float64)
    weights[[0, 4, 5, 22]] = 0
    h1 = hidden.clone().requires_grad_(True)
    h2 = hidden.clone().requires_grad_(True)
    got = weighted_ce_sum(h1, head, labels, weights, chunk_size=chunk)
    want = reference_ce_sum(h2, head, labels, weights)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
    (got / 3.0).backward()  # a scaled upstream gradient must scale the result
    (want / 3.0).backward()
    torch.testing.assert_close(h1.grad, h2.grad, rtol=1e-6, atol=1e-9)
    assert h1.grad[[0, 4, 5, 22]].abs().max() == 0


@pytest.mark.parametrize("chunk", [4, 7, 100])
def test_given_rows_a_superset_of_the_weighted_ones_give_the_same_loss_and_grad(chunk):
    gen = torch.Generator().manual_seed(1)
    head = FrozenTargetHead(torch.randn(40, 8, generator=gen, dtype=torch.float64))
    hidden = torch.randn(19, 8, generator=gen, dtype=torch.float64)
    labels = torch.randint(0, 40, (19,), generator=gen)
    weights = torch.rand(19, generator=gen, dtype=torch.float64)
    weights[[0, 3, 4, 18]] = 0
    runs = []
    for rows in (None, torch.nonzero(weights).squeeze(1), torch.arange(19), torch.arange(1, 19)):
        h = hidden.clone().requires_grad_(True)
        loss = weighted_ce_sum(h, head, labels, weights, chunk_size=chunk, rows=rows)
        loss.backward()
        runs.append((loss.detach(), h.grad))
    for loss, grad in runs[1:]:
        torch.testing.assert_close(loss, runs[0][0], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(grad, runs[0][1], rtol=1e-12, atol=1e-12)
    with pytest.raises(DataError, match="1-D"):
        weighted_ce_sum(hidden, head, labels, weights, rows=torch.zeros(2, 2, dtype=torch.long))


def test_given_rows_leave_dpace_unchanged():
    gen = torch.Generator().manual_seed(2)
    head = FrozenTargetHead(torch.randn(40, 8, generator=gen, dtype=torch.float64))
    hidden = torch.randn(20, 8, generator=gen, dtype=torch.float64)  # 5 blocks of 4
    labels = torch.randint(0, 40, (20,), generator=gen)
    weights = torch.ones(20, dtype=torch.float64)
    weights[[0, 4, 8, 12, 16, 19]] = 0  # slot 0 of every block, one past a sequence end
    runs = []
    for rows in (None, torch.nonzero(weights).squeeze(1)):
        h = hidden.clone().requires_grad_(True)
        loss = weighted_ce_sum(h, head, labels, weights, chunk_size=6, dpace=(0.5, 4), rows=rows)
        loss.backward()
        runs.append((loss.detach(), h.grad))
    torch.testing.assert_close(runs[1][0], runs[0][0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(runs[1][1], runs[0][1], rtol=1e-12, atol=1e-12)


def test_chunks_are_equal_and_as_few_as_the_budget_allows():
    assert chunk_bounds(0, 8) == []
    assert chunk_bounds(30720, 8192) == [(0, 7680), (7680, 15360), (15360, 23040), (23040, 30720)]
    assert chunk_bounds(30720, 30720) == [(0, 30720)]
    for n, m in ((1, 1), (17, 4), (100, 33), (30719, 8834)):
        bounds = chunk_bounds(n, m)
        sizes = [e - s for s, e in bounds]
        assert bounds[0][0] == 0 and bounds[-1][1] == n and all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
        assert max(sizes) <= m and len(bounds) == -(-n // m) and max(sizes) - min(sizes) < len(bounds)
    with pytest.raises(DataError):
        chunk_bounds(4, 0)
    gib = 1 << 30
    # a small vocabulary gets larger chunks from the same memory: 4 bytes per logit entry
    assert lm_head_chunk_rows(151936, 5 * gib) == 8833 and lm_head_chunk_rows(49152, 5 * gib) == 27306
    assert lm_head_chunk_rows(49152, 1.5 * gib) == 8192 and lm_head_chunk_rows(10**9, 1) == 16
    with pytest.raises(DataError):
        lm_head_chunk_rows(0, gib)


def test_training_batch_loss_rows_are_the_weighted_rows():
    ids, lm = torch.arange(20), torch.ones(20, dtype=torch.bool)
    lm[12:15] = False
    b = build_training_batch(ids, lm, torch.tensor([0, 11, 20]), [torch.tensor([1, 8]), torch.tensor([0, 5])],
                             block_size=4, mask_token_id=0, gamma=7.0)
    assert torch.equal(b.loss_rows, torch.nonzero(b.weights).squeeze(1))
    assert 0 not in b.loss_rows.tolist() and b.loss_rows.numel() < 12  # position 0, past the end, no loss
    assert torch.equal(b.to("cpu").loss_rows, b.loss_rows)


def test_weighted_ce_sum_all_zero_weights_and_no_grad():
    head = FrozenTargetHead(torch.randn(10, 4))
    hidden = torch.randn(6, 4, requires_grad=True)
    loss = weighted_ce_sum(hidden, head, torch.zeros(6, dtype=torch.long), torch.zeros(6))
    assert loss.item() == 0.0
    loss.backward()
    assert hidden.grad.abs().max() == 0
    with torch.no_grad():
        assert weighted_ce_sum(hidden, head, torch.ones(6, dtype=torch.long), torch.ones(6)).item() > 0
    with pytest.raises(DataError, match="rows"):
        weighted_ce_sum(hidden, head, torch.ones(5, dtype=torch.long), torch.ones(6))


def test_training_batch_to_device_keeps_everything():
    ids, lm, cu = torch.arange(8), torch.ones(8, dtype=torch.bool), torch.tensor([0, 8])
    b = build_training_batch(ids, lm, cu, [torch.tensor([1, 4])], block_size=4, mask_token_id=0, gamma=7.0)
    c = b.to("cpu")
    assert torch.equal(c.weights, b.weights) and torch.equal(c.layout.ctx_pos, b.layout.ctx_pos)
    assert c.num_anchors == 2 and c.layout.block_size == 4


def _ce_inputs(dtype, rows=37, vocab=300, hidden=32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    head = FrozenTargetHead((torch.randn(vocab, hidden, generator=gen) * 0.3).to(dtype))
    h = torch.randn(rows, hidden, generator=gen).to(dtype)
    labels = torch.randint(0, vocab, (rows,), generator=gen)
    weights = torch.rand(rows, generator=gen)
    weights[::5] = 0
    return head, h, labels, weights


def _reference(head, h, labels, weights):
    """Plain full-logits CE: logits in the head dtype, softmax in float32, autograd gradient."""
    h = h.clone().requires_grad_(True)
    ce = F.cross_entropy(head.logits(h).float(), labels, reduction="none")
    loss = (ce * weights).sum()
    loss.backward()
    return loss.detach(), h.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("path", ["eager", "compiled"])
def test_fused_ce_equals_full_logits_ce(monkeypatch, dtype, path):
    """Both chunk kernels (the in-place eager one, the compile-ready one through dynamo)
    give the plain CE's value and gradient, in float32 and bf16, over uneven chunks."""
    if path == "compiled":
        from torch._dynamo.testing import CompileCounterWithBackend

        torch._dynamo.reset()
        counter = CompileCounterWithBackend("aot_eager")
        fused = CudaCompiled(_chunk_loss_and_grad, dynamic_args=(0, 1, 2), backend=counter)
        monkeypatch.setattr(objective_mod, "_loss_and_grad", fused.compiled)
    head, h, labels, weights = _ce_inputs(dtype)
    want_loss, want_grad = _reference(head, h, labels, weights)
    for chunk in (8, 13, 64):  # 29 rows carry loss: chunks of 8+8+8+5, 13+13+3, 29
        hh = h.clone().requires_grad_(True)
        loss = weighted_ce_sum(hh, head, labels, weights, chunk_size=chunk)
        loss.backward()
        assert loss.dtype == torch.float32 and hh.grad.dtype == dtype
        torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-5)
        tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-3)
        torch.testing.assert_close(hh.grad, want_grad, **tol)
        assert hh.grad[::5].abs().max() == 0
    if path == "compiled":
        assert counter.frame_count == 1  # every chunk size: one dynamic graph
        torch._dynamo.reset()


def test_chunk_kernels_agree_in_bf16():
    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(11, 500, generator=gen) * 4).to(torch.bfloat16)
    labels = torch.randint(0, 500, (11,), generator=gen)
    weights = torch.rand(11, generator=gen)
    loss_a, grad_a = _chunk_loss_and_grad(logits, labels, weights)
    loss_b, grad_b = _chunk_loss_and_grad_eager(logits.clone(), labels, weights)
    assert grad_a.dtype == grad_b.dtype == torch.bfloat16
    torch.testing.assert_close(loss_a, loss_b, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad_a.float(), grad_b.float(), rtol=0, atol=1e-6)
    assert (grad_a.float().sum(-1)).abs().max() < 1e-2  # softmax - onehot sums to ~0 per row


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fused_ce_inductor_equals_full_logits_on_gpu(monkeypatch):
    head, h, labels, weights = _ce_inputs(torch.bfloat16, rows=3000, vocab=5000, hidden=64)
    head = FrozenTargetHead(head.lm_head_weight.cuda())
    h, labels, weights = h.cuda(), labels.cuda(), weights.cuda()
    want_loss, want_grad = _reference(head, h, labels, weights)
    for flag, kernel in (("1", "off"), ("0", "off"), ("1", "auto")):  # inductor, eager, drafter/ce_kernel.py
        monkeypatch.setenv("DFLASH_COMPILE", flag)
        monkeypatch.setenv("DFLASH_CE_KERNEL", kernel)
        for chunk in (1024, 700):
            hh = h.clone().requires_grad_(True)
            with torch.autocast("cuda", dtype=torch.bfloat16):  # as the trainer calls it
                loss = weighted_ce_sum(hh, head, labels, weights, chunk_size=chunk)
            loss.backward()
            torch.testing.assert_close(loss, want_loss, rtol=1e-4, atol=1e-3)
            torch.testing.assert_close(hh.grad, want_grad, rtol=2e-2, atol=2e-3)
            with torch.no_grad():
                value = weighted_ce_sum(h, head, labels, weights, chunk_size=chunk)
            torch.testing.assert_close(value, want_loss, rtol=1e-4, atol=1e-3)


def brute_force_dpace(q: list[float], valid: list[bool], alpha: float) -> list[float]:
    """D-PACE's Eq. 7/8 written out: w_k = sum over valid m >= k of prod over valid i <= m of q~_i."""
    smooth = [(1 - alpha) * x + alpha for x in q]
    out = []
    for k in range(len(q)):
        if not valid[k]:
            out.append(0.0)
            continue
        total = 0.0
        for m in range(k, len(q)):
            if valid[m]:
                total += math.prod(smooth[i] for i in range(m + 1) if valid[i])
        out.append(total)
    return out


def test_dpace_weights_by_hand():
    # The memo's case: alpha 0.5, slots 1..3 with q = 0.9, 0.5, 0.2 (slot 0, the anchor, untrained):
    # q~ = 0.95, 0.75, 0.6; C = 0.95, 0.7125, 0.4275; w = C_k + later C = 2.09, 1.14, 0.4275.
    ce = -torch.log(torch.tensor([[1.0, 0.9, 0.5, 0.2]], dtype=torch.float64))
    valid = torch.tensor([[False, True, True, True]])
    w = dpace_weights(ce, valid, alpha=0.5)
    assert w.tolist()[0] == pytest.approx([0.0, 2.09, 1.14, 0.4275], abs=1e-12)
    assert float((w * ce).sum()) == pytest.approx(1.6984, abs=1e-4)
    # A slot without a label in the middle is a factor 1 in the products and no term of the sums.
    q = [0.3, 0.8, 0.6, 0.1, 0.7]
    valid = [False, True, False, True, True]
    got = dpace_weights(-torch.log(torch.tensor([q], dtype=torch.float64)), torch.tensor([valid]), alpha=0.3)
    assert got.tolist()[0] == pytest.approx(brute_force_dpace(q, valid, 0.3), abs=1e-12)
    assert got[0, 2] == 0 and got[0, 1] > got[0, 3] > got[0, 4] > 0
    # alpha 1: every q~ is 1, so w_k counts the valid slots from k on (linear weights).
    assert dpace_weights(torch.rand(1, 5), torch.tensor([valid]), 1.0).tolist()[0] == [0, 3, 0, 2, 1]
    with pytest.raises(DataError, match=r"alpha=0.0 must be in \(0, 1\]"):
        dpace_weights(ce, valid=torch.tensor([[True] * 4]), alpha=0.0)


def test_dpace_batch_weights_mark_the_valid_slots():
    ids, lm, cu = torch.arange(10), torch.ones(10, dtype=torch.bool), torch.tensor([0, 10])
    lm[8] = False  # a label without loss
    b = build_training_batch(ids, lm, cu, [torch.tensor([1, 7])], block_size=4, mask_token_id=0, gamma=7.0,
                             weighting="dpace")
    assert b.weights.view(2, 4).tolist() == [[0, 1, 1, 1], [0, 0, 1, 0]]  # slot 0; pos 8 masked; 10 outside
    with pytest.raises(DataError, match="weighting 'uniform' is not one of"):
        build_training_batch(ids, lm, cu, [torch.tensor([1])], block_size=4, mask_token_id=0, gamma=7.0,
                             weighting="uniform")


@pytest.mark.parametrize("chunk", [3, 64])
def test_weighted_ce_sum_with_dpace_is_the_formula_and_its_gradient(chunk):
    """Value: sum of w * CE with w from the brute-force formula on the rows' own CE; gradient:
    autograd of the same sum with w held constant (w is detached in D-PACE)."""
    gen = torch.Generator().manual_seed(5)
    head = FrozenTargetHead(torch.randn(40, 16, generator=gen, dtype=torch.float64))
    blocks, bs = 5, 4
    hidden = torch.randn(blocks * bs, 16, generator=gen, dtype=torch.float64)
    labels = torch.randint(0, 40, (blocks * bs,), generator=gen)
    weights = torch.ones(blocks, bs, dtype=torch.float64)
    weights[:, 0] = 0
    weights[2, 2:] = 0  # a block cut by the sequence end
    weights = weights.reshape(-1)
    h1, h2 = hidden.clone().requires_grad_(True), hidden.clone().requires_grad_(True)
    got = weighted_ce_sum(h1, head, labels, weights, chunk_size=chunk, dpace=(0.4, bs))
    ce = F.cross_entropy(head.logits(h2), labels, reduction="none")
    w = torch.tensor([x for b in range(blocks) for x in brute_force_dpace(
        torch.exp(-ce.detach()).view(blocks, bs)[b].tolist(), (weights.view(blocks, bs)[b] > 0).tolist(), 0.4)],
        dtype=torch.float64)
    want = (w * ce).sum()
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
    got.backward()
    want.backward()
    torch.testing.assert_close(h1.grad, h2.grad, rtol=1e-6, atol=1e-9)
    assert h1.grad.view(blocks, bs, -1)[:, 0].abs().max() == 0
    with torch.no_grad():
        torch.testing.assert_close(weighted_ce_sum(hidden, head, labels, weights, chunk_size=chunk, dpace=(0.4, bs)),
                                   want.detach(), rtol=1e-9, atol=1e-9)
    with pytest.raises(DataError, match="not whole blocks of 3"):
        weighted_ce_sum(hidden, head, labels, weights, dpace=(0.4, 3))


def test_dpace_config_keys_are_checked():
    from dflash_ipc.config.load import load_config
    from dflash_ipc.errors import ConfigError
    assert load_config(None, ["objective.weighting=dpace"]).objective.dpace_alpha == 0.5
    with pytest.raises(ConfigError, match="objective.dpace_alpha: must be in"):
        load_config(None, ["objective.dpace_alpha=1.5"])
    for head in ("all", "grad"):  # D-PACE's per-row CE has no float8 path: an explicit fp8 head is refused
        with pytest.raises(ConfigError, match=f"set drafter.fp8_lm_head to none or auto \\(got {head}\\)"):
            load_config(None, ["objective.weighting=dpace", "drafter.precision=fp8", f"drafter.fp8_lm_head={head}"])
    for head in ("none", "auto"):
        assert load_config(None, ["objective.weighting=dpace", "drafter.precision=fp8", f"drafter.fp8_lm_head={head}"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_dpace_compiled_on_gpu_equals_the_eager_pass(monkeypatch):
    """D-PACE's per-row CE and gradient kernels through inductor and drafter/ce_kernel.py (bf16 logits,
    as the trainer runs them under autocast) against the same pass eager, and against float32 on the CPU."""
    head, h, labels, _ = _ce_inputs(torch.bfloat16, rows=64 * 16, vocab=5000, hidden=64)
    weights = torch.ones(64, 16)
    weights[:, 0] = 0
    weights[5, 9:] = 0
    weights = weights.reshape(-1)
    cpu_h = h.float().clone().requires_grad_(True)
    want = weighted_ce_sum(cpu_h, FrozenTargetHead(head.lm_head_weight.float()), labels, weights, dpace=(0.5, 16))
    want.backward()
    gpu_head = FrozenTargetHead(head.lm_head_weight.cuda())
    for flag, kernel in (("1", "off"), ("0", "off"), ("1", "auto")):  # inductor, eager, drafter/ce_kernel.py
        monkeypatch.setenv("DFLASH_COMPILE", flag)
        monkeypatch.setenv("DFLASH_CE_KERNEL", kernel)
        hh = h.cuda().clone().requires_grad_(True)
        got = weighted_ce_sum(hh, gpu_head, labels.cuda(), weights.cuda(), chunk_size=300, dpace=(0.5, 16))
        got.backward()
        torch.testing.assert_close(got.cpu(), want.detach(), rtol=2e-2, atol=1e-2)
        torch.testing.assert_close(hh.grad.float().cpu(), cpu_h.grad, rtol=5e-2, atol=5e-3)
