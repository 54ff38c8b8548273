"""What the batched decoders consume and produce: requests, generations, request sources.

A decoder pulls :class:`Request` s from a source whenever a row is free and hands each
finished :class:`Generation` back to it; a multi-turn source answers a finished turn by
making the conversation's next turn ready (prompt_sets.py), so turns of different
conversations interleave while each turn sees the model's own earlier replies.
"""

from __future__ import annotations

import collections
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from dflash_ipc.errors import ConfigError


@dataclass(slots=True)
class Request:
    """One generation: a prompt (token ids) and its budget."""

    key: Hashable
    """Who asked: e.g. (sample id, turn); generations come back in finishing order."""
    prompt_ids: np.ndarray
    """``[P]`` token ids, the chat template already applied."""
    max_new_tokens: int

    def __post_init__(self) -> None:
        self.prompt_ids = np.asarray(self.prompt_ids, dtype=np.int64).reshape(-1)
        if self.prompt_ids.size < 1:
            raise ConfigError(f"request {self.key}: empty prompt")
        if self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens={self.max_new_tokens} must be >= 1")


@dataclass(slots=True)
class Generation:
    """A finished request."""

    request: Request
    tokens: list[int] = field(default_factory=list)
    """Generated tokens only, stop token included if one came."""
    stopped: bool = False
    """Ended on a stop token (else on the budget)."""
    stats: "AcceptanceStats | None" = None  # eval/acceptance.py's (a floor above: not imported here)
    """Speculative decoding's counters (None for plain decoding)."""
    margins: list[float] = field(default_factory=list)
    """Greedy only: the target's top-1 minus top-2 logit where it chose each token."""
    top_logits: list[float] = field(default_factory=list)
    """Greedy only: the top-1 logit there (the scale the margin is judged against)."""

    @property
    def prompt_len(self) -> int:
        return int(self.request.prompt_ids.size)


class RequestSource(Protocol):
    """Where a decoder gets work."""

    num_expected: int
    """Requests this source will hand out in all (progress and ETA)."""

    def next_request(self) -> Request | None:
        """A request ready now, or None (none ready; maybe later, after a ``finished``)."""
        ...

    def finished(self, generation: Generation) -> None:
        """A request came back; may make new requests ready."""
        ...


class RequestList:
    """A fixed list of independent requests, handed out in order."""

    def __init__(self, requests: Iterable[Request]) -> None:
        self._ready = collections.deque(requests)
        self.num_expected = len(self._ready)

    def next_request(self) -> Request | None:
        return self._ready.popleft() if self._ready else None

    def finished(self, generation: Generation) -> None:
        pass
