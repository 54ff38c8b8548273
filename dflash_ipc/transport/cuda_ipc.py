"""CUDA IPC slot pools: the GPU backend of ``transport/slots.py``; no byte touches the host.

Producer (target):
- one plain ``cudaMalloc``-backed allocation per pool (never an expandable segment, see
  ``_allocate_pool_buffer``), exported once with ``UntypedStorage._share_cuda_()``;
- ``publish_sync="ipc_event"`` (default): one interprocess event per slot; ``publish(slot)``
  records it on the current stream and returns at once;
- ``publish_sync="host_wait"``: ``publish(slot)`` records a plain event and waits for it
  on the host, so the writes are done before the batch is announced and the reader needs
  no event. Why offer it: on a GPU that several processes share, recording an
  interprocess event makes the next work of the *other* processes on that GPU wait, which
  the reader pays on every read when it shares the producer's GPU (~214-265 us per read
  on an H200: ipc_event against host_wait reads, docs/benchmarks.md). The price is the
  producer's host waiting for its last writes, which a target hardly notices: its forward
  pass already synchronises once per batch.
The handle bytes travel in the msgpack descriptor; no pickle is involved anywhere.

Consumer (drafter):
- opens the pool once with ``UntypedStorage._new_shared_cuda(...)`` *on its own GPU*:
  ``cudaIpcOpenMemHandle`` maps a peer's memory into the current device's address space
  with peer access enabled, so the copy is an ordinary device-to-device copy on the
  drafter's own stream and the drafter never creates a CUDA context on a target's GPU;
- per ``read``: polls the slot's event on the host until the producer's writes are done
  (re-checking the producer's liveness, with a timeout; nothing to wait for under
  ``host_wait``), then copies on a private stream and waits for that copy. ``read``
  returns only once the copy is complete, so the caller may report Consumed at once.

Why host polling and not ``stream.wait_event(ipc_event)``: a GPU-side wait on an event of
a process that died can block the stream forever, and a blocking host wait would hang the
drafter with it. Polling ``query()`` with a liveness check and a timeout turns a dead
producer into ``ProducerGoneError``. Once the host has seen the event complete, the
producer's writes are done and visible, so the copy stream carries no dependency on
another process and its completion can be awaited with a plain (GIL-releasing) sync.

The storage-level API is private to torch; its tuple layout (8 fields, below) has been
the same from torch 1.x through 2.14. ``SUPPORTED_TORCH`` pins the range we checked and
every tuple is validated, so a change surfaces as a clear ``TransportError``.
"""

from __future__ import annotations

import logging
import os
import re
import time
from typing import Any, Callable

import torch

from dflash_ipc.errors import ConfigError, TransportError
from dflash_ipc.transport.slots import (
    DEFAULT_READ_TIMEOUT_S,
    DESCRIPTOR_VERSION,
    PUBLISH_SYNC_MODES,
    ProducerWatch,
    SlotLayout,
    SlotPool,
    SlotReader,
    check_out,
    check_publish_sync,
    producer_identity,
    slot_view,
)

logger = logging.getLogger(__name__)

# [min, max) of torch versions whose _share_cuda_/_new_shared_cuda layout we rely on.
SUPPORTED_TORCH = ((2, 6), (2, 15))
# (device, handle, size_bytes, offset_bytes, ref_counter_handle, ref_counter_offset,
#  event_handle, event_sync_required), as in torch/multiprocessing/reductions.py.
_SHARE_TUPLE_TYPES = (int, bytes, int, int, bytes, int, bytes, bool)
_CUDA_IPC_HANDLE_BYTES = 64
# Large enough to come from the allocator's large pool, which is where the pool comes from.
_PROBE_BYTES = (2 << 20) + 512
_NAME_RE = re.compile(r"^[A-Za-z0-9._-]{1,200}$")
# How often a waiting reader re-checks that the producer is alive.
LIVENESS_PERIOD_S = 0.05
# How long a waiting reader spins before it starts to sleep.
SPIN_S = 2e-4


