"""Token choice and the acceptance rules of speculative decoding, batched over rows.

Greedy (temperature 0): the target's argmax after each verified token; drafts are accepted
while they equal it (the committed tokens are then exactly ``target_next[:m+1]``;
decode/accept.py counts them).

Sampling (temperature > 0, optional top-p): both models' logits become distributions
through the same temperature and nucleus (p: target, q: drafter). Standard speculative
sampling (Leviathan et al. 2023; Chen et al. 2023): draft x_j ~ q_j; accept it with
probability ``min(1, p_j(x_j) / q_j(x_j))``; at the first rejection j take one token from
the residual ``max(p_j - q_j, 0)`` (normalised) and stop; if all d drafts pass, take the
bonus from ``p_d``. Every committed token is then distributed exactly as the target's
own sample given the prefix. Tokens are drawn by the exponential race
(``argmax w / Exp(1)`` picks i with probability ``w_i / sum w``): no normalisation, no
``multinomial``, one kernel.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
from torch import Tensor

from dflash_ipc.decode.sampler import check_seed
from dflash_ipc.errors import ConfigError


@dataclass(frozen=True, kw_only=True, slots=True)
class Sampling:
    """How the next token is chosen."""

    temperature: float = 0.0
    """0: greedy (the lossless reference); > 0: sample from softmax(logits / temperature)."""
    top_p: float = 1.0
    """Nucleus: keep the most likely tokens whose probabilities sum to top_p (1: all)."""
    seed: int = 0
    """Seed of the sampling generator (one per run, on the model's device)."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0):  # inf: logits / inf is all zeros
            raise ConfigError(f"temperature={self.temperature}: must be a finite number >= 0 (0 = greedy)")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p={self.top_p}: must be in (0, 1]")
        check_seed(self.seed)  # before a generator is seeded: a larger one overflows there

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def to_dict(self) -> dict:
        return asdict(self)

    def generator(self, device: torch.device) -> torch.Generator | None:
        return None if self.greedy else torch.Generator(device=device).manual_seed(self.seed)


def probabilities(logits: Tensor, sampling: Sampling) -> Tensor:
    """float32 distributions ``[..., V]`` after temperature and top-p."""
    probs = torch.softmax(logits.float() / sampling.temperature, dim=-1)
    if sampling.top_p >= 1:
        return probs
    ordered, order = probs.sort(dim=-1, descending=True)
    # Keep a token while the mass before it is < top_p: the most likely one always stays.
    ordered = ordered.masked_fill(ordered.cumsum(-1) - ordered >= sampling.top_p, 0.0)
    kept = torch.zeros_like(probs).scatter_(-1, order, ordered)
    return kept / kept.sum(-1, keepdim=True)


def sample(weights: Tensor, generator: torch.Generator | None) -> Tensor:
    """One index per row of non-negative ``weights`` ``[..., V]`` (need not sum to 1)."""
    race = torch.empty_like(weights, dtype=torch.float32).exponential_(generator=generator)
    return (weights / race).argmax(-1)


def speculative_accept(drafted: Tensor, draft_probs: Tensor, target_probs: Tensor,
                       generator: torch.Generator | None) -> tuple[Tensor, Tensor]:
    """Rejection sampling of a block: drafted ``[B, d]`` drawn from draft_probs ``[B, d, V]``,
    target_probs ``[B, d+1, V]`` -> (accepted ``[B]``, tokens ``[B, d+1]``): tokens[:accepted]
    are the accepted drafts and tokens[accepted] the residual (or bonus) sample."""
    b, d = drafted.shape
    p_x = target_probs[:, :d].gather(-1, drafted[..., None])[..., 0]  # [B, d]
    q_x = draft_probs.gather(-1, drafted[..., None])[..., 0]
    u = torch.rand(b, d, device=drafted.device, generator=generator)
    accepted = (u * q_x < p_x).int().cumprod(1).sum(1)  # u < p/q, and x ~ q so q_x > 0
    rows = torch.arange(b, device=drafted.device)
    p_m = target_probs[rows, accepted]  # [B, V]
    residual = (p_m - draft_probs[rows, accepted.clamp(max=d - 1)]).clamp_min(0)
    # All-zero residual: p == q there, so the rejection had probability 0; keep p as the fallback.
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_m)
    next_token = sample(torch.where((accepted < d)[:, None], residual, p_m), generator)
    tokens = torch.cat([drafted, drafted[:, :1]], dim=1)
    tokens[rows, accepted] = next_token
    return accepted, tokens
