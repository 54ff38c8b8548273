"""Every wire message of dflash-ipc and its codec. Nothing else imports msgpack.

A message is two ZMQ frames: one byte of `Kind`, then a msgpack map of the message's
fields. Decoding checks the kind, the exact field set and every field's type, and raises
`ProtocolError` on anything else, so a receiver can drop garbage and keep serving. Nothing
is ever unpickled. Hidden states never travel here: a target writes them into a slot of
its slot pool (`dflash_ipc.transport`) and only `(pool descriptor, slot, shape)` travels.
Token ids do not travel either: every process maps the same prepared dataset and batches
name their samples by index.

Conversation (all requests come from the worker; the dispatcher never sends work unasked):

    worker  -> Register(role, rank, ...)        dispatcher -> Registered | Refused
    target  -> Ready(credits)                   dispatcher -> Batch(batch_id, slot, samples)
    target  -> Produced(batch_id, slot, ...)
    drafter -> WantHidden(credits)              dispatcher -> Assign(batch_id, pool, slot, ...)
    drafter -> Consumed(batch_id, attempt)      (the slot returns to its target's free list)
    drafter -> Lost(batch_id, attempt, reason)  (the copy failed: its target died first)
    drafter 0 -> Resumed(step)                  dispatcher -> Resumed(step)  (the group's checkpoint)
    drafter 0 -> Committed(step, batch_ids, ranks, attempts, samples)
                                                dispatcher -> CommitDone(step)  (durable)
    worker  -> Heartbeat(metrics)               dispatcher -> Heartbeat
    any     -> StatusRequest                    dispatcher -> StatusReply(status: JobStatus, wire/status.py)
    dispatcher -> EndOfData                     (no work will come; drain and finish)
    dispatcher -> Shutdown(reason)              (stop now)
    dispatcher -> Unregistered(instance, reason) (to a sender it does not know: a worker whose
                                                 dispatcher restarted registers again)
"""

from __future__ import annotations

import dataclasses
import enum
import math
import types
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgpack

from dflash_ipc.errors import ProtocolError
from dflash_ipc.wire.status import JobStatus, from_plain

# Bounds of what a message may hold: far above any real message, low enough that no sender
# can grow a receiver's memory (the socket also refuses larger frames: zmq.MAXMSGSIZE).
MAX_BODY_BYTES = 4 * 1024 * 1024
MAX_LIST = 1 << 20          # list entries (sample ids of a batch, batch ids of a commit)
MAX_STR = 16 * 1024         # characters of a string
MAX_MAP = 256               # entries of a map (metrics, pool descriptors)
MAX_METRICS = 64            # entries of a heartbeat's metrics
MAX_METRIC_NAME = 64        # characters of a metric's name (a seat's metrics go into every status)
MAX_INT = 1 << 62           # ints: -1 ("none") .. MAX_INT
MAX_DEPTH = 8               # nesting of a free-form map (a pool descriptor nests 3 deep)
MAX_SECRET = 64             # bytes of Register.secret
MAX_REASON = 1000           # UTF-8 bytes of a Lost's reason (msgpack bounds strings in bytes)
MAX_REGISTER_BYTES = 64 * 1024  # a Register's body (a pool descriptor: ~16 KiB at 256 slots)


class Kind(enum.IntEnum):
    REGISTER = 1
    REGISTERED = 2
    REFUSED = 3
    READY = 4
    BATCH = 5
    PRODUCED = 6
    WANT_HIDDEN = 7
    ASSIGN = 8
    CONSUMED = 9
    COMMITTED = 10
    HEARTBEAT = 11
    STATUS_REQUEST = 12
    STATUS_REPLY = 13
    END_OF_DATA = 14
    SHUTDOWN = 15
    REJECTED = 16
    UNREGISTERED = 17
    LOST = 18
    RESUMED = 19
    COMMIT_DONE = 20


@dataclass(kw_only=True, slots=True)
class Register:
    KIND: ClassVar[Kind] = Kind.REGISTER
    role: str  # "target" | "drafter" | "observer"
    rank: int
    pid: int
    node: int = 0
    device: str = "cpu"
    pool: dict | None = None  # target: its slot-pool descriptor (transport-owned dict)
    num_slots: int = 0        # target: slots in the pool
    resume_step: int = -1     # drafter: step of the checkpoint it resumed from (-1: fresh)
    replaces_pids: list[int] = field(default_factory=list)  # the pids this process replaces (its
                              # supervisor says): a seat held by a live process goes only to a successor
    secret: bytes = field(default=b"", repr=False)  # the job's secret (wire/security.py: job_secret):
                              # a target or drafter seat goes only to a process that can read it


