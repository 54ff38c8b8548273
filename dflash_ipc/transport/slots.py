"""Slot pools: the one interface through which hidden states move from targets to drafters.

A *slot pool* is owned by one producer (a target worker). It is allocated once, as one
contiguous buffer cut into ``num_slots`` fixed-size slots, and described once by a
``descriptor()``: a plain dict (str/int/float/bytes/list only) that the protocol module
serialises and the dispatcher forwards to consumers. Per batch only ``(slot, num_tokens)``
travels. A consumer (a drafter worker) opens each pool once (``ReaderCache``) and copies
slots into its own memory with ``SlotReader.read``; once ``read`` returns, the copy is
complete and the slot may be handed back to its producer (the release message goes
through the dispatcher; it is not part of this module).

Two backends behind the same interface, chosen by the producer's device:

- ``shm`` (``transport/shm.py``): one POSIX shared-memory segment per pool, for CPU
  machines and tests. Writes are ordered by the Produced message itself.
- ``cuda_ipc`` (``transport/cuda_ipc.py``): one CUDA allocation per pool exported through
  a CUDA IPC handle, and one interprocess event per slot under ``publish_sync="ipc_event"``
  (none under ``"host_wait"``); GPU to GPU, never through the host.

Producer death is detected by pid plus process start time (to defeat pid reuse): a reader
raises ``ProducerGoneError`` instead of hanging or reading freed memory.

Typical use (``create_pool`` and ``ReaderCache`` pick the backend: ``transport/backends.py``)::

    # target
    pool = create_pool(SlotLayout(8, budget, 5 * hidden, "bfloat16"), "cuda:0", name=f"{run}-t0")
    send(pool.descriptor())
    view = pool.write_view(slot, n)        # [n, D], fill it on the current stream
    pool.publish(slot)                     # then report Produced(slot, n)
    # drafter
    readers = ReaderCache("cuda:5")
    hidden = readers.get(descriptor).read(slot, n)   # [n, D] on cuda:5; then report Consumed
"""

from __future__ import annotations

import logging
import os
import select
import socket
import weakref
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import psutil
import torch

from dflash_ipc.config import schema as config
from dflash_ipc.config.dtypes import TORCH_DTYPES as DTYPES
from dflash_ipc.errors import ConfigError, ProducerGoneError, TransportError
from dflash_ipc.run.process_start import start_ticks

logger = logging.getLogger(__name__)

# Slots start on this boundary so every copy starts aligned (DMA engines and vectorised
# copy kernels run at full speed only on aligned addresses).
SLOT_ALIGN_BYTES = 512
DESCRIPTOR_VERSION = 2
# How a GPU producer orders a consumer's read after its writes (see CudaIpcSlotPool):
# "ipc_event": one interprocess event per slot, recorded at publish, polled by the reader;
# "host_wait": publish waits on the producer's host until the writes are done, so the
# Produced message itself is the ordering and no interprocess event exists.
PUBLISH_SYNC_MODES = config.PUBLISH_SYNC_MODES
BACKENDS = ("shm", "cuda_ipc")
# Where a pool's producer has no start in clock ticks (no /proc): psutil's start times are
# rounded to clock ticks (10 ms); anything closer is the same process, anything further apart a
# reused pid (these times follow the wall clock: run/process_start.py).
_START_TIME_TOLERANCE_S = 0.05
DEFAULT_READ_TIMEOUT_S = 60.0