def check_torch_version(version: str | None = None) -> None:
    """TransportError unless ``version`` (default: this torch) is in ``SUPPORTED_TORCH``."""
    version = torch.__version__ if version is None else version
    match = re.match(r"^(\d+)\.(\d+)", version)
    if match is None:
        raise TransportError(f"cannot parse torch version {version!r}")
    found = (int(match.group(1)), int(match.group(2)))
    low, high = SUPPORTED_TORCH
    if not low <= found < high:
        raise TransportError(
            f"cuda_ipc slot pools rebuild CUDA storages through torch's private "
            f"_share_cuda_/_new_shared_cuda, checked for torch {low[0]}.{low[1]} to "
            f"{high[0]}.{high[1] - 1}; found torch {version}. Re-check "
            "torch/multiprocessing/reductions.py and extend SUPPORTED_TORCH"
        )


def parse_share_tuple(share: Any) -> dict[str, Any]:
    """Validate what ``UntypedStorage._share_cuda_()`` returned; name its fields."""
    if not isinstance(share, tuple) or len(share) != len(_SHARE_TUPLE_TYPES):
        raise TransportError(
            f"UntypedStorage._share_cuda_() returned {type(share).__name__} of "
            f"{len(share) if isinstance(share, tuple) else '?'} fields, expected a tuple of "
            f"{len(_SHARE_TUPLE_TYPES)} (torch {torch.__version__}): the private API changed"
        )
    got = tuple(type(x).__name__ for x in share)
    for value, want in zip(share, _SHARE_TUPLE_TYPES):
        # bool is an int subclass; only the last field may be one.
        if not isinstance(value, want) or (want is int and isinstance(value, bool)):
            raise TransportError(
                f"UntypedStorage._share_cuda_() field types {got}, expected "
                f"{tuple(t.__name__ for t in _SHARE_TUPLE_TYPES)} (torch {torch.__version__})"
            )
    keys = (
        "device", "handle", "size_bytes", "offset_bytes",
        "ref_counter_handle", "ref_counter_offset", "event_handle", "event_sync_required",
    )
    return dict(zip(keys, share))


def _device_uuid(index: int) -> str:
    return str(getattr(torch.cuda.get_device_properties(index), "uuid", f"index-{index}"))


def _local_index_of(uuid: str) -> int | None:
    """This process's index of the GPU with ``uuid`` (None if not visible here)."""
    for index in range(torch.cuda.device_count()):
        if _device_uuid(index) == uuid:
            return index
    return None


def _check_cuda_device(device: torch.device, role: str) -> None:
    if device.type != "cuda":
        raise TransportError(f"cuda_ipc {role} needs a cuda:N device, got {device}")
    if not torch.cuda.is_available():
        raise TransportError(f"cuda_ipc {role} on {device}: CUDA is not available here")
    if device.index >= torch.cuda.device_count():
        raise TransportError(
            f"cuda_ipc {role} on {device}: only {torch.cuda.device_count()} GPU(s) visible"
        )


def check_pair(target: torch.device, drafter: torch.device) -> None:
    """TransportError unless the drafter GPU can read the target GPU's memory."""
    if not torch.cuda.is_available():
        raise TransportError(f"target {target} / drafter {drafter}: CUDA is not available here")
    count = torch.cuda.device_count()
    for dev in (target, drafter):
        if dev.index >= count:
            raise TransportError(f"device {dev} does not exist: {count} GPU(s) visible (cuda:0..)")
    if target.index == drafter.index:
        return
    if not torch.cuda.can_device_access_peer(drafter.index, target.index):
        raise TransportError(
            f"no peer access from drafter GPU {drafter} to target GPU {target}: the drafter "
            "cannot read that target's slots; change the device split or fix the topology "
            "(nvidia-smi topo -m)"
        )