@dataclass(kw_only=True, slots=True)
class Registered:
    KIND: ClassVar[Kind] = Kind.REGISTERED
    role: str
    rank: int
    num_batches: int  # batches planned for the whole job (all epochs)
    resume_step: int = -1  # drafters: resume from the checkpoint of this step (-1: start fresh)
    instance: str = ""     # this dispatcher process (a new one after a dispatcher restart)
    generation: int = 0    # drafters: the group's generation; its rendezvous is MASTER_PORT + this
    committed_steps: list[int] = field(default_factory=list)  # drafters: checkpoint steps with a
                                                              # commit (a fallback must be one)


@dataclass(kw_only=True, slots=True)
class Refused:
    KIND: ClassVar[Kind] = Kind.REFUSED
    reason: str


@dataclass(kw_only=True, slots=True)
class Ready:
    KIND: ClassVar[Kind] = Kind.READY
    credits: int  # how many more batches this target can take now


@dataclass(kw_only=True, slots=True)
class Batch:
    KIND: ClassVar[Kind] = Kind.BATCH
    batch_id: int
    epoch: int
    slot: int
    sample_ids: list[int]
    padded_len: int


@dataclass(kw_only=True, slots=True)
class Produced:
    KIND: ClassVar[Kind] = Kind.PRODUCED
    batch_id: int
    slot: int
    num_tokens: int
    compute_s: float


@dataclass(kw_only=True, slots=True)
class WantHidden:
    KIND: ClassVar[Kind] = Kind.WANT_HIDDEN
    credits: int


@dataclass(kw_only=True, slots=True)
class Assign:
    KIND: ClassVar[Kind] = Kind.ASSIGN
    batch_id: int
    epoch: int
    target: int
    pool: dict  # the producing target's slot-pool descriptor
    slot: int
    sample_ids: list[int]
    num_tokens: int
    attempt: int = 0  # this assignment of the batch; its Consumed names it (a batch revoked
                      # and assigned again to the same drafter is told apart from its old copy)


@dataclass(kw_only=True, slots=True)
class Consumed:
    KIND: ClassVar[Kind] = Kind.CONSUMED
    batch_id: int
    attempt: int = 0  # the Assign's attempt


@dataclass(kw_only=True, slots=True)
class Lost:
    KIND: ClassVar[Kind] = Kind.LOST
    batch_id: int
    attempt: int
    reason: str = ""  # at most MAX_REASON bytes: cut it with `cut_reason`


def cut_reason(text: str) -> str:
    """`text` cut to MAX_REASON UTF-8 bytes (never inside a character), so a long non-ASCII
    reason still fits a Lost: a refused Lost would leave its batch assigned for good."""
    return text.encode("utf-8", "replace")[:MAX_REASON].decode("utf-8", "ignore")


@dataclass(kw_only=True, slots=True)
class Committed:
    KIND: ClassVar[Kind] = Kind.COMMITTED
    step: int
    batch_ids: list[int]      # rank 0 commits for the group: one entry per trained copy,
    ranks: list[int]          # the rank that trained it,
    attempts: list[int]       # the Assign attempt of that copy,
    samples: list[list[int]]  # and its samples that went through a step since the last commit


@dataclass(kw_only=True, slots=True)
class CommitDone:
    KIND: ClassVar[Kind] = Kind.COMMIT_DONE
    step: int  # the commit of this checkpoint is in the persisted ledger


@dataclass(kw_only=True, slots=True)
class Resumed:
    KIND: ClassVar[Kind] = Kind.RESUMED
    step: int  # drafter 0: the group resumed from this checkpoint (-1: fresh); the dispatcher
               # answers with the same message once its ledger holds nothing after it


@dataclass(kw_only=True, slots=True)
class Heartbeat:
    KIND: ClassVar[Kind] = Kind.HEARTBEAT
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(kw_only=True, slots=True)
class StatusRequest:
    KIND: ClassVar[Kind] = Kind.STATUS_REQUEST


@dataclass(kw_only=True, slots=True)
class StatusReply:
    KIND: ClassVar[Kind] = Kind.STATUS_REPLY
    status: JobStatus  # typed and bounded by its own schema (wire/status.py)


@dataclass(kw_only=True, slots=True)
class EndOfData:
    KIND: ClassVar[Kind] = Kind.END_OF_DATA


@dataclass(kw_only=True, slots=True)
class Shutdown:
    KIND: ClassVar[Kind] = Kind.SHUTDOWN
    reason: str


@dataclass(kw_only=True, slots=True)
class Rejected:
    KIND: ClassVar[Kind] = Kind.REJECTED
    kind: int     # the kind of the message that was refused
    reason: str


