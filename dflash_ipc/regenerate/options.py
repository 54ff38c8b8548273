"""The generation options of a regeneration run, checked, and the settings a rerun must match."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from dflash_ipc.errors import ConfigError

REASONING = ("keep", "drop")
"""keep: the reasoning stays in the reply (`reasoning_content`, rendered by the template as
the model wrote it); drop: only the answer after it is kept."""


@dataclass(frozen=True, kw_only=True)
class GenerationOptions:
    """How each reply is generated. Greedy unless temperature > 0."""

    max_new_tokens: int = 2048
    """Longest reply in tokens; a reply cut there is counted as truncated."""
    temperature: float = 0.0
    """0: greedy (argmax of the target's logits); > 0: sampling at this temperature."""
    top_p: float = 1.0
    """Nucleus sampling mass (with temperature > 0); 1 keeps every token."""
    top_k: int = 0
    """Sample among the k most likely tokens (with temperature > 0); 0: no limit."""
    seed: int = 0
    """Seeds sampling: the hf backend per batch, the openai backend per row and turn."""
    max_turns: int | None = None
    """Regenerate at most this many assistant turns per conversation; later turns are dropped."""
    template_kwargs: dict = field(default_factory=dict)
    """Chat-template variables, e.g. {"enable_thinking": False} (Qwen3)."""
    reasoning: str = "keep"
    """What to do with reasoning in a reply (REASONING)."""
    samples_per_prompt: int = 1
    """Sampled replies per conversation (with temperature > 0), each its own output line with a
    "sample" number; every turn of sample k follows sample k's earlier replies."""

    def __post_init__(self) -> None:
        _require(self.max_new_tokens >= 1, "--max-new-tokens", self.max_new_tokens, "must be >= 1")
        _require(math.isfinite(self.temperature) and self.temperature >= 0, "--temperature", self.temperature,
                 "must be a finite number >= 0 (0 = greedy)")
        _require(math.isfinite(self.top_p) and 0 < self.top_p <= 1, "--top-p", self.top_p, "must be in (0, 1]")
        _require(self.top_k >= 0, "--top-k", self.top_k, "must be >= 0 (0 = no limit)")
        _require(0 <= self.seed < 2**63, "--seed", self.seed, "must be in [0, 2**63)")
        _require(self.max_turns is None or self.max_turns >= 1, "--max-turns", self.max_turns, "must be >= 1")
        _require(self.reasoning in REASONING, "--reasoning", self.reasoning, f"allowed: {list(REASONING)}")
        _require(self.samples_per_prompt >= 1, "--samples-per-prompt", self.samples_per_prompt, "must be >= 1")
        _require(self.samples_per_prompt == 1 or self.temperature > 0, "--samples-per-prompt",
                 self.samples_per_prompt, "more than 1 needs --temperature > 0 (greedy replies are all the same)")

    @property
    def greedy(self) -> bool:
        """True when replies are the argmax of the target's logits."""
        return self.temperature == 0

    def settings(self) -> dict:
        """What the replies depend on, for the output's state file (JSON). samples_per_prompt only
        when not 1, so outputs made before it existed still resume."""
        settings = asdict(self)
        if self.samples_per_prompt == 1:
            del settings["samples_per_prompt"]
        return settings


def _require(ok: bool, name: str, value, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"{name}={value!r}: {allowed}")
