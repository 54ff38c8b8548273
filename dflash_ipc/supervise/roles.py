"""A supervised process's role: dispatcher, target/N (target/N.K) or drafter/N.

A target worker of `target.gpus_per_worker` K > 1 is K processes: `target/N` is its leader
(the one the dispatcher sees), `target/N.1` .. `target/N.{K-1}` its followers. All K share one
restart key (`target/N`): a fault of any of them restarts the whole worker.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

RoleKind = Literal["dispatcher", "target", "drafter"]


@dataclass(frozen=True, slots=True, order=True)
class Role:
    kind: RoleKind
    rank: int | None = None
    tp_rank: int = 0
    """A target worker's process, 0 (its leader) .. gpus_per_worker - 1."""

    def __post_init__(self) -> None:
        if (self.kind == "dispatcher") != (self.rank is None):
            raise ValueError(f"role {self.kind!r} with rank {self.rank!r}: only targets and drafters have ranks")
        if self.tp_rank < 0 or (self.tp_rank and self.kind != "target"):
            raise ValueError(f"role {self.kind!r} with tp_rank {self.tp_rank!r}: only targets have tensor-parallel ranks")

    def __str__(self) -> str:
        if self.rank is None:
            return self.kind
        return f"{self.kind}/{self.rank}" + (f".{self.tp_rank}" if self.tp_rank else "")

    @classmethod
    def parse(cls, text: str) -> "Role":
        kind, _, rest = text.partition("/")
        rank, _, tp_rank = rest.partition(".")
        ok = kind in ("dispatcher", "target", "drafter") and (kind != "dispatcher") == rank.isdigit()
        ok = ok and (tp_rank == "" or (kind == "target" and tp_rank.isdigit() and int(tp_rank) > 0))
        if not ok:
            raise ValueError(f"not a role: {text!r} (dispatcher, target/N, target/N.K or drafter/N)")
        return cls(kind, int(rank) if rank else None, int(tp_rank or 0))  # type: ignore[arg-type]

    @property
    def restart_key(self) -> str:
        """Whose restart budget a death of this role spends: the target worker's own (all its
        processes together), the drafter group's (drafters restart together) or the dispatcher's."""
        if self.kind == "drafter":
            return "drafters"
        return self.kind if self.rank is None else f"{self.kind}/{self.rank}"

    @property
    def is_leader(self) -> bool:
        """The process the dispatcher sees (every role but a target worker's followers)."""
        return self.tp_rank == 0


DISPATCHER = Role("dispatcher")
