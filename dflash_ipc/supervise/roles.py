"""A supervised process's role: dispatcher, target/N or drafter/N."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

RoleKind = Literal["dispatcher", "target", "drafter"]


@dataclass(frozen=True, slots=True, order=True)
class Role:
    kind: RoleKind
    rank: int | None = None

    def __post_init__(self) -> None:
        if (self.kind == "dispatcher") != (self.rank is None):
            raise ValueError(f"role {self.kind!r} with rank {self.rank!r}: only targets and drafters have ranks")

    def __str__(self) -> str:
        return self.kind if self.rank is None else f"{self.kind}/{self.rank}"

    @classmethod
    def parse(cls, text: str) -> "Role":
        kind, _, rank = text.partition("/")
        if kind not in ("dispatcher", "target", "drafter") or (kind != "dispatcher") != rank.isdigit():
            raise ValueError(f"not a role: {text!r} (dispatcher, target/N or drafter/N)")
        return cls(kind, int(rank) if rank else None)  # type: ignore[arg-type]

    @property
    def restart_key(self) -> str:
        """Whose restart budget a death of this role spends: the target's own, the drafter
        group's (drafters restart together) or the dispatcher's."""
        return "drafters" if self.kind == "drafter" else str(self)


DISPATCHER = Role("dispatcher")
