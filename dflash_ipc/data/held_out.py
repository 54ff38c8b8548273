"""Held-out prompts declared at prepare time: the last N usable conversations of the input
stay out of the dataset, and their prompts are recorded in meta.json ("extra.held_out"), the
form the built-in synthetic data uses and `dflash-ipc eval` reads (`held_out_prompts_of`).

A prompt is a sample's tokens before its first loss-mask token (the first assistant turn's
header included). A conversation is held out only if no other sample of the input has the
same prompt: one seen earlier makes it ineligible, one seen later sends it back to training,
so a held-out prompt is never trained on, duplicates included. Samples that are not
candidates are written at once; candidates wait in a queue of at most N, so the dataset's
order is the input's, except that a candidate sent back is written when that happens.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np

from dflash_ipc.errors import DataError


def held_out_prompts_of(meta: dict, source: str = "meta.json") -> list[tuple[int, np.ndarray]]:
    """(sample id, prompt ids [P]) of the held-out prompts a dataset's meta.json declares
    (sample ids that were never written to the dataset); [] when it declares none."""
    extra = meta.get("extra") or {}
    held = (extra.get("held_out") if isinstance(extra, dict) else None) or []
    try:
        out = [(h["sample_id"], np.asarray(h["prompt_ids"], dtype=np.int64)) for h in held]
    except (KeyError, TypeError, ValueError, OverflowError):
        out = None
    if out is None or any(isinstance(i, bool) or not isinstance(i, int) or p.ndim != 1 for i, p in out):
        raise DataError(f"{source}: extra.held_out must be a list of {{sample_id: int, prompt_ids: [int, ...]}}")
    return out


def prompt_of(ids: np.ndarray, mask: np.ndarray) -> np.ndarray | None:
    """The tokens before the first loss-mask token, or None when the mask starts at 0."""
    first = int(np.argmax(mask)) if mask.any() else 0
    return ids[:first] if first > 0 else None


def _key(prompt: np.ndarray) -> int:
    return int.from_bytes(hashlib.blake2b(np.ascontiguousarray(prompt, np.int32).tobytes(), digest_size=8).digest(), "little")


class HeldOut:
    """Chooses the held-out samples of a stream. offer() returns what to write now."""

    def __init__(self, num: int):
        self.num = num
        self._seen: set[int] = set()
        self._candidates: OrderedDict[int, tuple] = OrderedDict()  # prompt key -> (item, prompt)

    def offer(self, item, ids: np.ndarray, mask: np.ndarray) -> list:
        """item: anything the caller writes later (returned as is)."""
        if self.num <= 0:
            return [item]
        prompt = prompt_of(ids, mask)
        if prompt is None:
            return [item]
        key = _key(prompt)
        if key in self._seen:
            out = [item]
            back = self._candidates.pop(key, None)
            if back is not None:
                out.append(back[0])
            return out
        self._seen.add(key)
        self._candidates[key] = (item, prompt)
        if len(self._candidates) > self.num:
            return [self._candidates.popitem(last=False)[1][0]]
        return []

    def held(self) -> list[tuple]:
        """(item, prompt ids) of the held-out samples, in input order, at the end."""
        return list(self._candidates.values())
