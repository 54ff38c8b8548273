"""Shared-memory slot pools: the CPU backend of ``transport/slots.py``.

One POSIX shared-memory segment per pool, named ``<name>-<producer pid>`` where ``name``
starts with the run's prefix, so the supervisor finds and unlinks what a killed producer
left behind (``list_segments`` / ``unlink_segments_with_prefix``).

Both sides map the segment file (``/dev/shm/<segment>``) with ``torch.from_file`` rather
than through ``multiprocessing.shared_memory.SharedMemory``: a torch-owned mapping lives
exactly as long as the tensors on it, so ``close()`` never fails with "exported pointers
exist", and nothing is registered with Python's resource_tracker, which would otherwise
unlink (or warn about) segments that consumers merely opened. The producer creates the
segment (``_create_segment``) and unlinks it itself on ``close()`` and at interpreter exit.

Ordering needs no events here: the producer writes, then sends Produced; by the time a
consumer hears of the slot the bytes are in the shared pages.
"""

from __future__ import annotations

import logging
import os
import re
import time
import weakref
from typing import Any

import torch

from dflash_ipc.errors import ConfigError, TransportError
from dflash_ipc.transport.slots import (
    DESCRIPTOR_VERSION,
    DEFAULT_READ_TIMEOUT_S,
    ProducerWatch,
    SlotLayout,
    SlotPool,
    SlotReader,
    check_out,
    producer_identity,
    slot_view,
)

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
# Segment names become file names in /dev/shm; keep them to a safe alphabet and leave room
# for the "-<pid>" suffix under NAME_MAX (255).
_NAME_RE = re.compile(r"^[A-Za-z0-9._-]{1,200}$")
_MIN_PREFIX_CHARS = 4


def _check_name(name: str, what: str) -> None:
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ConfigError(
            f"{what} {name!r}: use 1..200 characters of letters, digits, '.', '_' and '-'"
        )


def _require_dev_shm() -> None:
    if not os.path.isdir(SHM_DIR):
        raise TransportError(f"the shm slot backend needs Linux shared memory at {SHM_DIR}")


def _map(segment: str, nbytes: int) -> torch.Tensor:
    """Map ``/dev/shm/<segment>`` as a flat uint8 tensor, shared with other mappers."""
    path = os.path.join(SHM_DIR, segment)
    return torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)  # [nbytes]


def _map_existing(segment: str, nbytes: int) -> torch.Tensor | None:
    """Map a segment another process created, or None when it does not exist. Opened first
    without O_CREAT (``torch.from_file`` alone would create and size a segment unlinked a
    moment before, leaving a pool-sized file nobody owns), then mapped through that open file,
    and only if it holds ``nbytes`` (a mapping past its end would fault on the first read)."""
    path = os.path.join(SHM_DIR, segment)
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return None
    try:
        size = os.fstat(fd).st_size
        if size < nbytes:
            raise TransportError(f"shared-memory segment {path} holds {size} bytes, its descriptor says {nbytes}")
        return torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=nbytes, dtype=torch.uint8)  # [nbytes]
    finally:
        os.close(fd)


def _create_segment(segment: str, nbytes: int) -> None:
    """Create ``/dev/shm/<segment>`` of ``nbytes`` zero bytes, owner-only.

    This is what ``shm_open(O_CREAT | O_EXCL)`` + ``ftruncate`` (and so
    ``multiprocessing.shared_memory.SharedMemory(create=True)``) does on Linux, minus
    Python's resource_tracker: before 3.13 that tracker cannot be opted out of, starts an
    extra process per producer, and unlinks the segment when *its* owner exits (for a
    worker started by multiprocessing, the parent). Clean-up is ours instead: the producer
    unlinks on close and at exit, the supervisor sweeps by prefix after a SIGKILL.
    """
    path = os.path.join(SHM_DIR, segment)
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    except FileExistsError as exc:
        raise TransportError(
            f"shared-memory segment {path} already exists: a pool of this name is open in "
            "this process, or a stale one was left; unlink it first"
        ) from exc
    except OSError as exc:
        raise TransportError(f"cannot create shared-memory segment {path}: {exc}") from exc
    try:
        os.ftruncate(fd, nbytes)
    except OSError as exc:
        os.close(fd)
        _unlink_quietly(segment)
        raise TransportError(
            f"cannot size shared-memory segment {path} to {nbytes} bytes: {exc} "
            f"(is {SHM_DIR} large enough?)"
        ) from exc
    os.close(fd)


_OWN_SEGMENTS: set[str] = set()  # created by this process and not unlinked yet


def _unlink_quietly(segment: str) -> None:
    _OWN_SEGMENTS.discard(segment)
    try:
        os.unlink(os.path.join(SHM_DIR, segment))
    except FileNotFoundError:
        pass


def unlink_own_segments() -> None:
    """Unlinks every segment this process created and still holds: for a process about to
    SIGKILL itself (`ParentWatch`), whose finalizers will not run."""
    for segment in list(_OWN_SEGMENTS):
        _unlink_quietly(segment)


