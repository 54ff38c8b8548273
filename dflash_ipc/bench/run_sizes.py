"""The data, training and evaluation sizes of `bench precision`: torch-free, so the CLI builds
its options from these defaults without loading torch for every command."""

from __future__ import annotations

from dataclasses import dataclass

from dflash_ipc.errors import ConfigError


@dataclass(frozen=True)
class RunSizes:
    """Data, training and evaluation sizes of one comparison (every variant the same)."""

    samples: int = 768
    min_len: int = 128
    max_len: int = 512
    held_out: int = 16
    steps: int = 300
    anchors_per_step: int = 1024
    max_anchors_per_seq: int = 512
    num_layers: int = 5
    lr: float = 6e-4
    eval_prompts: int = 16
    eval_tokens: int = 48
    seed: int = 0

    def check(self, synthetic: bool = True) -> None:
        for name in ("samples", "held_out", "steps", "anchors_per_step", "max_anchors_per_seq", "num_layers",
                     "eval_prompts", "eval_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"bench precision: {name}={getattr(self, name)} must be >= 1")
        if not 0 < self.lr <= 1:
            raise ConfigError(f"bench precision: lr={self.lr} must be in (0, 1]")
        if synthetic and self.eval_prompts > self.held_out:
            raise ConfigError(f"bench precision: eval_prompts={self.eval_prompts} exceeds the "
                              f"held_out={self.held_out} prompts the data keeps")
