"""Length buckets and token-budget batches of prompts, for batched generation (hf backend).

The same idea as the training dispatcher: prompts of similar length go together, so a batch
pads little, and a batch holds as many prompts as fit a token budget,
`batch_size x (longest prompt + max_new_tokens) <= token_budget` (what its KV cache holds).
Buckets are prompt-length ranges whose edges grow by ~1.19x (four per doubling: 16, 19, 22,
26, 32, ...), so within a bucket a prompt pads by at most ~19 %.

Which batch next: the bucket holding the oldest waiting prompt, when it fills a batch;
else the oldest full bucket; when `flush` is set (no more prompts are coming soon: the input
is read, or the window of rows in flight is full), the oldest bucket even if not full. So
rows do not wait long (their output is written as they finish) and batches stay full.

`bucketed=False` keeps one queue for every length: the engine decoder pads only its prefills
(a decode step has no padding whatever the rows' lengths), so buckets would only split its
queue into batches too small to fill its rows.
"""

from __future__ import annotations

import bisect
import itertools
import logging
from collections import OrderedDict

log = logging.getLogger(__name__)

_FIRST_EDGE = 16
_STEPS_PER_DOUBLING = 4


def bucket_edges(longest: int) -> list[int]:
    """Upper edges (inclusive) of the prompt-length buckets, up to at least `longest`."""
    edges, k = [], 0
    while not edges or edges[-1] < longest:
        edges.append(int(round(_FIRST_EDGE * 2 ** (k / _STEPS_PER_DOUBLING))))
        k += 1
    return sorted(set(edges))


class BatchScheduler:
    """Waiting prompts by bucket; `next_batch` takes one batch out."""

    def __init__(self, *, token_budget: int, max_batch_size: int, longest_prompt: int = 1 << 20,
                 bucketed: bool = True):
        self.token_budget = token_budget
        self.bucketed = bucketed
        self.max_batch_size = max_batch_size
        self._edges = bucket_edges(longest_prompt)
        self._buckets: dict[int, OrderedDict] = {}  # bucket -> seq -> (key, prompt_len, max_new)
        self._seq = itertools.count()
        self._size = 0
        self._warned = False

    def __len__(self) -> int:
        return self._size

    def add(self, key, prompt_len: int, max_new_tokens: int) -> None:
        """A prompt waits for a batch."""
        b = bisect.bisect_left(self._edges, prompt_len) if self.bucketed else 0
        self._buckets.setdefault(b, OrderedDict())[next(self._seq)] = (key, prompt_len, max_new_tokens)
        self._size += 1

    def next_batch(self, *, flush: bool) -> list | None:
        """Keys of the next batch (removed from the waiting prompts), or None (see module doc)."""
        if not self._size:
            return None
        order = sorted(self._buckets, key=lambda b: next(iter(self._buckets[b])))  # by oldest prompt
        for b in order:
            taken, full = self._take(self._buckets[b])
            if full or flush:
                return self._remove(b, taken)
        return None

    def _take(self, bucket: OrderedDict) -> tuple[list[int], bool]:
        """(seqs of the batch the bucket's oldest prompts make, whether it is full)."""
        taken, longest, most_new = [], 0, 0
        for seq, (_, plen, mnew) in bucket.items():
            cost = (len(taken) + 1) * (max(longest, plen) + max(most_new, mnew))
            if taken and (cost > self.token_budget or len(taken) == self.max_batch_size):
                return taken, True
            taken.append(seq)
            longest, most_new = max(longest, plen), max(most_new, mnew)
        if len(taken) == 1 and longest + most_new > self.token_budget and not self._warned:
            self._warned = True
            log.warning("a prompt of %d tokens + %d new is over the token budget %d; it runs alone",
                        longest, most_new, self.token_budget)
        return taken, len(taken) == self.max_batch_size or len(taken) * (longest + most_new) >= self.token_budget

    def _remove(self, b: int, seqs: list[int]) -> list:
        bucket = self._buckets[b]
        keys = [bucket.pop(s)[0] for s in seqs]
        if not bucket:
            del self._buckets[b]
        self._size -= len(keys)
        return keys