def wait_until(
    done: Callable[[], bool],
    *,
    watch: ProducerWatch,
    timeout_s: float,
    what: str,
) -> None:
    """Poll ``done()`` until true, re-checking the producer; never waits unboundedly.

    Polling (not a blocking wait) is what keeps a dead producer from hanging the caller.
    Spins for the first ``SPIN_S`` (typical waits are microseconds, and a sleep costs tens
    of microseconds even when asked for zero), then sleeps with backoff up to 1 ms.
    """
    if done():
        return
    start = last_check = time.monotonic()
    sleep_s = 0.0
    while not done():
        now = time.monotonic()
        if now - last_check >= LIVENESS_PERIOD_S:
            watch.check(f"while waiting for {what}")
            last_check = now
        if now - start > timeout_s:
            watch.check(f"after waiting {timeout_s:.1f} s for {what}")
            raise TransportError(
                f"slot pool {watch.pool_id}: {what} not done after {timeout_s:.1f} s although "
                f"the producer (pid {watch.pid}) is alive"
            )
        if now - start > SPIN_S:
            sleep_s = min(1e-3, max(5e-5, 2 * sleep_s))
            time.sleep(sleep_s)


# --- allocation off the expandable-segments path ------------------------------------------


def _set_allocator_settings(settings: str) -> None:
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None) or getattr(
        torch._C, "_cuda_cudaCachingAllocator_set_allocator_settings", None
    )
    if setter is None:
        raise TransportError(
            f"torch {torch.__version__} has no allocator-settings setter; start the target "
            "without expandable_segments in PYTORCH_CUDA_ALLOC_CONF"
        )
    setter(settings)


def _segment_is_expandable(tensor: torch.Tensor) -> bool | None:
    """Whether the allocator segment holding ``tensor`` is expandable (None: not found)."""
    ptr = tensor.data_ptr()
    for seg in torch.cuda.memory_snapshot():
        if seg.get("device") != tensor.device.index:
            continue
        if seg["address"] <= ptr < seg["address"] + seg["total_size"]:
            return bool(seg.get("is_expandable", False))
    return None


def _env_wants_expandable() -> bool:
    keys = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
    conf = ",".join(os.environ.get(k, "") for k in keys)
    return "expandable_segments:true" in conf.replace(" ", "").lower()


def _allocate_pool_buffer(nbytes: int, device: torch.device) -> torch.Tensor:
    """One plain allocation of ``nbytes`` on ``device``, never from an expandable segment.

    Decision: keep torch's caching allocator (so the pool shows up in its statistics and
    ``_share_cuda_`` works on it) but make sure the block comes from a plain ``cudaMalloc``
    segment. Expandable segments are mapped with the cuMem* API, and their IPC path needs
    pidfd/ptrace rights that containers often lack; the legacy ``cudaIpcGetMemHandle`` path
    works everywhere. If expandable segments are on (seen on a small probe allocation, so
    a large pool is never allocated twice), they are switched off for this one allocation
    and back on right after; the result is verified in the allocator's snapshot.
    """
    backend = torch.cuda.get_allocator_backend()
    if backend != "native":
        raise TransportError(
            f"CUDA allocator backend is {backend!r}; cuda_ipc slot pools need the native "
            "caching allocator (remove backend:cudaMallocAsync from PYTORCH_CUDA_ALLOC_CONF)"
        )
    probe = torch.empty(_PROBE_BYTES, dtype=torch.uint8, device=device)
    expandable = _segment_is_expandable(probe)
    del probe
    if expandable is None:
        expandable = _env_wants_expandable()
    if not expandable:
        buf = torch.empty(nbytes, dtype=torch.uint8, device=device)  # [nbytes]
    else:
        logger.info("expandable segments are on: allocating the slot pool outside them")
        _set_allocator_settings("expandable_segments:False")
        try:
            # Free cached blocks first: a free block of an expandable segment would otherwise
            # serve this request, whatever the setting says now. And ask for a large-pool
            # block at least: small requests share the small pool's segments.
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()
            buf = torch.empty(max(nbytes, _PROBE_BYTES), dtype=torch.uint8, device=device)[:nbytes]  # [nbytes]
        finally:
            _set_allocator_settings("expandable_segments:True")
    if _segment_is_expandable(buf):
        raise TransportError(
            f"slot pool on {device} landed in an expandable segment; CUDA IPC cannot export "
            "it. Start targets without expandable_segments:True in PYTORCH_CUDA_ALLOC_CONF"
        )
    return buf


