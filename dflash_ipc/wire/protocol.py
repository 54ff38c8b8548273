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
    any     -> StatusRequest                    dispatcher -> StatusReply(status)
    dispatcher -> EndOfData                     (no work will come; drain and finish)
    dispatcher -> Shutdown(reason)              (stop now)
    dispatcher -> Unregistered(instance, reason) (to a sender it does not know: a worker whose
                                                 dispatcher restarted registers again)
"""

from __future__ import annotations

import dataclasses
import enum
import math
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgpack

from dflash_ipc.errors import ProtocolError

# Bounds of what a message may hold: far above any real message, low enough that no sender
# can grow a receiver's memory (the socket also refuses larger frames: zmq.MAXMSGSIZE).
MAX_BODY_BYTES = 4 * 1024 * 1024
MAX_LIST = 1 << 20          # list entries (sample ids of a batch, batch ids of a commit)
MAX_STR = 16 * 1024         # characters of a string
MAX_MAP = 256               # entries of a map (metrics, pool descriptors)
MAX_METRICS = 64            # entries of a heartbeat's metrics
MAX_INT = 1 << 62           # ints: -1 ("none") .. MAX_INT


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
    reason: str = ""


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
    status: dict


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


def encode(msg: Message) -> list[bytes]:
    """Frames for `msg`: [kind byte, msgpack body]."""
    body = {f.name: getattr(msg, f.name) for f in dataclasses.fields(msg)}
    return [bytes((msg.KIND,)), msgpack.packb(body, use_bin_type=True)]


def decode(frames: list[bytes]) -> Message:
    """Inverse of `encode`; raises ProtocolError naming what is wrong."""
    if len(frames) != 2:
        raise ProtocolError(f"expected 2 frames (kind, body), got {len(frames)}")
    kind_frame, body_frame = frames
    if len(kind_frame) != 1:
        raise ProtocolError(f"kind frame must be 1 byte, got {len(kind_frame)}")
    try:
        kind = Kind(kind_frame[0])
    except ValueError:
        raise ProtocolError(f"unknown message kind {kind_frame[0]}") from None
    if len(body_frame) > MAX_BODY_BYTES:
        raise ProtocolError(f"{kind.name} body of {len(body_frame)} bytes exceeds {MAX_BODY_BYTES}")
    try:
        body = msgpack.unpackb(body_frame, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise ProtocolError(f"{kind.name}: undecodable body ({type(exc).__name__}: {exc})") from None
    cls = _CLASSES[kind]
    if not isinstance(body, dict):
        raise ProtocolError(f"{kind.name}: body must be a map, got {type(body).__name__}")
    hints = _HINTS[cls]
    names = {f.name for f in dataclasses.fields(cls)}
    required = {f.name for f in dataclasses.fields(cls)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    unknown, missing = set(body) - names, required - set(body)
    if unknown or missing:
        raise ProtocolError(f"{kind.name}: unknown fields {sorted(unknown)}, missing {sorted(missing)}")
    for name, value in body.items():
        if not _matches(value, hints[name]):
            raise ProtocolError(f"{kind.name}.{name}: {type(value).__name__} {value!r:.80} "
                                f"does not match {hints[name]}")
        # The bounds guard the dispatcher against its peers; a status comes from the
        # dispatcher and grows with the job (one entry per worker).
        if cls is not StatusReply and (why := _out_of_bounds(value)) is not None:
            raise ProtocolError(f"{kind.name}.{name}: {why}")
    if cls is Heartbeat and len(body.get("metrics", {})) > MAX_METRICS:
        raise ProtocolError(f"HEARTBEAT.metrics: {len(body['metrics'])} entries, at most {MAX_METRICS}")
    return cls(**body)


def _out_of_bounds(value: Any) -> str | None:
    """Why a decoded value is outside the wire's bounds (None: inside)."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int):
        return None if -1 <= value <= MAX_INT else f"integer {value:.6g} outside [-1, 2**62]"
    if isinstance(value, float):
        # |x| <= 2**62 as for ints: sums of a million such values stay finite in the status
        return None if math.isfinite(value) and abs(value) <= MAX_INT else f"{value} is not a finite number within 2**62"
    if isinstance(value, (str, bytes)):
        return None if len(value) <= MAX_STR else f"{len(value)} characters, at most {MAX_STR}"
    if isinstance(value, list):
        if len(value) > MAX_LIST:
            return f"{len(value)} entries, at most {MAX_LIST}"
        return next((why for v in value if (why := _out_of_bounds(v)) is not None), None)
    if isinstance(value, dict):
        if len(value) > MAX_MAP:
            return f"{len(value)} entries, at most {MAX_MAP}"
        return next((why for kv in value.items() for v in kv if (why := _out_of_bounds(v)) is not None), None)
    return f"{type(value).__name__} is not a wire value"  # msgpack extension types, timestamps


def _matches(value: Any, hint: Any) -> bool:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType")):
        return any(_matches(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if origin is list:
        (inner,) = typing.get_args(hint)
        return isinstance(value, list) and all(_matches(v, inner) for v in value)
    if origin is dict:
        key_hint, value_hint = typing.get_args(hint)
        return isinstance(value, dict) and all(
            _matches(k, key_hint) and _matches(v, value_hint) for k, v in value.items())
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint)
