"""The acceptance proxy: leading top-1 hits of each block, from hidden states and the LM head."""

import math

import torch

from dflash_ipc.drafter.acceptance_proxy import acceptance_summary, block_acceptance_totals

VOCAB, BLOCK = 8, 4


def _batch(predicted: list[list[int]], labels: list[list[int]], weights: list[list[float]]):
    """Hidden states whose top-1 under an identity head is `predicted` (one row per position)."""
    hidden = torch.nn.functional.one_hot(torch.tensor(predicted).reshape(-1), VOCAB).float()
    return hidden, torch.eye(VOCAB), torch.tensor(labels).reshape(-1), torch.tensor(weights).reshape(-1)


def test_a_blocks_acceptance_is_its_leading_hits_and_a_missing_label_ends_it():
    w = [0.0, 1.0, 1.0, 1.0]
    hidden, head, labels, weights = _batch(
        predicted=[[0, 1, 2, 3], [0, 5, 2, 3], [0, 1, 6, 3], [0, 1, 2, 3]],
        labels=[[7, 1, 2, 3], [7, 1, 2, 3], [7, 1, 2, 3], [7, 1, 2, 3]],
        weights=[w, w, w, [0.0, 1.0, 0.0, 1.0]])  # block 3: no label at position 2 (past the reply)
    totals = block_acceptance_totals(hidden, head, labels, weights, BLOCK)
    # accepted drafted tokens: 3 (all), 0 (miss at 1), 1 (miss at 2), 1 (no label at 2)
    assert totals.tolist() == [4, 5, 3, 1, 1]  # blocks reaching positions 1, 2, 3
    summary = acceptance_summary(totals)
    assert summary["acceptance_length"] == 1 + 5 / 4 and summary["acceptance_blocks"] == 4
    assert summary["acceptance_at"] == [3 / 4, 1 / 4, 1 / 4]


def test_blocks_without_a_first_label_are_not_counted():
    hidden, head, labels, weights = _batch(predicted=[[0, 1, 2, 3]], labels=[[0, 1, 2, 3]], weights=[[0.0] * 4])
    totals = block_acceptance_totals(hidden, head, labels, weights, BLOCK)
    assert totals.tolist() == [0] * (BLOCK + 1)
    assert math.isnan(acceptance_summary(totals)["acceptance_length"])