# --- producer -------------------------------------------------------------------------------


class CudaIpcSlotPool(SlotPool):
    """Producer side: one exported CUDA allocation, one interprocess event per slot."""

    def __init__(
        self, layout: SlotLayout, device: torch.device, *, name: str,
        publish_sync: str = "ipc_event",
    ) -> None:
        if not isinstance(name, str) or not _NAME_RE.match(name):
            raise ConfigError(
                f"slot pool name {name!r}: use 1..200 letters, digits, '.', '_' and '-'"
            )
        check_publish_sync(publish_sync)
        self.publish_sync = publish_sync
        check_torch_version()
        _check_cuda_device(device, "slot pool")
        self.layout = layout
        self.device = device
        self.pool_id = f"{name}-{os.getpid()}"
        with torch.cuda.device(device):
            try:
                flat = _allocate_pool_buffer(layout.pool_bytes, device)  # [pool_bytes] uint8
                self._flat: torch.Tensor | None = flat
            except torch.cuda.OutOfMemoryError as exc:
                raise TransportError(
                    f"slot pool {self.pool_id}: cannot allocate {layout.pool_bytes / 2**30:.2f} "
                    f"GiB on {device} ({layout.num_slots} slots x {layout.slot_bytes} bytes)"
                ) from exc
            self._share = parse_share_tuple(self._flat.untyped_storage()._share_cuda_())
            # ipc_event: one exported event per slot; host_wait: none (publish waits on
            # `_written`, a plain event of this process).
            exported = layout.num_slots if publish_sync == "ipc_event" else 0
            self._events = [torch.cuda.Event(interprocess=True) for _ in range(exported)]
            # ipc_handle() creates the event on the current device (the pool's).
            self._event_handles = [bytes(e.ipc_handle()) for e in self._events]
            self._written = torch.cuda.Event()
        self._identity = producer_identity()
        self._uuid = _device_uuid(device.index)
        logger.info(
            "cuda_ipc slot pool %s on %s: %d slots x %d tokens x %d (%s), %.1f MiB, publish %s",
            self.pool_id, device, layout.num_slots, layout.max_tokens, layout.feature_dim,
            layout.dtype, layout.pool_bytes / 2**20, publish_sync,
        )

    def _buffer(self) -> torch.Tensor:
        if self._flat is None:
            raise TransportError(f"slot pool {self.pool_id} is closed")
        return self._flat

    def descriptor(self) -> dict[str, Any]:
        share = self._share
        return {
            "backend": "cuda_ipc",
            "version": DESCRIPTOR_VERSION,
            "pool_id": self.pool_id,
            "layout": self.layout.to_dict(),
            "producer": dict(self._identity),
            "device_index": self.device.index,
            "device_uuid": self._uuid,
            "torch_version": torch.__version__,
            "storage": {
                "handle": share["handle"],
                "size_bytes": share["size_bytes"],
                "offset_bytes": share["offset_bytes"],
                "ref_counter_handle": share["ref_counter_handle"],
                "ref_counter_offset": share["ref_counter_offset"],
            },
            "publish_sync": self.publish_sync,
            "slot_events": list(self._event_handles),
        }

    def write_view(self, slot: int, num_tokens: int) -> torch.Tensor:
        return slot_view(self._buffer(), self.layout, slot, num_tokens)  # [num_tokens, D]

    def publish(self, slot: int, stream: torch.cuda.Stream | None = None) -> None:
        """Order readers of ``slot`` after the writes issued on ``stream`` (default: the
        current stream; issue the writes there, or make it wait for the stream that wrote).

        ``ipc_event``: records the slot's interprocess event and returns. ``host_wait``:
        returns once those writes are done (the wait releases the GIL).
        """
        self.layout.byte_range(slot, 0)
        self._buffer()
        stream = stream or torch.cuda.current_stream(self.device)
        if self.publish_sync == "ipc_event":
            self._events[slot].record(stream)
            return
        self._written.record(stream)
        try:
            self._written.synchronize()
        except RuntimeError as exc:
            raise TransportError(
                f"slot pool {self.pool_id}: writes to slot {slot} failed on {self.device}: {exc}"
            ) from exc

    def poison(self, slot: int, value: float) -> None:
        with torch.cuda.device(self.device):
            slot_view(self._buffer(), self.layout, slot, self.layout.max_tokens).fill_(value)

    def close(self) -> None:
        if self._flat is None:
            return
        # Readers that still map the pool keep its memory alive through torch's IPC
        # ref-counting (the block waits in torch's limbo until they let go).
        self._flat = None
        self._events = []
        logger.info("cuda_ipc slot pool %s closed", self.pool_id)


