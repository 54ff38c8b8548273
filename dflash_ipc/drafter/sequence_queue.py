"""A drafter rank's local queue of sequences, and which of them each checkpoint holds.

Each `Assign` copy is split into its sequences (by the dataset lengths of its samples) and
queued. A step takes sequences until its anchor budget is full; a sequence is trained in
exactly one step. What a checkpoint commits is known sequence by sequence: the samples of
each copy that went through a step since the previous commit (`take_trained`), so a copy
that straddles a checkpoint commits in parts and nothing is ever trained twice into the
model. Sequences still queued at a checkpoint are the checkpoint's pending remainder: the
ledger never saw them committed, so after a restart from it hands out exactly those again.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

import numpy as np
import torch

from dflash_ipc.drafter.trainer import Sequence, eligible_anchor_count, take_anchors

CopyKey = tuple[int, int]  # (batch id, attempt)


@dataclass(frozen=True, slots=True)
class TrainedSamples:
    """Samples of one copy that went through steps since the last commit."""
    batch_id: int
    attempt: int
    sample_ids: tuple[int, ...]


class SequenceQueue:
    def __init__(self, dataset, *, max_anchors_per_seq: int) -> None:
        self.dataset = dataset
        self.max_anchors_per_seq = max_anchors_per_seq
        self.fifo: collections.deque[Sequence] = collections.deque()
        self.anchors = 0
        self._trained: dict[CopyKey, list[int]] = {}  # since the last commit, in step order
        self.trained_tokens = 0   # tokens of this rank that went through a step (status: tok_rate)

    def __len__(self) -> int:
        return len(self.fifo)

    def add_copy(self, batch_id: int, attempt: int, epoch: int, sample_ids: list[int],
                 features: torch.Tensor) -> None:
        """Queues the sequences of one copied slot (`features` [T, F], packed in sample order)."""
        offset = 0
        for sample_id in sample_ids:
            ids, mask = self.dataset.sample(sample_id)
            length = len(ids)
            seq = Sequence(batch_id=batch_id, epoch=epoch, sample_id=sample_id, attempt=attempt,
                           features=features[offset:offset + length],
                           input_ids=torch.from_numpy(np.asarray(ids, dtype=np.int64)),
                           loss_mask=torch.from_numpy(np.asarray(mask, dtype=bool)),
                           num_anchors=eligible_anchor_count(mask, self.max_anchors_per_seq))
            offset += length
            self.fifo.append(seq)
            self.anchors += seq.num_anchors
        if offset != features.shape[0]:
            raise ValueError(f"batch {batch_id}: {features.shape[0]} feature rows for {offset} tokens of its samples")

    def take(self, budget: int) -> list[tuple[Sequence, int]]:
        """A step's sequences (`take_anchors`)."""
        chosen = take_anchors(self.fifo, budget)
        self.anchors -= sum(seq.num_anchors for seq, _ in chosen)
        return chosen

    def record_trained(self, chosen: list[tuple[Sequence, int]]) -> None:
        """The chosen sequences went through an optimizer step."""
        for seq, _ in chosen:
            self._trained.setdefault((seq.batch_id, seq.attempt), []).append(seq.sample_id)
            self.trained_tokens += seq.features.shape[0]

    def take_trained(self) -> list[TrainedSamples]:
        """What this rank trained since the last call (the next checkpoint commits it)."""
        out = [TrainedSamples(b, a, tuple(s)) for (b, a), s in self._trained.items()]
        self._trained = {}
        return out

