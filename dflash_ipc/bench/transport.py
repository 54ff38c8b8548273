"""``dflash-ipc bench transport``: slot handoff latency and copy bandwidth between processes.

For each (producer device, consumer device) pair, a producer process owns a slot pool and
the bench process reads from it, exactly as a target and a drafter do. Per batch:

- *handoff latency*: from the producer's ``publish`` (GPU idle, so production time is not
  counted) to the consumer's ``read`` returning with the copy complete; it includes the
  notification (a pipe here, ZMQ through the dispatcher in a job) and the liveness checks;
- *read*: wall-clock time inside ``read``;
- *copy bandwidth*: bytes / duration of the copy itself, timed where it runs (CUDA events
  on the reader's copy stream; ``SlotReader.last_copy_s``);
- *baseline*: a plain in-process ``dst.copy_(src)`` between the same two devices, in the
  same run, timed both ways (wall clock to completion, and CUDA events around the copy),
  and once more by wall clock from where a read starts: the producer has just recorded an
  event and notified, and the time includes waiting for that event (*sw*). The goal is
  copy bandwidth >= 90% of the baseline's for batch-sized copies.

On one GPU shared by two processes, a fixed cost per read comes from the producer's side
of the handoff, not from the copy: with ``publish_sync="ipc_event"`` the recording of an
interprocess event makes the next work of the other process on that GPU wait (about
250-300 us per read on an H200, whatever is copied: the *sw* baseline pays it too);
``"host_wait"`` records no such event. The wall-clock ``ratio`` includes that cost.

``settle_us`` (a diagnostic) makes the reader wait that long after the producer's notice
before reading: the cost does not fade with time.

On a machine without CUDA the default pair is ``("cpu", "cpu")`` (shared-memory backend).

Run manual::

    from dflash_ipc.bench.transport import run_transport_bench
    run_transport_bench(pairs=[("cuda:0", "cuda:0"), ("cuda:0", "cuda:1")],
                        sizes_mib=[1, 16, 128, 512], iters=20)
"""

from __future__ import annotations

import base64
import json
import logging
import multiprocessing as mp
import os
import statistics
import struct
import time
from typing import Any, Callable, Sequence

import torch

from dflash_ipc.errors import ConfigError, TransportError
from dflash_ipc.transport.backends import create_pool, open_reader, unlink_segments
from dflash_ipc.transport.slots import PUBLISH_SYNC_MODES, SlotLayout

logger = logging.getLogger(__name__)

_PRODUCED = struct.Struct("<iiq")  # slot, num_tokens, publish time (perf_counter_ns)
_RELEASE = struct.Struct("<i")  # slot; or one of the commands below
_CLOSE = -1  # the producer closes its pool and exits
_MARK = -2  # the producer records its marker event as a publish would, and answers on `marked`
_NEXT = -3  # the producer publishes the next size's batches (none before: the consumer's
            # baseline of the previous size runs with nothing of the producer's in between)
_RECV_TIMEOUT_S = 120.0
DEFAULT_CPU_SIZES_MIB = (1, 16, 64)
DEFAULT_GPU_SIZES_MIB = (1, 16, 128, 512)


def _encode(obj: Any) -> bytes:
    """JSON with bytes as base64: enough for a descriptor, and no pickle on the wire."""
    def default(o: Any) -> Any:
        if isinstance(o, bytes):
            return {"__b64__": base64.b64encode(o).decode()}
        raise TypeError(type(o).__name__)

    return json.dumps(obj, default=default).encode()


def _decode(raw: bytes) -> Any:
    def hook(d: dict) -> Any:
        return base64.b64decode(d["__b64__"]) if set(d) == {"__b64__"} else d

    return json.loads(raw, object_hook=hook)


def _recv(conn: Any, what: str) -> bytes:
    if not conn.poll(_RECV_TIMEOUT_S):
        raise TransportError(f"transport bench: no {what} within {_RECV_TIMEOUT_S:.0f} s")
    return conn.recv_bytes()