# --- consumer -------------------------------------------------------------------------------


class CudaIpcSlotReader(SlotReader):
    """Consumer side: the producer's pool mapped into this process's GPU, opened once."""

    def __init__(
        self,
        descriptor: dict[str, Any],
        device: torch.device,
        *,
        timeout_s: float = DEFAULT_READ_TIMEOUT_S,
    ) -> None:
        check_torch_version()
        _check_cuda_device(device, "slot reader")
        self.pool_id = str(descriptor["pool_id"])
        self.layout = SlotLayout.from_dict(descriptor["layout"])
        self.device = device
        self._index = device.index
        self.timeout_s = timeout_s
        self._watch = ProducerWatch(descriptor["producer"], self.pool_id)
        storage, handles, uuid, self.publish_sync = self._parse(descriptor)
        self._check_peer(uuid)
        self._watch.check("when opening its pool")
        start = time.perf_counter()
        with torch.cuda.device(device):
            try:
                # event_sync_required=False: the export-time event orders nothing we need
                # (slots are read only after a publish, which has its own event), and
                # waiting on it would be a GPU-side wait on a foreign event.
                raw = torch.UntypedStorage._new_shared_cuda(
                    device.index, storage["handle"], storage["size_bytes"],
                    storage["offset_bytes"], storage["ref_counter_handle"],
                    storage["ref_counter_offset"], bytes(_CUDA_IPC_HANDLE_BYTES), False,
                )
                self._events = [
                    torch.cuda.Event.from_ipc_handle(device.index, h) for h in handles
                ]
            except RuntimeError as exc:
                self._watch.check("while opening its CUDA IPC handles")
                raise TransportError(
                    f"slot pool {self.pool_id}: cannot open its CUDA IPC handles on {device}: {exc}"
                ) from exc
            flat = torch.empty(0, dtype=torch.uint8, device=device).set_(raw)  # [size_bytes]
            self._flat: torch.Tensor | None = flat
            self._stream = torch.cuda.Stream(device=device)
            # Timing events: a record costs about what a plain one does, and the copy's own
            # duration is what tells bandwidth apart from handoff latency.
            self._started = torch.cuda.Event(enable_timing=True)
            self._done = torch.cuda.Event(enable_timing=True)
            self._timed = False
        logger.info(
            "opened cuda_ipc slot pool %s (producer GPU %s) on %s in %.1f ms",
            self.pool_id, uuid, device, (time.perf_counter() - start) * 1e3,
        )

    def _parse(self, descriptor: dict[str, Any]) -> tuple[dict[str, Any], list[bytes], str, str]:
        try:
            storage = descriptor["storage"]
            handles = list(descriptor["slot_events"])
            uuid = str(descriptor["device_uuid"])
            publish_sync = descriptor["publish_sync"]
            fields = {
                "handle": bytes, "size_bytes": int, "offset_bytes": int,
                "ref_counter_handle": bytes, "ref_counter_offset": int,
            }
            bad = [k for k, t in fields.items() if not isinstance(storage.get(k), t)]
        except (KeyError, TypeError, AttributeError) as exc:
            raise TransportError(
                f"cuda_ipc slot pool {self.pool_id}: bad descriptor: {exc!r}"
            ) from exc
        if bad:
            raise TransportError(
                f"cuda_ipc slot pool {self.pool_id}: descriptor storage fields {bad} missing or "
                "of the wrong type (expected bytes handles and int sizes)"
            )
        if publish_sync not in PUBLISH_SYNC_MODES:
            raise TransportError(
                f"cuda_ipc slot pool {self.pool_id}: descriptor publish_sync {publish_sync!r}, "
                f"expected one of {PUBLISH_SYNC_MODES}"
            )
        wanted = self.layout.num_slots if publish_sync == "ipc_event" else 0
        if len(handles) != wanted or not all(isinstance(h, bytes) for h in handles):
            raise TransportError(
                f"cuda_ipc slot pool {self.pool_id}: publish_sync {publish_sync} needs {wanted} "
                f"event handles (bytes), got {len(handles)}"
            )
        if storage["size_bytes"] < self.layout.pool_bytes:
            raise TransportError(
                f"cuda_ipc slot pool {self.pool_id}: storage of {storage['size_bytes']} bytes is "
                f"smaller than its layout ({self.layout.pool_bytes} bytes)"
            )
        return storage, handles, uuid, publish_sync

    def _check_peer(self, uuid: str) -> None:
        producer = _local_index_of(uuid)
        if producer is None or producer == self.device.index:
            return  # same GPU, or not visible here (the IPC open then reports any problem)
        if not torch.cuda.can_device_access_peer(self.device.index, producer):
            raise TransportError(
                f"slot pool {self.pool_id}: no peer access from drafter GPU {self.device} to "
                f"target GPU cuda:{producer} ({uuid})"
            )

    def producer_alive(self) -> bool:
        return self._watch.alive()

    def _wait_event(self, event: torch.cuda.Event, what: str) -> None:
        def done() -> bool:
            try:
                return event.query()
            except RuntimeError as exc:
                self._watch.check(f"while waiting for {what}")
                raise TransportError(f"slot pool {self.pool_id}: {what} failed: {exc}") from exc

        wait_until(done, watch=self._watch, timeout_s=self.timeout_s, what=what)

    def read(self, slot: int, num_tokens: int, out: torch.Tensor | None = None) -> torch.Tensor:
        if self._flat is None:
            raise TransportError(f"reader of slot pool {self.pool_id} is closed")
        self._timed = False  # a read that fails leaves no copy time behind
        self._watch.check(f"before reading slot {slot}")
        src = slot_view(self._flat, self.layout, slot, num_tokens)  # [num_tokens, D], peer memory
        if self.publish_sync == "ipc_event":  # under host_wait the writes were done before the notice
            self._wait_event(self._events[slot], f"the producer's writes to slot {slot}")
        caller = torch.cuda.current_stream(self._index)
        allocated = out is None
        with torch.cuda.stream(self._stream):
            if out is None:
                # Allocated on the copy stream, so no block still in use by another stream.
                out = torch.empty(src.shape, dtype=src.dtype, device=self.device)
            else:
                check_out(out, self.layout, num_tokens, self.device)
                self._stream.wait_stream(caller)  # the caller's stream may still use `out`
            self._started.record(self._stream)
            out.copy_(src, non_blocking=True)
            self._done.record(self._stream)
        try:
            # The producer's writes were seen complete above, so the copy stream waits on
            # nothing of another process: this blocking wait is bounded by our own work,
            # and it releases the GIL while it waits.
            self._done.synchronize()
        except RuntimeError as exc:
            self._watch.check(f"while slot {slot} was copied")
            raise TransportError(
                f"slot pool {self.pool_id}: copy of slot {slot} failed: {exc}"
            ) from exc
        self._timed = True
        if allocated:
            out.record_stream(caller)  # the caller uses it next; free only after that use
        # A producer that died during the copy may have taken its memory with it.
        self._watch.check(f"while slot {slot} was copied")
        return out  # [num_tokens, D] on self.device

    @property
    def last_copy_s(self) -> float | None:
        if not self._timed:
            return None
        return self._started.elapsed_time(self._done) / 1e3  # both complete: read synced

    def close(self) -> None:
        if self._flat is None:
            return
        self._flat = None
        self._events = []
        self._watch.close()
