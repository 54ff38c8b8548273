"""The shapes a drafter step runs at (step_shape.py): few context buckets, the job's largest
step as a high-water mark, padding keys no query sees and filler blocks that change no real
row's output, loss, gradient or acceptance count."""

import logging

import pytest
import torch

from dflash_ipc.config.load import config_from_dict
from dflash_ipc.drafter import attention as att
from dflash_ipc.drafter.objective import build_training_batch
from dflash_ipc.drafter.step_shape import StepRows, context_bucket, pad_blocks, pad_layout, pad_rows
from dflash_ipc.drafter.trainer import DrafterTrainer
from tests.test_drafter_trainer import head, model_config, sequences

torch.set_num_threads(1)


def test_context_buckets_are_few_and_pad_by_at_most_half():
    assert [context_bucket(n) for n in (0, 1, 1024, 1025, 1536, 1537, 2048, 2049, 8192, 8193)] == [
        1024, 1024, 1024, 1536, 1536, 2048, 2048, 3072, 8192, 12288]
    sizes = {context_bucket(n) for n in range(1, 65537, 37)}
    assert len(sizes) == 13  # 1K..64K: two per octave
    assert all(n <= context_bucket(n) <= max(1024, 1.5 * n) for n in range(1, 20000, 7))
    with pytest.raises(ValueError):
        context_bucket(-1)


def test_step_rows_are_the_largest_the_job_has_run(caplog):
    rows = StepRows()
    with caplog.at_level(logging.INFO, logger="dflash_ipc.drafter.step_shape"):
        got = [rows.pad(c, q) for c, q in ((5000, 64), (900, 64), (7000, 64), (6000, 32), (3000, 64))]
    assert got == [(6144, 64), (6144, 64), (8192, 64), (8192, 64), (8192, 64)]
    grown = [r.getMessage() for r in caplog.records if "outgrows" in r.getMessage()]
    assert len(grown) == 1 and "8192 x 64" in grown[0]  # the first step sets the marks, without a line
    assert rows.pad(100, 80) == (8192, 80)


def _layout_and_mask_case():
    lengths, anchors = [11, 7], [torch.tensor([2, 5, 8]), torch.tensor([0, 4])]
    cu = torch.tensor([0, 11, 18], dtype=torch.int32)
    ids = torch.randint(0, 50, (18,), generator=torch.Generator().manual_seed(0))
    batch = build_training_batch(ids, torch.ones(18, dtype=torch.bool), cu, anchors, block_size=4,
                                 mask_token_id=63, gamma=7.0)
    return batch, lengths


