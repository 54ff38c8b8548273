"""The job's status as types: what `Dispatcher.status()` returns, `StatusReply` carries and
`final_status.json` holds.

One `JobStatus` is the dispatcher's whole view at one moment: batch counts by ledger state,
epoch progress, token totals, rates, and one seat status per registered worker. Readers (the
status line, the metric sinks, health, the supervisor's decisions, `dflash-ipc status`, the
benches) read it by attribute, so a renamed field is an error where it is read, never a
silent default.

On the wire it travels in the protocol's one codec (`protocol.encode` packs the dataclasses
as msgpack maps of their fields); on disk as JSON of the same shape (`to_json`,
`JobStatus.from_json`, `read_status_file`). Both ways in go through `from_plain`, which checks
the exact field set, every type and the bounds below, and names the field at fault: a status
from a file or a socket is a `JobStatus` or one clear error, never a KeyError later. Its work
follows the schema, not the input, so no input nests deeper than the types do.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from typing import Any

from dflash_ipc.errors import DataError
from dflash_ipc.run.json_files import json_safe, read_json_object

# The wire's scalar bounds (protocol.MAX_STR, MAX_INT; a test holds them equal), and the
# status' own: a map has at most MAX_MAP entries unless its field says more (one entry per
# worker, per epoch: `max_entries`), a list at most MAX_LIST.
MAX_STR = 16 * 1024
MAX_INT = 1 << 62
MAX_MAP = 256
MAX_LIST = 1 << 20
MAX_SEATS = 1 << 16       # targets, or drafters, of one job (the body's byte bound comes first)
MAX_EPOCHS = 10_000       # data.num_epochs is at most this
MAX_METRICS = 64          # a seat's metrics: what its heartbeats may carry


def _entries(n: int):
    return field(metadata={"max_entries": n})


@dataclass(kw_only=True, slots=True)
class BatchCounts:
    """Batches in each ledger state (dispatch/ledger.py `BatchState`)."""

    pending: int
    leased: int
    produced: int
    consumed: int
    committed: int
    assigned: int


@dataclass(kw_only=True, slots=True)
class EpochProgress:
    epoch: int
    batches: int
    """Planned batches of this epoch."""
    committed: int
    """Of them, fully committed."""
    tokens: int = 0
    """Its planned tokens (the progress bar places the job's trained tokens in the epochs with
    them). Optional on the way in: a status or a final_status.json without it reads as 0,
    unknown."""


@dataclass(kw_only=True, slots=True)
class TokenCounts:
    total: int
    """Planned tokens of the whole job."""
    produced: int
    """Produced into slots, as this dispatcher process saw them (a restarted one counts from 0)."""
    consumed: int
    """Copied out by drafters, as this dispatcher process saw them."""
    trained: float
    """Tokens through a step, the whole job's: the ledger's committed tokens when this drafter
    group started (after any rollback) plus the group's own counts (which start from 0)."""
    committed: int
    """The ledger's: tokens of every committed sample, the whole run's."""


@dataclass(kw_only=True, slots=True)
class Rates:
    """Tokens/s (obs/token_rate.py): produced, copied out, trained."""

    tgt_rate: float
    dft_rate: float
    tok_rate: float


@dataclass(kw_only=True, slots=True)
class TargetStatus:
    pid: int
    credits: int
    free_slots: int
    """Slots of its pool no batch holds (the ledger's)."""
    batches: int
    tokens: int
    compute_s: float
    metrics: dict[str, float | None] = _entries(MAX_METRICS)
    """Its last heartbeat's metrics, by name (finite on the wire; a file may hold a null)."""
    heartbeat_age_s: float


@dataclass(kw_only=True, slots=True)
class DrafterStatus:
    pid: int
    credits: int
    batches: int
    tokens: int
    metrics: dict[str, float | None] = _entries(MAX_METRICS)
    heartbeat_age_s: float


@dataclass(kw_only=True, slots=True)
class AuditSummary:
    """The ledger's exactly-once audit against the plan (dispatch/audit.py `summary`)."""

    ok: bool
    committed_samples: int
    missing: int
    missing_samples: dict[str, list[int]] = _entries(MAX_EPOCHS)
    duplicated: int
    duplicated_samples: dict[str, list[int]] = _entries(MAX_EPOCHS)
    unexpected: int
    unexpected_samples: dict[str, list[int]] = _entries(MAX_EPOCHS)


