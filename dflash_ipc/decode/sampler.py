"""The next token of every row, chosen on the device with no host sync and no generator state.

Greedy is the argmax of the logits. Sampling applies temperature, then top-k, then top-p
(transformers' order), and draws by inverse CDF: one uniform number per row, ``u``, picks the
first token whose cumulative probability reaches ``u x total``. ``u`` is a hash of the row's
key (a 31-bit number derived on the host from the run's seed and the request's key) and the
index of the token in its reply, so

- a reply depends only on (seed, request key, sample number), never on which rows shared
  its batch or when it was admitted: a resumed run regenerates a row exactly as the first
  run would have;
- the draw is a handful of integer ops on ``[rows]``: no ``torch.Generator``, whose state a
  CUDA graph would have to register, and no ``[rows, vocab]`` noise tensor.

The hash is murmur3's 32-bit finaliser over ``key * phi + index * c``; ``u`` keeps 24 bits
(float32's mantissa), so a token of probability below ~6e-8 of its row is drawn a little less
often than it should be (tests/test_decode_sampler.py checks the distribution).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from dflash_ipc.errors import ConfigError

_M32 = 0xFFFFFFFF


def check_seed(seed, name: str = "seed") -> int:
    """``seed`` if it is an integer in [0, 2**63), else ConfigError naming ``name``: the range of
    regenerate's --seed (regenerate/options.py), and what ``torch.Generator.manual_seed`` takes
    without an overflow (it reads a signed 64-bit integer)."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise ConfigError(f"{name}={seed!r}: must be in [0, 2**63)")
    return seed


@dataclass(frozen=True, kw_only=True, slots=True)
class TokenChoice:
    """How the next token is chosen."""

    temperature: float = 0.0
    """0: greedy (argmax); > 0: sample from softmax(logits / temperature)."""
    top_p: float = 1.0
    """Nucleus mass kept (with temperature > 0); 1 keeps every token."""
    top_k: int = 0
    """Sample among the k most likely tokens (with temperature > 0); 0: no limit."""
    seed: int = 0
    """Mixed into every row's key."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ConfigError(f"temperature={self.temperature}: must be a finite number >= 0 (0 = greedy)")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p={self.top_p}: must be in (0, 1]")
        if self.top_k < 0:
            raise ConfigError(f"top_k={self.top_k}: must be >= 0 (0 = no limit)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def row_key(self, request_key) -> int:
        """The 31-bit key of one request's draws (its key as ``repr``: tuples of ints in practice)."""
        digest = hashlib.blake2b(f"{self.seed}/{request_key!r}".encode(), digest_size=4).digest()
        return int.from_bytes(digest, "little") >> 1


def uniforms(keys: Tensor, index: Tensor) -> Tensor:
    """float32 ``[B]`` in (0, 1) from int64 ``keys`` ``[B]`` and draw ``index`` ``[B]``."""
    h = (keys * 0x9E3779B1 + index * 0x85EBCA77 + 0x165667B1) & _M32
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _M32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _M32
    h = h ^ (h >> 16)
    return ((h >> 8).float() + 0.5) * (1.0 / (1 << 24))


def choose(logits: Tensor, choice: TokenChoice, keys: Tensor | None = None, index: Tensor | None = None) -> Tensor:
    """logits ``[B, V]`` -> token ids ``[B]`` (int64). Sampling needs ``keys`` and ``index`` ``[B]``."""
    if choice.greedy:
        return logits.argmax(-1)
    x = logits.float() / choice.temperature
    order = None
    if choice.top_k and choice.top_k < x.shape[-1]:
        x, order = x.topk(choice.top_k, dim=-1)  # sorted, most likely first
    elif choice.top_p < 1:
        x, order = x.sort(dim=-1, descending=True)
    p = torch.softmax(x, dim=-1)
    if choice.top_p < 1:
        # Keep a token while the mass before it is < top_p: the most likely one always stays.
        p = p.masked_fill(p.cumsum(-1) - p >= choice.top_p, 0.0)
    cdf = p.cumsum(-1)  # not renormalised: the draw scales u by the row's total instead
    target = uniforms(keys, index)[:, None] * cdf[:, -1:]
    j = torch.searchsorted(cdf, target).clamp_(max=cdf.shape[-1] - 1)  # first index with cdf >= target
    return (order.gather(-1, j) if order is not None else j)[:, 0]


def top2_margin(logits: Tensor) -> tuple[Tensor, Tensor]:
    """(top-1 minus top-2 logit, top-1 logit), float32 ``[...]``: how close the greedy choice was."""
    top = logits.topk(2, dim=-1).values.float()
    return top[..., 0] - top[..., 1], top[..., 0]
