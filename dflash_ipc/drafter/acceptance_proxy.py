"""Validation during training: the drafter's expected acceptance length, from a step's forward.

Every `validation.every_steps` steps the step's forward is also scored: for each block (an
anchor and its `block_size - 1` drafted positions) the drafter's top-1 token at position k is
compared with the label there. Greedy speculative decoding accepts the drafted tokens up to the
first miss, then the target adds one of its own, so a block's acceptance length is

    tau_block = 1 + (number of leading positions k = 1, 2, ... whose top-1 is right)

and the proxy is its mean over the step's blocks, on every drafter rank (summed in one
all-reduce). A position without a label (past the sequence, or outside the loss mask) ends the
run, as a reply that ends there would. No decoding: one extra matmul with the frozen LM head,
without gradients, on the hidden states the step already computed.

The blocks are scored before the step trains on them (the optimizer step comes after), so in
the first epoch they are samples the drafter has never seen: a held-out measurement of the
weights of the previous step, taken on fresh data each time (progressive validation). With
`data.num_epochs > 1`, later epochs score samples trained on in an earlier epoch. `eval` gives
the tau of real decoding on held-out prompts.

`totals()` is a float64 vector, summed over ranks: [blocks, sum of accepted drafted tokens,
blocks reaching position 1, ..., blocks reaching position block_size - 1].
"""

from __future__ import annotations

import torch
from torch import Tensor

CHUNK_ROWS = 4096  # rows of logits at once: [4096, vocab], far below what the loss's chunks hold


@torch.no_grad()
def block_acceptance_totals(hidden: Tensor, lm_head_weight: Tensor, labels: Tensor, weights: Tensor,
                            block_size: int) -> Tensor:
    """[block_size + 1] float64 totals (see the module doc) of one batch.

    hidden [Q, H] (Q = blocks x block_size, block-major as `build_training_batch` lays them
    out), lm_head_weight [V, H], labels [Q], weights [Q] (0 where a position has no label).
    Blocks without a label at position 1 (the weight-0 filler of an idle FSDP rank) are not
    counted."""
    num_rows = hidden.shape[0]
    if num_rows % block_size:
        raise ValueError(f"{num_rows} rows are not whole blocks of {block_size}")
    has_label = weights > 0  # [Q]
    correct = torch.zeros(num_rows, dtype=torch.bool, device=hidden.device)
    rows = has_label.nonzero().squeeze(1)
    for start in range(0, rows.numel(), CHUNK_ROWS):
        idx = rows[start:start + CHUNK_ROWS]
        logits = torch.nn.functional.linear(hidden[idx].to(lm_head_weight.dtype), lm_head_weight)  # [n, V]
        correct[idx] = logits.argmax(dim=-1) == labels[idx]
    correct = correct.view(-1, block_size)[:, 1:]  # [A, bs-1]: the drafted positions
    counted = has_label.view(-1, block_size)[:, 1]  # [A]
    reached = torch.cumprod(correct[counted].to(torch.int64), dim=1)  # [A', bs-1]: 1 up to the first miss
    out = torch.zeros(block_size + 1, dtype=torch.float64, device=hidden.device)
    out[0] = counted.sum()
    out[1] = reached.sum()
    out[2:] = reached.sum(dim=0)
    return out


def acceptance_summary(totals: Tensor | list[float]) -> dict:
    """{"acceptance_length": mean tau, "acceptance_blocks": blocks, "acceptance_at": [rate of
    blocks reaching position k, k = 1..]} from summed totals; tau is NaN without a block."""
    values = [float(v) for v in (totals.tolist() if isinstance(totals, Tensor) else totals)]
    blocks = values[0]
    if blocks <= 0:
        return {"acceptance_length": float("nan"), "acceptance_blocks": 0, "acceptance_at": []}
    return {"acceptance_length": 1.0 + values[1] / blocks, "acceptance_blocks": int(blocks),
            "acceptance_at": [v / blocks for v in values[2:]]}