@dataclass(frozen=True, slots=True)
class SlotLayout:
    """Shape of every slot of a pool: ``num_slots`` slots of ``[max_tokens, feature_dim]``."""

    num_slots: int
    """Number of slots; a target can have this many batches produced but not yet consumed."""
    max_tokens: int
    """Packed tokens a slot holds; at least the token budget of a batch."""
    feature_dim: int
    """Width of one token's features: hidden size x number of captured layers."""
    dtype: str
    """Element type, one of ``DTYPES``."""

    def __post_init__(self) -> None:
        for field in ("num_slots", "max_tokens", "feature_dim"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"SlotLayout.{field} must be an int >= 1, got {value!r}")
        if self.dtype not in DTYPES:
            raise ConfigError(
                f"SlotLayout.dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}"
            )

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def itemsize(self) -> int:
        return self.torch_dtype.itemsize

    @property
    def slot_bytes(self) -> int:
        """Bytes of data one full slot holds."""
        return self.max_tokens * self.feature_dim * self.itemsize

    @property
    def slot_stride_bytes(self) -> int:
        """Distance between the starts of two slots (``slot_bytes`` rounded up)."""
        return -(-self.slot_bytes // SLOT_ALIGN_BYTES) * SLOT_ALIGN_BYTES

    @property
    def pool_bytes(self) -> int:
        return self.num_slots * self.slot_stride_bytes

    @staticmethod
    def required_max_tokens(token_budget: int) -> int:
        """Largest packed batch (valid tokens only) a token budget can produce."""
        if not isinstance(token_budget, int) or token_budget < 1:
            raise ConfigError(f"token_budget must be an int >= 1, got {token_budget!r}")
        # batch_size x padded_len <= budget, and packing keeps only valid tokens.
        return token_budget

    def to_dict(self) -> dict[str, Any]:
        return {
            "num_slots": self.num_slots,
            "max_tokens": self.max_tokens,
            "feature_dim": self.feature_dim,
            "dtype": self.dtype,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SlotLayout:
        try:
            return cls(
                num_slots=data["num_slots"],
                max_tokens=data["max_tokens"],
                feature_dim=data["feature_dim"],
                dtype=data["dtype"],
            )
        except (KeyError, TypeError) as exc:
            raise TransportError(f"slot pool descriptor: bad 'layout' {data!r}: {exc}") from exc

    def byte_range(self, slot: int, num_tokens: int) -> tuple[int, int]:
        """``(start, end)`` byte offsets of the first ``num_tokens`` rows of ``slot``."""
        if not isinstance(slot, int) or not 0 <= slot < self.num_slots:
            raise TransportError(
                f"slot {slot!r} out of range: pool has slots 0..{self.num_slots - 1}"
            )
        if not isinstance(num_tokens, int) or not 0 <= num_tokens <= self.max_tokens:
            raise TransportError(
                f"num_tokens {num_tokens!r} out of range: a slot holds 0..{self.max_tokens} tokens"
            )
        start = slot * self.slot_stride_bytes
        return start, start + num_tokens * self.feature_dim * self.itemsize


def slot_view(flat: torch.Tensor, layout: SlotLayout, slot: int, num_tokens: int) -> torch.Tensor:
    """``[num_tokens, feature_dim]`` view of ``slot`` inside a flat uint8 pool buffer."""
    start, end = layout.byte_range(slot, num_tokens)
    return flat[start:end].view(layout.torch_dtype).view(num_tokens, layout.feature_dim)


def check_out(out: torch.Tensor, layout: SlotLayout, num_tokens: int, device: torch.device) -> None:
    """Reject an ``out`` buffer that a slot copy cannot fill exactly."""
    want = (num_tokens, layout.feature_dim)
    if tuple(out.shape) != want or out.dtype != layout.torch_dtype or out.device != device:
        raise TransportError(
            f"read(out=...): need a tensor of shape {list(want)}, dtype {layout.dtype} on "
            f"{device}; got shape {list(out.shape)}, dtype {out.dtype} on {out.device}"
        )
    if not out.is_contiguous():
        raise TransportError("read(out=...): out must be contiguous")


class SlotPool(ABC):
    """Producer side of a slot pool, owned by one target.

    Use ``write_view`` to fill a slot, ``publish`` once the writes are issued, then report
    the slot as produced. Do not write a slot again until its consumer released it.
    """

    layout: SlotLayout

    @abstractmethod
    def descriptor(self) -> dict[str, Any]:
        """Msgpack-safe description of the pool; sent once, forwarded to consumers."""

    @abstractmethod
    def write_view(self, slot: int, num_tokens: int) -> torch.Tensor:
        """``[num_tokens, feature_dim]`` view of ``slot`` to fill."""

    @abstractmethod
    def publish(self, slot: int) -> None:
        """Mark the writes to ``slot`` issued so far as the batch a consumer will read."""

    @abstractmethod
    def poison(self, slot: int, value: float) -> None:
        """Fill all of ``slot`` with ``value`` (debug aid: a released slot must never be read)."""

    @abstractmethod
    def close(self) -> None:
        """Free the pool; idempotent. Readers of a closed pool get ``ProducerGoneError``."""

    def __enter__(self) -> SlotPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class SlotReader(ABC):
    """Consumer side of one producer's pool; open once per (consumer, pool) and reuse."""

    layout: SlotLayout
    pool_id: str

    @abstractmethod
    def read(self, slot: int, num_tokens: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Copy ``[num_tokens, feature_dim]`` of ``slot`` to the consumer's device.

        Ordered after the producer's ``publish``. When it returns the copy is complete, so
        the caller may release the slot at once. Raises ``ProducerGoneError`` when the
        producer died, ``TransportError`` on any other failure; never blocks longer than
        the reader's timeout.
        """

    @property
    @abstractmethod
    def last_copy_s(self) -> float | None:
        """Seconds the last ``read``'s copy itself took (None before the first read).

        Timed where the copy runs: with CUDA events on the copy stream for GPU pools, so
        it leaves out the wait for the producer's event and the host's wake-up, and
        separates bandwidth (bytes / this) from handoff latency.
        """

    @abstractmethod
    def close(self) -> None:
        """Unmap the pool; idempotent."""

    @abstractmethod
    def producer_alive(self) -> bool:
        """Whether the process that owns the pool still runs."""


# --- producer identity and liveness -------------------------------------------------------


def producer_identity() -> dict[str, Any]:
    """Who owns a pool: pid, process start (defeats pid reuse: in clock ticks since boot where
    /proc has it, run/process_start.py, else None; and as a wall-clock time) and host."""
    proc = psutil.Process(os.getpid())
    return {"pid": proc.pid, "start_ticks": start_ticks(proc.pid), "create_time": proc.create_time(),
            "host": socket.gethostname()}


class ProducerWatch:
    """Answers "is the producer of this pool still alive?" in about a microsecond.

    The descriptor's start is checked once against the live process (a reused pid has another
    start): its clock ticks since boot where both sides read them from /proc (exact, and
    blind to the wall clock's steps), else psutil's start times within a tolerance. After
    that a pidfd (Linux >= 5.3) refers to exactly that process and polls readable once it
    has exited, zombie or reaped. Where pidfds are unavailable, psutil re-reads /proc on
    every check (~40 us).
    """

    def __init__(self, identity: dict[str, Any], pool_id: str) -> None:
        self.pool_id = pool_id
        try:
            self.pid = int(identity["pid"])
            self.create_time = float(identity["create_time"])
            host = str(identity["host"])
            self.start_ticks = identity.get("start_ticks")
            if self.start_ticks is not None and (type(self.start_ticks) is not int or self.start_ticks < 0):
                raise ValueError("start_ticks")
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise TransportError(
                f"slot pool {pool_id}: descriptor 'producer' must hold pid, create_time and "
                f"host (and start_ticks, a count or null), got {identity!r}"
            ) from exc
        if host != socket.gethostname():
            raise TransportError(
                f"slot pool {pool_id} lives on host {host!r}, this is {socket.gethostname()!r}: "
                "hidden states never leave their node; assign batches to a drafter of that node"
            )
        self._proc: psutil.Process | None = None
        self._poller: select.poll | None = None
        self._finalizer: weakref.finalize | None = None
        pidfd = self._open_pidfd()
        if self._same_process():
            self._proc = psutil.Process(self.pid)
            if pidfd is not None:
                # Opened before the start-time check: if that check passed, the pidfd
                # cannot belong to a later process that reused the pid.
                self._poller = select.poll()
                self._poller.register(pidfd, select.POLLIN)
                self._finalizer = weakref.finalize(self, os.close, pidfd)
                pidfd = None
        if pidfd is not None:
            os.close(pidfd)

    def _open_pidfd(self) -> int | None:
        try:
            return os.pidfd_open(self.pid)  # type: ignore[attr-defined]
        except (AttributeError, OSError):
            return None  # not Linux, old kernel, sandbox, or already gone

    def _same_process(self) -> bool:
        if self.start_ticks is not None:
            return start_ticks(self.pid) == self.start_ticks  # None once gone
        try:
            found = psutil.Process(self.pid).create_time()
        except psutil.Error:
            return False
        return abs(found - self.create_time) <= _START_TIME_TOLERANCE_S

    def alive(self) -> bool:
        if self._proc is None:
            return False
        if self._poller is not None:
            return not self._poller.poll(0)
        try:
            # is_running() compares start times too, so a reused pid reads as dead.
            return self._proc.is_running() and self._proc.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    def check(self, when: str) -> None:
        """Raise ``ProducerGoneError`` if the producer is gone."""
        if not self.alive():
            raise ProducerGoneError(
                f"slot pool {self.pool_id}: producer pid {self.pid} (started at "
                f"{self.create_time:.2f}) is gone {when}; drop this batch, the dispatcher "
                "requeues it"
            )

    def close(self) -> None:
        if self._finalizer is not None:
            self._finalizer()


# --- descriptors --------------------------------------------------------------------------


def check_publish_sync(publish_sync: str) -> None:
    """ConfigError unless ``publish_sync`` is one of ``PUBLISH_SYNC_MODES``."""
    if publish_sync not in PUBLISH_SYNC_MODES:
        raise ConfigError(
            f"slot pool publish_sync {publish_sync!r} not allowed; allowed: {PUBLISH_SYNC_MODES}"
        )


def validate_descriptor(descriptor: Any) -> str:
    """Check the common descriptor fields; return the backend name."""
    if not isinstance(descriptor, dict):
        raise TransportError(
            f"slot pool descriptor must be a dict, got {type(descriptor).__name__}"
        )
    required = ("backend", "version", "pool_id", "layout", "producer")
    missing = [k for k in required if k not in descriptor]
    if missing:
        raise TransportError(f"slot pool descriptor lacks {missing}; has {sorted(descriptor)}")
    if descriptor["version"] != DESCRIPTOR_VERSION:
        raise TransportError(
            f"slot pool {descriptor['pool_id']}: descriptor version {descriptor['version']!r}, "
            f"this build reads version {DESCRIPTOR_VERSION}: run one dflash-ipc version per job"
        )
    if descriptor["backend"] not in BACKENDS:
        raise TransportError(
            f"slot pool {descriptor['pool_id']}: backend {descriptor['backend']!r}, "
            f"allowed {list(BACKENDS)}"
        )
    return descriptor["backend"]