def _spin_until(done: Callable[[], bool]) -> None:
    deadline = time.monotonic() + _RECV_TIMEOUT_S
    while not done():
        if time.monotonic() > deadline:
            raise TransportError(
                f"transport bench: the producer's marker event not done in {_RECV_TIMEOUT_S:.0f} s"
            )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _ProducerInbox:
    """The producer's side of the command pipe: one command at a time, whatever its kind."""

    def __init__(self, conn: Any, marked: Any, dev: torch.device, publish_sync: str) -> None:
        self.conn, self.marked, self.dev = conn, marked, dev
        self.free: list[int] = []
        # An event outside the pool, for the baseline started where a read starts.
        self.marker, self.handle = None, None
        if dev.type == "cuda":
            self.marker = torch.cuda.Event(interprocess=publish_sync == "ipc_event")
            if publish_sync == "ipc_event":
                self.handle = bytes(self.marker.ipc_handle())

    def handle_one(self, what: str) -> int:
        """Receive one command and act on it: a slot release joins ``free``, a ``_MARK`` is
        answered; return the command."""
        (command,) = _RELEASE.unpack(_recv(self.conn, what))
        if command >= 0:
            self.free.append(command)
        elif command == _MARK:
            _sync(self.dev)  # as before a publish
            if self.marker is not None:
                # What a publish puts on the GPU, and the same wait (none, or the host's).
                self.marker.record()
                if self.handle is None:  # host_wait
                    self.marker.synchronize()
            self.marked.send_bytes(b"m")
        return command

    def wait_for(self, wanted: int, what: str) -> None:
        while self.handle_one(what) != wanted:
            pass


def _producer_main(
    conn: Any, marked: Any, device: str, layout_d: dict, plan: list[tuple[int, int]], name: str,
    publish_sync: str,
) -> None:
    """For each (token count, batches) of ``plan``, once told ``_NEXT``: publish that many
    batches as fast as slots come back."""
    torch.set_num_threads(1)
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    layout = SlotLayout(**layout_d)
    pool = create_pool(layout, dev, name=name, publish_sync=publish_sync)
    try:
        for slot in range(layout.num_slots):
            pool.poison(slot, 1.0)  # touch every page once, outside the timed loop
        _sync(dev)
        inbox = _ProducerInbox(conn, marked, dev, publish_sync)
        inbox.free = list(range(layout.num_slots))
        conn.send_bytes(_encode({"descriptor": pool.descriptor(), "marker": inbox.handle}))
        for num_tokens, count in plan:
            inbox.wait_for(_NEXT, "the next size")
            for _ in range(count):
                while conn.poll(0) or not inbox.free:
                    if inbox.handle_one("release") in (_NEXT, _CLOSE):
                        raise TransportError("transport bench: a size began before the last ended")
                slot = inbox.free.pop(0)
                _sync(dev)  # the GPU is idle: latency counts the handoff, not production
                start = time.perf_counter_ns()
                pool.publish(slot)
                conn.send_bytes(_PRODUCED.pack(slot, num_tokens, start))
        inbox.wait_for(_CLOSE, "final release")
    finally:
        pool.close()