@dataclass(kw_only=True, slots=True)
class Unregistered:
    KIND: ClassVar[Kind] = Kind.UNREGISTERED
    instance: str  # the answering dispatcher; differs from the worker's Registered.instance
                   # when the dispatcher restarted (register again), else the worker was dropped
    reason: str


Message = (Register | Registered | Refused | Ready | Batch | Produced | WantHidden | Assign
           | Consumed | Lost | Committed | CommitDone | Resumed | Heartbeat | StatusRequest | StatusReply
           | EndOfData | Shutdown | Rejected | Unregistered)

_CLASSES: dict[Kind, type] = {cls.KIND: cls for cls in typing.get_args(Message)}
_HINTS: dict[type, dict[str, Any]] = {cls: typing.get_type_hints(cls) for cls in _CLASSES.values()}


@dataclass(frozen=True, slots=True)
class Limits:
    """What msgpack may build from one kind's body, checked as it reads each header (so a
    4 MB body of empty lists is refused at its first oversized list, before it allocates)."""
    body_bytes: int = MAX_BODY_BYTES
    str_len: int = MAX_STR
    bin_len: int = MAX_STR
    array_len: int = MAX_LIST
    map_len: int = MAX_MAP


_SMALL = Limits(body_bytes=4096, str_len=MAX_REASON, bin_len=0, array_len=0, map_len=8)  # a few scalars
LIMITS: dict[Kind, Limits] = {
    # What an unregistered peer may send: these two are decoded before the sender is known.
    Kind.REGISTER: Limits(body_bytes=MAX_REGISTER_BYTES, str_len=4096, bin_len=4096, array_len=1024),
    Kind.STATUS_REQUEST: Limits(body_bytes=64, str_len=0, bin_len=0, array_len=0, map_len=0),
    Kind.HEARTBEAT: Limits(body_bytes=16 * 1024, str_len=MAX_METRIC_NAME, bin_len=0, array_len=0,
                           map_len=MAX_METRICS),
    **{kind: _SMALL for kind in (Kind.READY, Kind.WANT_HIDDEN, Kind.CONSUMED, Kind.PRODUCED, Kind.LOST,
                                 Kind.RESUMED, Kind.COMMIT_DONE)},
    # The dispatcher's status grows with the job (one map entry per worker).
    Kind.STATUS_REPLY: Limits(map_len=MAX_LIST),
}


def encode(msg: Message) -> list[bytes]:
    """Frames for `msg`: [kind byte, msgpack body]."""
    body = {f.name: getattr(msg, f.name) for f in dataclasses.fields(msg)}
    return [bytes((msg.KIND,)), msgpack.packb(body, use_bin_type=True, default=_fields_of)]


