"""The exactly-once audit: every expected sample of every epoch committed once, nothing else.

    report = audit_samples([(epoch, sample_id), ...], {0: range(n), 1: range(n)})
    report.ok, report.missing, report.duplicated, report.unexpected, report.summary()

`Ledger.audit` feeds it the committed history (by default against the ledger's own plan);
the dispatcher writes its summary into `final_status.json`, and the fault tests check it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping


@dataclass(slots=True)
class AuditReport:
    """Result of ``audit``: per epoch, samples never committed and committed twice+."""

    missing: dict[int, list[int]]
    duplicated: dict[int, dict[int, int]]
    """epoch -> {sample id: times committed} for samples committed more than once."""
    unexpected: dict[int, list[int]]
    """epoch -> committed sample ids that the expectation does not contain."""
    num_commit_records: int

    @property
    def ok(self) -> bool:
        """True if every expected sample was committed exactly once and nothing else."""
        return not (self.missing or self.duplicated or self.unexpected)

    def summary(self, listed: int = 16) -> dict:
        """JSON-ready: counts of each kind of fault, and the first `listed` sample ids per epoch."""
        out: dict = {"ok": self.ok, "committed_samples": self.num_commit_records}
        for kind in ("missing", "duplicated", "unexpected"):
            per_epoch = getattr(self, kind)
            out[kind] = sum(len(ids) for ids in per_epoch.values())
            out[f"{kind}_samples"] = {str(e): list(ids)[:listed] for e, ids in per_epoch.items()}
        return out


def audit_samples(committed: Iterable[tuple[int, int]], expected: Mapping[int, Iterable[int] | int]) -> AuditReport:
    """Check (epoch, sample id) commits against the expected samples per epoch
    (``expected``: epoch -> ids, or an int n meaning ``range(n)``)."""
    counts: dict[int, dict[int, int]] = {}
    records = 0
    for epoch, sid in committed:
        records += 1
        per_epoch = counts.setdefault(epoch, {})
        per_epoch[sid] = per_epoch.get(sid, 0) + 1
    missing, duplicated, unexpected = {}, {}, {}
    for epoch in sorted(set(expected) | set(counts)):
        want = expected.get(epoch, ())
        want_set = set(range(want)) if isinstance(want, int) else set(want)
        got = counts.get(epoch, {})
        if miss := sorted(want_set.difference(got)):
            missing[epoch] = miss
        if dup := {s: n for s, n in sorted(got.items()) if n > 1}:
            duplicated[epoch] = dup
        if extra := sorted(set(got).difference(want_set)):
            unexpected[epoch] = extra
    return AuditReport(missing=missing, duplicated=duplicated, unexpected=unexpected,
                       num_commit_records=records)