class ShmSlotPool(SlotPool):
    """Producer side: one shared-memory segment holding ``layout.num_slots`` slots."""

    def __init__(self, layout: SlotLayout, *, name: str) -> None:
        _check_name(name, "slot pool name")
        _require_dev_shm()
        self.layout = layout
        self.segment = f"{name}-{os.getpid()}"
        # Unlinks at interpreter exit too, if the owner forgets close(); SIGKILL leaves the
        # segment to the supervisor's prefix sweep. Registered before the segment exists, so
        # a SIGTERM (SystemExit) between the two cannot leave it behind.
        self._finalizer = weakref.finalize(self, _unlink_quietly, self.segment)
        try:
            _OWN_SEGMENTS.add(self.segment)
            _create_segment(self.segment, layout.pool_bytes)
        except TransportError:
            _OWN_SEGMENTS.discard(self.segment)
            # It cleaned up after itself; a segment of this name that exists is not ours.
            self._finalizer.detach()
            raise
        except BaseException:  # a signal mid-way: whatever was created is ours
            self._finalizer()
            raise
        try:
            self._flat: torch.Tensor | None = _map(self.segment, layout.pool_bytes)
        except Exception as exc:
            self._finalizer()
            raise TransportError(
                f"cannot map shared-memory segment {self.segment!r}: {exc}"
            ) from exc
        self._identity = producer_identity()
        logger.info(
            "shm slot pool %s: %d slots x %d tokens x %d (%s), %.1f MiB",
            self.segment, layout.num_slots, layout.max_tokens, layout.feature_dim,
            layout.dtype, layout.pool_bytes / 2**20,
        )

    def _buffer(self) -> torch.Tensor:
        if self._flat is None:
            raise TransportError(f"slot pool {self.segment} is closed")
        return self._flat

    def descriptor(self) -> dict[str, Any]:
        return {
            "backend": "shm",
            "version": DESCRIPTOR_VERSION,
            "pool_id": self.segment,
            "layout": self.layout.to_dict(),
            "producer": dict(self._identity),
            "segment": self.segment,
            "nbytes": self.layout.pool_bytes,
        }

    def write_view(self, slot: int, num_tokens: int) -> torch.Tensor:
        return slot_view(self._buffer(), self.layout, slot, num_tokens)  # [num_tokens, D]

    def publish(self, slot: int) -> None:
        # Host writes are visible to every mapper once they are done; the Produced message
        # that follows is the ordering.
        self.layout.byte_range(slot, 0)
        self._buffer()

    def poison(self, slot: int, value: float) -> None:
        slot_view(self._buffer(), self.layout, slot, self.layout.max_tokens).fill_(value)

    def close(self) -> None:
        if self._flat is None:
            return
        self._flat = None
        self._finalizer()
        logger.info("shm slot pool %s closed and unlinked", self.segment)


class ShmSlotReader(SlotReader):
    """Consumer side: maps a producer's segment once; ``read`` copies a slot out."""

    def __init__(
        self,
        descriptor: dict[str, Any],
        device: torch.device,
        *,
        timeout_s: float = DEFAULT_READ_TIMEOUT_S,
    ) -> None:
        _require_dev_shm()
        self.pool_id = str(descriptor["pool_id"])
        self.layout = SlotLayout.from_dict(descriptor["layout"])
        self.device = device
        self.timeout_s = timeout_s
        self._watch = ProducerWatch(descriptor["producer"], self.pool_id)
        try:
            segment, nbytes = descriptor["segment"], int(descriptor["nbytes"])
        except (KeyError, TypeError, ValueError) as exc:
            raise TransportError(f"shm slot pool {self.pool_id}: bad descriptor: {exc!r}") from exc
        _check_name(segment, "shm segment")
        if nbytes < self.layout.pool_bytes:
            raise TransportError(
                f"shm slot pool {self.pool_id}: segment of {nbytes} bytes is smaller than "
                f"its layout ({self.layout.pool_bytes} bytes)"
            )
        self._watch.check("when opening its pool")
        self._flat: torch.Tensor | None = _map_existing(segment, nbytes)
        if self._flat is None:
            self._watch.check("(its segment is unlinked)")
            raise TransportError(
                f"shm slot pool {self.pool_id}: segment {SHM_DIR}/{segment} does not exist "
                "although its producer runs: the pool was closed"
            )
        self._last_copy_s: float | None = None

    @property
    def last_copy_s(self) -> float | None:
        return self._last_copy_s

    def producer_alive(self) -> bool:
        return self._watch.alive()

    def read(self, slot: int, num_tokens: int, out: torch.Tensor | None = None) -> torch.Tensor:
        if self._flat is None:
            raise TransportError(f"reader of slot pool {self.pool_id} is closed")
        self._last_copy_s = None  # a read that fails leaves no copy time behind
        self._watch.check(f"before reading slot {slot}")
        src = slot_view(self._flat, self.layout, slot, num_tokens)  # [num_tokens, D]
        if out is None:
            out = torch.empty(src.shape, dtype=src.dtype, device=self.device)
        else:
            check_out(out, self.layout, num_tokens, self.device)
        start = time.perf_counter()
        out.copy_(src)
        if out.device.type == "cuda":
            # The caller releases the slot as soon as we return: the copy must be done.
            torch.cuda.current_stream(out.device).synchronize()
        self._last_copy_s = time.perf_counter() - start
        return out

    def close(self) -> None:
        if self._flat is not None:
            self._flat = None
            self._watch.close()


def list_segments(prefix: str) -> list[str]:
    """Names in /dev/shm starting with ``prefix`` (sorted)."""
    _check_name(prefix, "segment prefix")
    if len(prefix) < _MIN_PREFIX_CHARS:
        # A short prefix would sweep other programs' segments.
        raise ConfigError(
            f"segment prefix {prefix!r} is too short: use the run's prefix "
            f"(>= {_MIN_PREFIX_CHARS} characters)"
        )
    if not os.path.isdir(SHM_DIR):
        return []
    return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(prefix))


def unlink_segments_with_prefix(prefix: str) -> int:
    """Unlink every /dev/shm segment starting with ``prefix``; return the count removed."""
    removed = 0
    for segment in list_segments(prefix):
        try:
            os.unlink(os.path.join(SHM_DIR, segment))
            removed += 1
        except FileNotFoundError:
            pass  # its producer closed it meanwhile
    if removed:
        logger.info("unlinked %d leftover shared-memory segment(s) with prefix %r", removed, prefix)
    return removed