def _fields_of(value: Any) -> dict:
    """msgpack's hook for what it cannot pack itself: a dataclass (the status types) as the
    map of its fields."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    raise TypeError(f"{type(value).__name__} is not a wire value")


def peek_kind(frames: list[bytes]) -> Kind | None:
    """The kind a message says it is, without reading its body (None: not a message)."""
    if len(frames) != 2 or len(frames[0]) != 1:
        return None
    try:
        return Kind(frames[0][0])
    except ValueError:
        return None


def decode(frames: list[bytes]) -> Message:
    """Inverse of `encode`; raises ProtocolError naming what is wrong. Never recurses on the
    input: a body nested 100,000 deep is refused by msgpack at depth 1,024, one nested 600
    deep by the check below at MAX_DEPTH."""
    if len(frames) != 2:
        raise ProtocolError(f"expected 2 frames (kind, body), got {len(frames)}")
    kind_frame, body_frame = frames
    if len(kind_frame) != 1:
        raise ProtocolError(f"kind frame must be 1 byte, got {len(kind_frame)}")
    try:
        kind = Kind(kind_frame[0])
    except ValueError:
        raise ProtocolError(f"unknown message kind {kind_frame[0]}") from None
    limits = LIMITS.get(kind, Limits())
    if len(body_frame) > limits.body_bytes:
        raise ProtocolError(f"{kind.name} body of {len(body_frame)} bytes exceeds {limits.body_bytes}")
    try:
        body = msgpack.unpackb(body_frame, raw=False, strict_map_key=True, max_str_len=limits.str_len,
                               max_bin_len=limits.bin_len, max_array_len=limits.array_len,
                               max_map_len=limits.map_len, max_ext_len=0)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise ProtocolError(f"{kind.name}: undecodable body ({type(exc).__name__}: {exc})") from None
    try:
        return _build(kind, body)
    except ProtocolError:
        raise
    except Exception as exc:  # last line of defence: untrusted input raises nothing but ProtocolError
        raise ProtocolError(f"{kind.name}: malformed body ({type(exc).__name__})") from None


def _build(kind: Kind, body: Any) -> Message:
    """The message of `kind` from its unpacked `body`, checked against the class's hints."""
    cls = _CLASSES[kind]
    if not isinstance(body, dict):
        raise ProtocolError(f"{kind.name}: body must be a map, got {type(body).__name__}")
    hints = _HINTS[cls]
    names = {f.name for f in dataclasses.fields(cls)}
    required = {f.name for f in dataclasses.fields(cls)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    unknown, missing = set(body) - names, required - set(body)
    if unknown or missing:
        # repr first: the keys may mix str and bytes (a bin-typed key), which do not sort together
        raise ProtocolError(f"{kind.name}: unknown fields {sorted(unknown, key=repr)[:8]!r:.200}, "
                            f"missing {sorted(missing)}")
    if cls is StatusReply:  # typed: checked against its own schema and bounds (wire/status.py)
        try:
            return StatusReply(status=from_plain(JobStatus, body["status"]))
        except ValueError as exc:
            raise ProtocolError(f"{kind.name}: {exc}") from None
    for name, value in body.items():
        if (why := check_value(value, hints[name])) is not None:
            if name == "secret":  # never echo a mistyped secret (it may be the secret, hex-encoded)
                why = f"not the job's secret (must be bytes, at most {MAX_SECRET})"
            raise ProtocolError(f"{kind.name}.{name}: {why}")
    if cls is Register and len(body.get("secret", b"")) > MAX_SECRET:
        raise ProtocolError(f"REGISTER.secret: {len(body['secret'])} bytes, at most {MAX_SECRET}")
    return cls(**body)


_ANY = object()  # the hint of a free-form value (inside a bare `dict` field): any wire value


def check_value(value: Any, hint: Any) -> str | None:
    """Why `value` does not match `hint` or lies outside the wire's bounds (None: it fits).
    Iterative, with an explicit stack: no input can exhaust Python's recursion limit, and a
    value nested deeper than MAX_DEPTH is refused at that depth."""
    stack = [(value, hint, 0)]
    while stack:
        value, hint, depth = stack.pop()
        if depth > MAX_DEPTH:
            return f"nested deeper than {MAX_DEPTH} levels"
        if typing.get_origin(hint) in (typing.Union, types.UnionType):
            if value is None and type(None) in typing.get_args(hint):
                continue
            (hint,) = [h for h in typing.get_args(hint) if h is not type(None)]  # only `T | None` here
        if hint is _ANY:
            if isinstance(value, list):
                hint = list[_ANY]
            elif isinstance(value, dict):
                hint = dict
            elif value is None:
                continue
            else:
                hint = type(value) if isinstance(value, (bool, int, float, str, bytes)) else None
                if hint is None:
                    return f"{type(value).__name__} is not a wire value"  # msgpack extension types
        origin = typing.get_origin(hint)
        if origin is list or hint is dict or origin is dict:
            container = list if origin is list else dict
            if not isinstance(value, container):
                return f"{type(value).__name__} {value!r:.80} does not match {hint}"
            limit = MAX_LIST if container is list else MAX_MAP
            if len(value) > limit:
                return f"{len(value)} entries, at most {limit}"
            if origin is list:
                (inner,) = typing.get_args(hint)
                stack.extend((v, inner, depth + 1) for v in value)
            else:
                key_hint, value_hint = typing.get_args(hint) if origin is dict else (_ANY, _ANY)
                for k, v in value.items():
                    stack.append((k, key_hint, depth + 1))
                    stack.append((v, value_hint, depth + 1))
            continue
        if (why := _scalar(value, hint)) is not None:
            return why
    return None


def _scalar(value: Any, hint: Any) -> str | None:
    """Why a scalar does not match `hint` (int, float, str, bytes or bool) or its bounds."""
    if hint is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif hint is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, hint)
    if not ok:
        return f"{type(value).__name__} {value!r:.80} does not match {getattr(hint, '__name__', hint)}"
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return None if -1 <= value <= MAX_INT else f"integer {value:.6g} outside [-1, 2**62]"
    if isinstance(value, float):
        # |x| <= 2**62 as for ints: sums of a million such values stay finite in the status
        return None if math.isfinite(value) and abs(value) <= MAX_INT else f"{value} is not a finite number within 2**62"
    if isinstance(value, (str, bytes)) and len(value) > MAX_STR:
        return f"{len(value)} characters, at most {MAX_STR}"
    return None
