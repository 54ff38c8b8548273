"""``dflash-ipc bench transport``: slot handoff latency and copy bandwidth between processes.

For each (producer device, consumer device) pair, a producer process owns a slot pool and
the bench process reads from it, exactly as a target and a drafter do. Per batch:

- *handoff latency*: from the producer's ``publish`` (GPU idle, so production time is not
  counted) to the consumer's ``read`` returning with the copy complete; it includes the
  notification (a pipe here, ZMQ through the dispatcher in a job) and the liveness checks;
- *read bandwidth*: bytes / time inside ``read``;
- *baseline*: a plain in-process ``dst.copy_(src)`` between the same two devices, in the
  same run, timed the same way (wall clock to completion). The goal is read bandwidth
  >= 90% of it for batch-sized copies.

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
from dflash_ipc.transport.slots import SlotLayout, create_pool, open_reader, unlink_segments

logger = logging.getLogger(__name__)

_PRODUCED = struct.Struct("<iiq")  # slot, num_tokens, publish time (perf_counter_ns)
_RELEASE = struct.Struct("<i")  # slot; -1 tells the producer to close and exit
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


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _producer_main(conn: Any, device: str, layout_d: dict, plan: list[int], name: str) -> None:
    """Publish one batch per entry of ``plan`` (token counts) as fast as slots come back."""
    torch.set_num_threads(1)
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    layout = SlotLayout(**layout_d)
    pool = create_pool(layout, dev, name=name)
    try:
        for slot in range(layout.num_slots):
            pool.poison(slot, 1.0)  # touch every page once, outside the timed loop
        _sync(dev)
        conn.send_bytes(_encode(pool.descriptor()))
        free = list(range(layout.num_slots))
        for num_tokens in plan:
            while conn.poll(0) or not free:
                free.append(_RELEASE.unpack(_recv(conn, "release"))[0])
            slot = free.pop(0)
            _sync(dev)  # the GPU is idle: latency counts the handoff, not production
            start = time.perf_counter_ns()
            pool.publish(slot)
            conn.send_bytes(_PRODUCED.pack(slot, num_tokens, start))
        while _RELEASE.unpack(_recv(conn, "final release"))[0] != -1:
            pass
    finally:
        pool.close()


def _baseline_s(
    src_dev: torch.device, dst_dev: torch.device, nbytes: int, iters: int, warmup: int
) -> list[float]:
    """Seconds per plain ``dst.copy_(src)`` between the two devices, in this process."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=src_dev)  # [nbytes]
    dst = torch.empty(nbytes, dtype=torch.uint8, device=dst_dev)  # [nbytes]
    times = []
    for i in range(warmup + iters):
        _sync(src_dev)
        _sync(dst_dev)
        start = time.perf_counter()
        dst.copy_(src)
        _sync(dst_dev)
        _sync(src_dev)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    del src, dst
    return times


def _consume(
    reader: Any, conn: Any, out: torch.Tensor, count: int
) -> tuple[list[float], list[float]]:
    """Read ``count`` batches; return handoff latencies and read times in seconds."""
    latencies, reads = [], []
    for _ in range(count):
        slot, num_tokens, published = _PRODUCED.unpack(_recv(conn, "produced batch"))
        start = time.perf_counter_ns()
        reader.read(slot, num_tokens, out=out[:num_tokens])
        end = time.perf_counter_ns()
        conn.send_bytes(_RELEASE.pack(slot))
        # perf_counter_ns is CLOCK_MONOTONIC on Linux: comparable across processes.
        latencies.append((end - published) / 1e9)
        reads.append((end - start) / 1e9)
    return latencies, reads


def _row(
    src: str, dst: str, mib: float, nbytes: int, open_ms: float,
    latencies: list[float], reads: list[float], base: list[float],
) -> dict[str, Any]:
    p99 = sorted(latencies)[min(len(latencies) - 1, int(0.99 * len(latencies)))]
    read_s, base_s = statistics.median(reads), statistics.median(base)
    return {
        "src": src, "dst": dst, "size_mib": mib, "bytes": nbytes, "iters": len(reads),
        "open_ms": open_ms,
        "latency_p50_us": statistics.median(latencies) * 1e6,
        "latency_p99_us": p99 * 1e6,
        "read_p50_us": read_s * 1e6,
        "read_gbps": nbytes / read_s / 1e9,
        "baseline_gbps": nbytes / base_s / 1e9,
        "ratio": base_s / read_s,
    }