@dataclass(kw_only=True, slots=True)
class JobStatus:
    """Everything the supervisor's status line and `dflash-ipc status` show."""

    elapsed_s: float
    """Since this dispatcher process started."""
    policy: str
    num_batches: int
    batches: BatchCounts
    epochs: list[EpochProgress] = _entries(MAX_EPOCHS)
    tokens: TokenCounts
    committed_tokens_by_epoch: dict[str, int] = _entries(MAX_EPOCHS)
    last_committed_step: int | None
    rates: Rates
    """Trailing windows (at least 10 s, whole batches)."""
    produced_waiting: int
    targets: dict[str, TargetStatus] = _entries(MAX_SEATS)
    """By rank."""
    drafters: dict[str, DrafterStatus] = _entries(MAX_SEATS)
    refusals: int
    instance: str
    drafter_generation: int
    dropped_targets: dict[str, str]
    """pid -> why, of targets dropped while their process may still run (the supervisor kills them)."""
    finished: bool
    average_rates: Rates | None = None
    """final_status.json only: this dispatcher's whole-life averages."""
    audit: AuditSummary | None = None
    """final_status.json only: every planned sample committed exactly once?"""

    def to_json(self) -> dict:
        """Plain JSON values of the same shape (a non-finite float as null)."""
        return json_safe(to_plain(self))

    @classmethod
    def from_json(cls, data: Any, source: str) -> JobStatus:
        """A status from parsed JSON; DataError naming `source` and the field at fault."""
        try:
            return from_plain(cls, data)
        except ValueError as exc:
            raise DataError(f"{source}: not a job status of this version: {exc}") from None


def read_status_file(path: str, what: str = "final status") -> JobStatus:
    """The status in a JSON file (final_status.json); DataError when it is missing, torn or
    not a status of this version."""
    return JobStatus.from_json(read_json_object(path, what), path)


def to_plain(value: Any) -> Any:
    """Dataclasses as dicts of their fields, all the way down."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {k: to_plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [to_plain(v) for v in value]
    return value


_HINTS: dict[type, dict[str, Any]] = {}


def from_plain(cls: type, value: Any, path: str = "status") -> Any:
    """`value` (msgpack- or JSON-decoded) as a `cls`; ValueError naming the path at fault."""
    if not isinstance(value, dict):
        raise ValueError(f"{path}: {type(value).__name__} is not an object of {cls.__name__}'s fields")
    hints = _HINTS.get(cls) or _HINTS.setdefault(cls, typing.get_type_hints(cls))
    fields = {f.name: f for f in dataclasses.fields(cls)}
    required = {n for n, f in fields.items()
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    unknown, missing = set(value) - set(fields), required - set(value)
    if unknown or missing:
        raise ValueError(f"{path}: unknown fields {sorted(map(str, unknown))[:8]}, missing {sorted(missing)}")
    return cls(**{name: _typed(v, hints[name], f"{path}.{name}", fields[name].metadata.get("max_entries"))
                  for name, v in value.items()})


def _typed(value: Any, hint: Any, path: str, max_entries: int | None = None) -> Any:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in typing.get_args(hint):
            return None
        (hint,) = [h for h in typing.get_args(hint) if h is not type(None)]  # only `T | None` here
        origin = typing.get_origin(hint)
    if dataclasses.is_dataclass(hint):
        return from_plain(hint, value, path)
    if origin in (list, dict):
        container = origin
        if not isinstance(value, container):
            raise ValueError(f"{path}: {type(value).__name__} is not a {container.__name__}")
        limit = max_entries or (MAX_LIST if container is list else MAX_MAP)
        if len(value) > limit:
            raise ValueError(f"{path}: {len(value)} entries, at most {limit}")
        if container is list:
            (inner,) = typing.get_args(hint)
            return [_typed(v, inner, f"{path}[{i}]") for i, v in enumerate(value)]
        key_hint, value_hint = typing.get_args(hint)
        return {_typed(k, key_hint, f"{path} key"): _typed(v, value_hint, f"{path}[{k!r:.40}]")
                for k, v in value.items()}
    return _scalar(value, hint, path)


def _scalar(value: Any, hint: Any, path: str) -> Any:
    if hint is bool:
        ok = isinstance(value, bool)
    elif hint is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif hint is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    else:
        ok = isinstance(value, hint)
    if not ok:
        raise ValueError(f"{path}: {type(value).__name__} {value!r:.60} is not {getattr(hint, '__name__', hint)}")
    if hint is int and not -1 <= value <= MAX_INT:
        raise ValueError(f"{path}: integer {value:.6g} outside [-1, 2**62]")
    if hint is float and not (math.isfinite(value) and abs(value) <= MAX_INT):
        raise ValueError(f"{path}: {value!r:.30} is not a finite number within 2**62")
    if isinstance(value, str) and len(value) > MAX_STR:
        raise ValueError(f"{path}: {len(value)} characters, at most {MAX_STR}")
    return float(value) if hint is float else value
