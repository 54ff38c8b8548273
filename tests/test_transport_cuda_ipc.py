"""CUDA IPC slot pools. The multi-process scenarios need GPUs (marked ``gpu``, skipped
here otherwise); the version guard and tuple validation run everywhere."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import random
import signal
import threading
import time

import msgpack
import pytest
import torch

from dflash_ipc.errors import ConfigError, ProducerGoneError, TransportError
from dflash_ipc.transport.cuda_ipc import check_torch_version, parse_share_tuple, wait_until
from dflash_ipc.transport.backends import ReaderCache, check_peer_access, create_pool, open_reader
from dflash_ipc.transport.slots import ProducerWatch, SlotLayout, producer_identity

NUM_GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


def requires_gpu(fn):
    """Marks a test ``gpu``: skipped without CUDA, bounded in time when it runs."""
    fn = pytest.mark.timeout(300)(fn)
    fn = pytest.mark.skipif(NUM_GPUS == 0, reason="needs a CUDA GPU")(fn)
    return pytest.mark.gpu(fn)

POISON = -4096.0  # exact in bf16; never produced by _pattern
RECV_TIMEOUT_S = 120.0
# GPU time spent before each batch is written (~1 ms on an H200, ~20 ms for every 8th
# batch): Produced is sent while the GPU is still busy, so a consumer that ignored the
# slot event would read poison or stale data. The long ones outlast a GPU time slice, so
# a consumer on the same GPU gets to run its copy in the middle of them too.
SLEEP_CYCLES = 2_000_000
LONG_SLEEP_CYCLES = 40_000_000


# --- everywhere: version pin and tuple validation ------------------------------------------


def test_torch_version_pin():
    for ok in ("2.6.0", "2.11.0+cu130", "2.14.1"):
        check_torch_version(ok)
    for bad in ("2.5.1", "2.15.0", "3.0.0", "nightly"):
        with pytest.raises(TransportError, match="torch"):
            check_torch_version(bad)


def test_share_tuple_is_validated():
    good = (0, b"h" * 66, 4096, 512, b"/torch_1_2", 3, b"e" * 64, True)
    fields = parse_share_tuple(good)
    assert fields["handle"] == b"h" * 66 and fields["offset_bytes"] == 512
    assert fields["event_sync_required"] is True
    with pytest.raises(TransportError, match="8"):
        parse_share_tuple(good[:7])
    with pytest.raises(TransportError, match="field types"):
        parse_share_tuple((0, "not-bytes", *good[2:]))
    with pytest.raises(TransportError, match="field types"):
        parse_share_tuple((True, *good[1:]))  # a bool is not a device index


def test_wait_until_is_bounded():
    alive = ProducerWatch(producer_identity(), "pool-a")
    start = time.monotonic()
    with pytest.raises(TransportError, match="not done after 0.2 s"):
        wait_until(lambda: False, watch=alive, timeout_s=0.2, what="nothing")
    assert time.monotonic() - start < 2.0
    ident = {**producer_identity(), "create_time": 1.0}  # a reused pid: another start
    if ident["start_ticks"] is not None:
        ident["start_ticks"] += 1
    with pytest.raises(ProducerGoneError, match="pool-b"):
        wait_until(lambda: False, watch=ProducerWatch(ident, "pool-b"), timeout_s=5, what="x")


@pytest.mark.skipif(NUM_GPUS > 0, reason="checks the no-GPU error")
def test_cuda_pool_without_cuda_is_a_clear_error():
    with pytest.raises(TransportError, match="CUDA is not available"):
        create_pool(SlotLayout(1, 1, 1, "float32"), "cuda:0", name="dfl-nocuda")
    # The publish mode is checked first, on any device.
    with pytest.raises(ConfigError, match="publish_sync 'event' not allowed"):
        create_pool(SlotLayout(1, 1, 1, "float32"), "cpu", name="dfl-badsync", publish_sync="event")


# --- helpers for the producer processes -----------------------------------------------------


def _pattern(batch: int, num_tokens: int, dim: int, device: str) -> torch.Tensor:
    """Exact small integers, identical on every device: [num_tokens, dim] bfloat16."""
    idx = torch.arange(num_tokens * dim, device=device, dtype=torch.int64)
    return ((idx * 7 + batch * 13) % 251 - 125).to(torch.bfloat16).view(num_tokens, dim)


def _digest(t: torch.Tensor) -> bytes:
    raw = t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
    return hashlib.blake2b(raw, digest_size=16).digest()


def _send(conn, msg: dict) -> None:
    conn.send_bytes(msgpack.packb(msg))


def _recv(conn) -> dict:
    if not conn.poll(RECV_TIMEOUT_S):
        raise AssertionError(f"no message within {RECV_TIMEOUT_S} s")
    return msgpack.unpackb(conn.recv_bytes())


def _spawn(target, *args, env: dict | None = None):
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    saved = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    try:  # a spawned child takes the environment at start()
        proc = ctx.Process(target=target, args=(theirs, *args), daemon=True)
        proc.start()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return proc, ours


def _producer_main(conn, device: str, layout_d: dict, num_batches: int, seed: int,
                   publish_sync: str) -> None:
    """Publish batches while the GPU is still busy; poison every slot as soon as it is back."""
    torch.cuda.set_device(device)
    layout = SlotLayout(**layout_d)
    pool = create_pool(layout, device, name="dfl-gpu", publish_sync=publish_sync)
    for slot in range(layout.num_slots):
        pool.poison(slot, POISON)
    _send(conn, {"descriptor": pool.descriptor()})
    rng = random.Random(seed)
    free, sent = list(range(layout.num_slots)), 0
    while True:
        while (
            conn.poll(0)
            or (not free and sent < num_batches)
            or (sent == num_batches and len(free) < layout.num_slots)
        ):
            slot = _recv(conn)["release"]
            pool.poison(slot, POISON)
            free.append(slot)
        if sent == num_batches:
            break
        slot = free.pop(0)
        num_tokens = rng.randint(1, layout.max_tokens)
        torch.cuda._sleep(LONG_SLEEP_CYCLES if sent % 8 == 0 else SLEEP_CYCLES)
        data = _pattern(sent, num_tokens, layout.feature_dim, device)
        pool.write_view(slot, num_tokens).copy_(data)
        pool.publish(slot)
        digest = _digest(_pattern(sent, num_tokens, layout.feature_dim, "cpu"))
        _send(conn, {"batch": sent, "slot": slot, "n": num_tokens, "digest": digest})
        sent += 1
    _send(conn, {"done": sent})
    _recv(conn)
    pool.close()


def _slow_producer_main(conn, device: str, layout_d: dict) -> None:
    """Slot 0: ready at once. Slot 1: published behind ~10 s of GPU work. Then wait."""
    torch.cuda.set_device(device)
    layout = SlotLayout(**layout_d)
    pool = create_pool(layout, device, name="dfl-slow")
    pool.write_view(0, 4).copy_(_pattern(0, 4, layout.feature_dim, device))
    pool.publish(0)
    torch.cuda.synchronize()
    torch.cuda._sleep(20_000_000_000)
    pool.write_view(1, 4).copy_(_pattern(1, 4, layout.feature_dim, device))
    pool.publish(1)
    _send(conn, {"descriptor": pool.descriptor()})
    time.sleep(300)


def _idle_producer_main(conn, device: str, layout_d: dict, publish_sync: str) -> None:
    """Slot 0 published, then nothing: a target that dies between batches."""
    torch.cuda.set_device(device)
    layout = SlotLayout(**layout_d)
    pool = create_pool(layout, device, name="dfl-idle", publish_sync=publish_sync)
    pool.write_view(0, 4).copy_(_pattern(0, 4, layout.feature_dim, device))
    pool.publish(0)
    _send(conn, {"descriptor": pool.descriptor()})
    time.sleep(300)


# --- GPU scenarios --------------------------------------------------------------------------


def _pairs():
    cases = [("cuda:0", "cuda:0", False, "ipc_event"), ("cuda:0", "cuda:0", True, "ipc_event"),
             ("cuda:0", "cuda:0", False, "host_wait")]
    if NUM_GPUS > 1:
        cases += [("cuda:1", "cuda:0", False, "ipc_event"), ("cuda:1", "cuda:0", False, "host_wait")]
    return cases


@requires_gpu
@pytest.mark.parametrize("producer_dev,consumer_dev,expandable,publish_sync", _pairs())
def test_random_batches_with_poisoned_reuse(producer_dev, consumer_dev, expandable, publish_sync):
    layout = SlotLayout(num_slots=2, max_tokens=384, feature_dim=1000, dtype="bfloat16")
    num_batches = 240
    env = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"} if expandable else {}
    proc, conn = _spawn(_producer_main, producer_dev, layout.to_dict(), num_batches, 5,
                        publish_sync, env=env)
    try:
        desc = _recv(conn)["descriptor"]
        assert msgpack.unpackb(msgpack.packb(desc)) == desc
        assert desc["publish_sync"] == publish_sync
        assert len(desc["slot_events"]) == (layout.num_slots if publish_sync == "ipc_event" else 0)
        cache = ReaderCache(consumer_dev)
        reader = cache.get(desc)
        buf = torch.empty(
            layout.max_tokens, layout.feature_dim, dtype=torch.bfloat16, device=consumer_dev
        )
        assert reader.last_copy_s is None
        for i in range(num_batches):
            msg = _recv(conn)
            assert cache.get(desc) is reader  # opened once, reused
            started = time.perf_counter()
            got = reader.read(msg["slot"], msg["n"], out=buf[: msg["n"]] if i % 2 else None)
            # The copy is timed on the GPU, inside the read's wall time.
            assert 0 < reader.last_copy_s <= time.perf_counter() - started
            assert got.device == torch.device(consumer_dev)
            assert not bool((got == POISON).any()), f"batch {i}: read a poisoned (released) slot"
            assert _digest(got) == msg["digest"], f"batch {i}: checksum mismatch"
            _send(conn, {"release": msg["slot"]})
        assert _recv(conn) == {"done": num_batches}
        _send(conn, {"close": True})
        proc.join(RECV_TIMEOUT_S)
        assert proc.exitcode == 0
        cache.close()
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join(10)


def _kill_cases():
    cases = [("cuda:0", "cuda:0")]
    if NUM_GPUS > 1:
        cases.append(("cuda:1", "cuda:0"))
    return cases


def _check_after_producer_death(reader, desc: dict, consumer_dev: str) -> None:
    """The pool cannot be opened again, and the consumer's GPU still works: nothing of it
    waits on the dead process."""
    with pytest.raises(ProducerGoneError):
        open_reader(desc, consumer_dev)
    reader.close()
    x = torch.ones(1024, device=consumer_dev)
    assert float((x * 2).sum()) == 2048.0
    torch.cuda.synchronize(consumer_dev)


@requires_gpu
@pytest.mark.parametrize("producer_dev,consumer_dev", _kill_cases())
def test_killed_producer_never_hangs_the_consumer(producer_dev, consumer_dev):
    layout = SlotLayout(num_slots=2, max_tokens=8, feature_dim=256, dtype="bfloat16")
    proc, conn = _spawn(_slow_producer_main, producer_dev, layout.to_dict())
    try:
        desc = _recv(conn)["descriptor"]
        reader = open_reader(desc, consumer_dev, timeout_s=60)
        assert torch.equal(reader.read(0, 4).cpu(), _pattern(0, 4, 256, "cpu"))
        # Slot 1 is still being produced; kill the producer while we wait for it.
        killer = threading.Timer(0.5, os.kill, (proc.pid, signal.SIGKILL))
        killer.start()
        start = time.monotonic()
        with pytest.raises(ProducerGoneError, match=f"pid {proc.pid}"):
            reader.read(1, 4)
        assert time.monotonic() - start < 10
        killer.join()
        with pytest.raises(ProducerGoneError):
            reader.read(0, 4)
        proc.join(10)
        _check_after_producer_death(reader, desc, consumer_dev)
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join(10)


@requires_gpu
@pytest.mark.parametrize("producer_dev,consumer_dev", _kill_cases())
def test_killed_host_wait_producer_is_a_clear_error(producer_dev, consumer_dev):
    # host_wait: no event to wait on, so the liveness checks around the copy are all there is.
    layout = SlotLayout(num_slots=2, max_tokens=8, feature_dim=256, dtype="bfloat16")
    proc, conn = _spawn(_idle_producer_main, producer_dev, layout.to_dict(), "host_wait")
    try:
        desc = _recv(conn)["descriptor"]
        assert desc["publish_sync"] == "host_wait" and desc["slot_events"] == []
        reader = open_reader(desc, consumer_dev, timeout_s=60)
        assert torch.equal(reader.read(0, 4).cpu(), _pattern(0, 4, 256, "cpu"))
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
        start = time.monotonic()
        with pytest.raises(ProducerGoneError, match=f"pid {proc.pid}"):
            reader.read(0, 4)
        assert time.monotonic() - start < 10
        _check_after_producer_death(reader, desc, consumer_dev)
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join(10)


def _expandable_main(conn, device: str) -> None:
    """A target process whose user turned expandable segments on: allocations before the pool
    (the model) live in expandable segments; the pool must not."""
    from dflash_ipc.transport.cuda_ipc import _segment_is_expandable

    torch.cuda.set_device(device)
    weights = [torch.empty(n, dtype=torch.uint8, device=device) for n in (64 << 20, 3 << 20, 4096)]
    model_expandable = [_segment_is_expandable(w) for w in weights]
    del weights[1]  # free blocks of expandable segments, as a model load leaves them
    pools = [create_pool(SlotLayout(2, 64, 512, "bfloat16"), device, name="dfl-exp-small"),
             create_pool(SlotLayout(2, 1024, 4096, "bfloat16"), device, name="dfl-exp-large")]
    _send(conn, {"model": model_expandable, "pools": [_segment_is_expandable(p._flat) for p in pools]})
    for pool in pools:
        pool.close()


@requires_gpu
def test_pool_is_never_in_an_expandable_segment():
    # In a fresh process, as a target is: the allocator's state of this test process (other
    # tests' peer mappings and cached blocks) is not what a target starts with.
    proc, conn = _spawn(_expandable_main, "cuda:0", env={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
    try:
        got = _recv(conn)
        assert got["model"][0] is True, got  # the setting took effect (on large blocks at least)
        assert got["pools"] == [False, False], got
        proc.join(RECV_TIMEOUT_S)
        assert proc.exitcode == 0
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join(10)


@requires_gpu
def test_peer_access_and_device_errors():
    devices = [f"cuda:{i}" for i in range(NUM_GPUS)]
    check_peer_access(devices, devices)
    with pytest.raises(TransportError, match=f"cuda:{NUM_GPUS} does not exist"):
        check_peer_access(["cuda:0"], [f"cuda:{NUM_GPUS}"])
    pool = create_pool(SlotLayout(1, 4, 8, "float32"), "cuda:0", name="dfl-own")
    desc = pool.descriptor()
    assert desc["backend"] == "cuda_ipc" and len(desc["slot_events"]) == 1
    with pytest.raises(TransportError, match="needs a cuda:N device"):
        open_reader(desc, "cpu")
    # A descriptor whose events do not match its publish mode is refused before any open.
    with pytest.raises(TransportError, match=r"publish_sync 'bogus', expected one of"):
        open_reader({**desc, "publish_sync": "bogus"}, "cuda:0")
    with pytest.raises(TransportError, match="publish_sync host_wait needs 0 event handles"):
        open_reader({**desc, "publish_sync": "host_wait"}, "cuda:0")
    pool.close()
    # host_wait: the writes are done when publish returns, and no event is exported.
    pool = create_pool(SlotLayout(2, 4, 8, "float32"), "cuda:0", name="dfl-own", publish_sync="host_wait")
    torch.cuda._sleep(100_000_000)  # ~50 ms of GPU work queued before the write
    pool.write_view(1, 4).fill_(3.0)
    pool.publish(1)
    assert torch.cuda.current_stream().query()  # nothing left in flight
    assert pool.descriptor()["slot_events"] == [] and pool.descriptor()["publish_sync"] == "host_wait"
    pool.close()