def _bench_pair(
    src: str, dst: str, sizes_mib: Sequence[float], iters: int, warmup: int,
    feature_dim: int, dtype: str,
) -> list[dict[str, Any]]:
    src_dev, dst_dev = torch.device(src), torch.device(dst)
    token_bytes = feature_dim * SlotLayout(1, 1, feature_dim, dtype).itemsize
    tokens = [max(1, int(mib * 2**20) // token_bytes) for mib in sizes_mib]
    layout = SlotLayout(num_slots=2, max_tokens=max(tokens), feature_dim=feature_dim, dtype=dtype)
    plan = [n for n in tokens for _ in range(warmup + iters)]
    prefix = f"dfbench{os.getpid()}"
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    args = (theirs, src, layout.to_dict(), plan, prefix)
    proc = ctx.Process(target=_producer_main, args=args, daemon=True)
    proc.start()
    rows = []
    threads = torch.get_num_threads()
    if src_dev.type == "cpu":
        # One thread, like the producer: on a busy host, waking a thread pool for each
        # copy costs milliseconds and would measure the scheduler, not the transport.
        torch.set_num_threads(1)
    try:
        descriptor = _decode(_recv(ours, "pool descriptor"))
        opened = time.perf_counter()
        reader = open_reader(descriptor, dst_dev)
        open_ms = (time.perf_counter() - opened) * 1e3
        out = torch.empty(layout.max_tokens, feature_dim, dtype=layout.torch_dtype, device=dst_dev)
        for mib, n in zip(sizes_mib, tokens):
            latencies, reads = _consume(reader, ours, out, warmup + iters)
            latencies, reads = latencies[warmup:], reads[warmup:]
            nbytes = n * token_bytes
            base = _baseline_s(src_dev, dst_dev, nbytes, iters, warmup)
            rows.append(_row(src, dst, mib, nbytes, open_ms, latencies, reads, base))
        # Unmap first: the producer then exits with no reader left on its memory.
        reader.close()
        ours.send_bytes(_RELEASE.pack(-1))
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
    print_fn: Callable[[str], None] = print,
) -> list[dict[str, Any]]:
    """Measure slot handoff between two processes per device pair; print and return rows.

    Each row: src, dst, size_mib, bytes, iters, open_ms (opening the pool once),
    latency_p50_us / latency_p99_us (publish -> read complete), read_p50_us (inside
    ``read``), read_gbps, baseline_gbps
    (in-process copy between the same devices) and ratio = read / baseline.
    """
    if iters < 1 or warmup < 0:
        raise ConfigError(
            f"bench transport: iters must be >= 1 and warmup >= 0, got {iters}, {warmup}"
        )
    pairs = list(pairs) if pairs is not None else _default_pairs()
    _check_pairs(pairs)
    if sizes_mib is None:
        on_gpu = any(torch.device(s).type == "cuda" for s, _ in pairs)
        sizes_mib = DEFAULT_GPU_SIZES_MIB if on_gpu else DEFAULT_CPU_SIZES_MIB
    rows = []
    print_fn(
        f"{'src':>7} {'dst':>7} {'MiB':>7} {'open ms':>8} {'handoff p50/p99 us':>19} "
        f"{'read us':>8} {'read GB/s':>10} {'copy GB/s':>10} {'ratio':>6}"
    )
    for src, dst in pairs:
        for row in _bench_pair(src, dst, sizes_mib, iters, warmup, feature_dim, dtype):
            rows.append(row)
            print_fn(
                f"{row['src']:>7} {row['dst']:>7} {row['size_mib']:>7g} {row['open_ms']:>8.1f} "
                f"{row['latency_p50_us']:>9.1f} {row['latency_p99_us']:>9.1f} "
                f"{row['read_p50_us']:>8.1f} {row['read_gbps']:>10.1f} "
                f"{row['baseline_gbps']:>10.1f} {row['ratio']:>6.2f}"
            )
    return rows