def _baseline_s(
    src_dev: torch.device, dst_dev: torch.device, nbytes: int, iters: int, warmup: int,
    mark_producer: Callable[[], Callable[[], None]],
) -> tuple[list[float], list[float], list[float]]:
    """Seconds per plain ``dst.copy_(src)`` between the two devices, in this process:
    wall clock to completion, the copy alone (CUDA events; the wall time on CPU), and the
    wall clock of the same copy started where a read starts (the producer has just recorded
    an event and notified; the time includes waiting for that event, as a read's does)."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=src_dev)  # [nbytes]
    dst = torch.empty(nbytes, dtype=torch.uint8, device=dst_dev)  # [nbytes]
    on_gpu = dst_dev.type == "cuda"
    if on_gpu:
        # torch runs a cross-device copy on the source's stream, fenced by events against
        # the destination's current stream: events on the latter bracket the whole copy.
        started, done = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        stream = torch.cuda.current_stream(dst_dev)

    def timed_copy(wait: Callable[[], None] | None = None) -> float:
        _sync(src_dev)
        _sync(dst_dev)
        start = time.perf_counter()
        if wait is not None:
            wait()
        if on_gpu:
            started.record(stream)
        dst.copy_(src)
        if on_gpu:
            done.record(stream)
        _sync(dst_dev)
        _sync(src_dev)
        return time.perf_counter() - start

    walls, copies, switched = [], [], []
    for i in range(warmup + iters):
        after_switch = timed_copy(mark_producer())
        wall = timed_copy()  # nothing of the producer's ran in between
        if i >= warmup:
            switched.append(after_switch)
            walls.append(wall)
            copies.append(started.elapsed_time(done) / 1e3 if on_gpu else wall)
    del src, dst
    return walls, copies, switched


def _consume(
    reader: Any, conn: Any, out: torch.Tensor, count: int, settle_s: float
) -> tuple[list[float], list[float], list[float]]:
    """Read ``count`` batches; return handoff latencies, read times and copy times (s)."""
    latencies, reads, copies = [], [], []
    for _ in range(count):
        slot, num_tokens, published = _PRODUCED.unpack(_recv(conn, "produced batch"))
        if settle_s > 0:
            time.sleep(settle_s)
        start = time.perf_counter_ns()
        reader.read(slot, num_tokens, out=out[:num_tokens])
        end = time.perf_counter_ns()
        conn.send_bytes(_RELEASE.pack(slot))
        # perf_counter_ns is CLOCK_MONOTONIC on Linux: comparable across processes.
        latencies.append((end - published) / 1e9)
        reads.append((end - start) / 1e9)
        copies.append(reader.last_copy_s)
    return latencies, reads, copies


def _row(
    src: str, dst: str, mib: float, nbytes: int, open_ms: float, settle_us: float,
    latencies: list[float], reads: list[float], copies: list[float],
    base: list[float], base_copies: list[float], base_switched: list[float],
) -> dict[str, Any]:
    p99 = sorted(latencies)[min(len(latencies) - 1, int(0.99 * len(latencies)))]
    read_s, base_s = statistics.median(reads), statistics.median(base)
    copy_s, base_copy_s = statistics.median(copies), statistics.median(base_copies)
    switched_s = statistics.median(base_switched)
    return {
        "src": src, "dst": dst, "size_mib": mib, "bytes": nbytes, "iters": len(reads),
        "open_ms": open_ms, "settle_us": settle_us,
        "latency_p50_us": statistics.median(latencies) * 1e6,
        "latency_p99_us": p99 * 1e6,
        "read_p50_us": read_s * 1e6,
        "read_gbps": nbytes / read_s / 1e9,
        "baseline_p50_us": base_s * 1e6,
        "baseline_gbps": nbytes / base_s / 1e9,
        "ratio": base_s / read_s,
        "baseline_switched_p50_us": switched_s * 1e6,
        "switched_ratio": switched_s / read_s,
        "copy_p50_us": copy_s * 1e6,
        "copy_gbps": nbytes / copy_s / 1e9,
        "baseline_copy_gbps": nbytes / base_copy_s / 1e9,
        "copy_ratio": base_copy_s / copy_s,
    }


def _bench_pair(
    src: str, dst: str, sizes_mib: Sequence[float], iters: int, warmup: int,
    feature_dim: int, dtype: str, settle_us: float, publish_sync: str,
) -> list[dict[str, Any]]:
    src_dev, dst_dev = torch.device(src), torch.device(dst)
    token_bytes = feature_dim * SlotLayout(1, 1, feature_dim, dtype).itemsize
    tokens = [max(1, int(mib * 2**20) // token_bytes) for mib in sizes_mib]
    layout = SlotLayout(num_slots=2, max_tokens=max(tokens), feature_dim=feature_dim, dtype=dtype)
    plan = [(n, warmup + iters) for n in tokens]
    prefix = f"dfbench{os.getpid()}-"  # the "-": pid 123 must not sweep pid 1234's segments
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    marked, marked_theirs = ctx.Pipe(duplex=False)
    args = (theirs, marked_theirs, src, layout.to_dict(), plan, prefix, publish_sync)
    proc = ctx.Process(target=_producer_main, args=args, daemon=True)
    proc.start()
    rows = []
    threads = torch.get_num_threads()

    marker_done: Callable[[], bool] = lambda: True

    def mark_producer() -> Callable[[], None]:
        """Have the producer record its marker; return the wait for it (a read's wait)."""
        ours.send_bytes(_RELEASE.pack(_MARK))
        _recv(marked, "producer's marker")
        return lambda: _spin_until(marker_done)

    if src_dev.type == "cpu":
        # One thread, like the producer: on a busy host, waking a thread pool for each
        # copy costs milliseconds and would measure the scheduler, not the transport.
        torch.set_num_threads(1)
    try:
        hello = _decode(_recv(ours, "pool descriptor"))
        descriptor = hello["descriptor"]
        if hello["marker"] is not None:
            marker = torch.cuda.Event.from_ipc_handle(dst_dev.index, hello["marker"])
            marker_done = marker.query
        opened = time.perf_counter()
        reader = open_reader(descriptor, dst_dev)
        open_ms = (time.perf_counter() - opened) * 1e3
        out = torch.empty(layout.max_tokens, feature_dim, dtype=layout.torch_dtype, device=dst_dev)
        for mib, n in zip(sizes_mib, tokens):
            ours.send_bytes(_RELEASE.pack(_NEXT))
            latencies, reads, copies = _consume(reader, ours, out, warmup + iters, settle_us / 1e6)
            measured = latencies[warmup:], reads[warmup:], copies[warmup:]
            nbytes = n * token_bytes
            base = _baseline_s(src_dev, dst_dev, nbytes, iters, warmup, mark_producer)
            row = _row(src, dst, mib, nbytes, open_ms, settle_us, *measured, *base)
            rows.append({**row, "publish_sync": publish_sync})
        # Unmap first: the producer then exits with no reader left on its memory.
        reader.close()
        ours.send_bytes(_RELEASE.pack(_CLOSE))
        proc.join(_RECV_TIMEOUT_S)
    finally:
        torch.set_num_threads(threads)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
        unlink_segments(prefix)
    return rows


def _default_pairs() -> list[tuple[str, str]]:
    if not torch.cuda.is_available():
        return [("cpu", "cpu")]
    pairs = [("cuda:0", "cuda:0")]
    if torch.cuda.device_count() > 1:
        pairs.append(("cuda:0", "cuda:1"))
    return pairs


def _check_pairs(pairs: Sequence[tuple[str, str]]) -> None:
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for pair in pairs:
        for device in pair:
            dev = torch.device(device)
            if dev.type == "cuda" and (dev.index is None or dev.index >= count):
                raise ConfigError(
                    f"bench transport: device {device!r} of pair {pair} needs cuda:N with "
                    f"N < {count} (GPUs visible here)"
                )
        if torch.device(pair[0]).type != torch.device(pair[1]).type:
            raise ConfigError(f"bench transport: pair {pair} mixes cpu and cuda; use two of a kind")


def run_transport_bench(
    pairs: Sequence[tuple[str, str]] | None = None,
    sizes_mib: Sequence[float] | None = None,
    iters: int = 20,
    *,
    warmup: int = 3,
    feature_dim: int = 4096,
    dtype: str = "bfloat16",
    settle_us: float = 0.0,
    publish_sync: str = "ipc_event",
    print_fn: Callable[[str], None] = print,
) -> list[dict[str, Any]]:
    """Measure slot handoff between two processes per device pair; print and return rows.

    Each row: src, dst, size_mib, bytes, iters, publish_sync (how the producer publishes:
    ``transport.slots.PUBLISH_SYNC_MODES``), open_ms (opening the pool once), settle_us,
    latency_p50_us / latency_p99_us (publish -> read complete), read_p50_us (inside
    ``read``), read_gbps, baseline_gbps / baseline_p50_us (in-process copy between the same
    devices, wall clock) and ratio = read / baseline; baseline_switched_p50_us (the same
    copy started where a read starts) and switched_ratio = read / that;
    copy_p50_us, copy_gbps, baseline_copy_gbps and copy_ratio: the copy alone, timed
    where it runs.
    """
    if publish_sync not in PUBLISH_SYNC_MODES:
        raise ConfigError(
            f"bench transport: publish_sync {publish_sync!r} not allowed; allowed: "
            f"{PUBLISH_SYNC_MODES}"
        )
    if iters < 1 or warmup < 0 or settle_us < 0:
        raise ConfigError(
            f"bench transport: iters must be >= 1, warmup >= 0 and settle_us >= 0, got "
            f"{iters}, {warmup}, {settle_us}"
        )
    pairs = list(pairs) if pairs is not None else _default_pairs()
    _check_pairs(pairs)
    if sizes_mib is None:
        on_gpu = any(torch.device(s).type == "cuda" for s, _ in pairs)
        sizes_mib = DEFAULT_GPU_SIZES_MIB if on_gpu else DEFAULT_CPU_SIZES_MIB
    rows = []
    print_fn(f"publish_sync {publish_sync}")
    print_fn(
        f"{'src':>7} {'dst':>7} {'MiB':>6} {'open ms':>7} {'handoff p50/p99 us':>19} "
        f"{'read us':>8} {'base us':>8} {'sw us':>8} {'ratio':>5} {'sw rat':>6} "
        f"{'copy GB/s':>9} {'base GB/s':>9} {'copy ratio':>10}"
    )
    for src, dst in pairs:
        for row in _bench_pair(
            src, dst, sizes_mib, iters, warmup, feature_dim, dtype, settle_us, publish_sync
        ):
            rows.append(row)
            print_fn(
                f"{row['src']:>7} {row['dst']:>7} {row['size_mib']:>6g} {row['open_ms']:>7.1f} "
                f"{row['latency_p50_us']:>9.1f} {row['latency_p99_us']:>9.1f} "
                f"{row['read_p50_us']:>8.1f} {row['baseline_p50_us']:>8.1f} "
                f"{row['baseline_switched_p50_us']:>8.1f} {row['ratio']:>5.2f} "
                f"{row['switched_ratio']:>6.2f} {row['copy_gbps']:>9.1f} "
                f"{row['baseline_copy_gbps']:>9.1f} {row['copy_ratio']:>10.2f}"
            )
    print_fn(
        "read: wall time inside read(); base: a plain copy in this process; sw: the same copy "
        "started where a read starts (after the producer's event); ratio = base/read, "
        "sw rat = sw/read; copy: timed where it runs (the goal: copy ratio >= 0.9)"
    )
    return rows