def test_padding_keys_are_seen_by_no_query_dense_and_flex():
    batch, _ = _layout_and_mask_case()
    layout = batch.layout
    padded = pad_layout(layout, 40)
    assert padded.num_ctx == 40 and padded.num_queries == layout.num_queries
    dense, dense_padded = att.dense_mask(layout), att.dense_mask(padded)
    t = layout.num_ctx
    assert not dense_padded[:, t:40].any()  # the padding keys
    assert torch.equal(dense_padded[:, :t], dense[:, :t]) and torch.equal(dense_padded[:, 40:], dense[:, t:])
    bm = att.flex_block_mask(padded)  # the flex builder's tiles agree with the padded dense mask
    partial, full = att.flex_tile_flags(padded)
    want = torch.zeros(-(-padded.num_queries // 128), -(-(40 + padded.num_queries) // 128), dtype=torch.bool)
    want[0, 0] = True
    assert torch.equal(partial | full, want) and bm.shape[-1] == 40 + padded.num_queries
    windowed, windowed_padded = att.dense_mask(layout, 3), att.dense_mask(padded, 3)  # a sliding layer's
    assert not windowed_padded[:, t:40].any() and torch.equal(windowed_padded[:, 40:], windowed[:, t:])
    assert torch.equal(windowed_padded[:, :t], windowed[:, :t])
    assert pad_layout(layout, t) is layout
    with pytest.raises(ValueError):
        pad_layout(layout, t - 1)


def test_padded_context_gives_the_same_outputs_and_gradients():
    batch, _ = _layout_and_mask_case()
    torch.manual_seed(0)
    from dflash_ipc.drafter.model import DFlashDraftModel
    model = DFlashDraftModel(model_config())
    features = torch.randn(batch.layout.num_ctx, 64)
    embeds = torch.randn(batch.layout.num_queries, 32)
    runs = []
    for rows in (batch.layout.num_ctx, 31):
        model.zero_grad(set_to_none=True)
        mask = att.build_mask(pad_layout(batch.layout, rows), "dense")
        out = model(pad_rows(features, rows), pad_rows(batch.layout.ctx_pos.long(), rows), embeds,
                    batch.block_positions, mask)
        (out.square() * torch.arange(out.numel()).view_as(out)).sum().backward()
        runs.append((out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    torch.testing.assert_close(runs[1][0], runs[0][0], rtol=1e-5, atol=1e-6)
    for name, grad in runs[0][1].items():
        torch.testing.assert_close(runs[1][1][name], grad, rtol=1e-5, atol=1e-5, msg=name)  # sums reordered


def test_filler_blocks_see_only_their_own_keys_and_carry_no_weight():
    batch, _ = _layout_and_mask_case()
    padded = pad_blocks(batch, batch.layout.num_queries + 8, mask_token_id=63)
    q, t = batch.layout.num_queries, batch.layout.num_ctx
    assert padded.num_anchors == batch.num_anchors and torch.equal(padded.loss_rows, batch.loss_rows)
    assert not padded.weights[q:].any() and torch.equal(padded.block_ids[q:], torch.full((8,), 63))
    assert torch.equal(padded.block_positions[q:], torch.tensor([0, 1, 2, 3] * 2))
    dense, dense_padded = att.dense_mask(batch.layout), att.dense_mask(padded.layout)
    assert torch.equal(dense_padded[:q, :t + q], dense)  # real queries: as before, no filler key
    assert not dense_padded[:q, t + q:].any()
    own = torch.zeros(8, t + q + 8, dtype=torch.bool)
    own[:4, t + q:t + q + 4] = own[4:, t + q + 4:] = True
    assert torch.equal(dense_padded[q:], own)  # fillers: their own block, nothing else
    partial, full = att.flex_tile_flags(padded.layout)
    assert torch.equal(partial | full, torch.ones(1, 1, dtype=torch.bool))
    assert pad_blocks(batch, q, 63) is batch
    for bad in (q - 4, q + 3):
        with pytest.raises(ValueError, match="whole blocks"):
            pad_blocks(batch, bad, 63)


@pytest.mark.parametrize("weighting", ["decay", "dpace"])
def test_filler_blocks_change_no_loss_gradient_or_acceptance(weighting):
    from dflash_ipc.drafter.acceptance_proxy import block_acceptance_totals
    cfg = config_from_dict({"drafter": {"num_workers": 1, "dtype": "float32", "attention": "dense"},
                            "objective": {"weighting": weighting, "anchors_per_step": 12, "max_anchors_per_seq": 6}})
    trainer = DrafterTrainer(cfg, model_config(), head(), device="cpu", total_steps=2)
    chosen = [(s, s.num_anchors) for s in sequences(3, seed=5)]
    batch, features, mask, _ = trainer._build(chosen)
    config = trainer.model.config
    runs = []
    for extra in (0, 3 * config.block_size):
        trainer.model.zero_grad(set_to_none=True)
        b = pad_blocks(batch, batch.layout.num_queries + extra, config.mask_token_id)
        m = att.build_layer_masks(b.layout, "dense", config.layer_types, config.sliding_window)
        loss, totals = trainer.loss_sum(b, features, m, acceptance=True)
        loss.backward()
        runs.append((loss.detach(), totals, {n: p.grad.clone() for n, p in trainer.model.named_parameters()}))
    torch.testing.assert_close(runs[1][0], runs[0][0], rtol=1e-6, atol=1e-6)
    assert torch.equal(runs[1][1], runs[0][1]) and runs[0][1][0] > 0
    for name, grad in runs[0][2].items():
        torch.testing.assert_close(runs[1][2][name], grad, rtol=1e-5, atol=1e-6, msg=name)
    hidden = torch.randn(batch.layout.num_queries + 8, config.hidden_size)
    padded = pad_blocks(batch, batch.layout.num_queries + 8, config.mask_token_id)
    assert torch.equal(block_acceptance_totals(hidden, trainer.head.lm_head_weight, padded.labels, padded.weights,
                                               config.block_size),
                       block_acceptance_totals(hidden[:-8], trainer.head.lm_head_weight, batch.labels,
                                               batch.weights, config.block_size))
