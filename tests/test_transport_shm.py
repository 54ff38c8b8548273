"""Slot-pool interface and its shared-memory backend, with real producer processes."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import random
import signal
import socket
import subprocess
import sys
import time

import msgpack
import pytest
import torch

from dflash_ipc.errors import ConfigError, ProducerGoneError, TransportError
from dflash_ipc.transport.backends import ReaderCache, check_peer_access, create_pool, open_reader, unlink_segments
from dflash_ipc.transport.shm import list_segments
from dflash_ipc.transport.slots import ProducerWatch, SlotLayout, producer_identity

PREFIX = f"dflt{os.getpid()}-"
POISON = -4096.0  # exact in bf16/fp16/fp32; randn never produces it
RECV_TIMEOUT_S = 30.0


def _batch(seed: int, num_tokens: int, layout: SlotLayout) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(num_tokens, layout.feature_dim, generator=gen).to(layout.torch_dtype)


def _digest(t: torch.Tensor) -> bytes:
    raw = t.contiguous().view(torch.uint8).numpy().tobytes()
    return hashlib.blake2b(raw, digest_size=16).digest()


def _send(conn, msg: dict) -> None:
    conn.send_bytes(msgpack.packb(msg))


def _recv(conn) -> dict:
    if not conn.poll(RECV_TIMEOUT_S):
        raise AssertionError(f"no message within {RECV_TIMEOUT_S} s")
    return msgpack.unpackb(conn.recv_bytes())


def _producer_main(conn, name: str, layout_d: dict, num_batches: int, seed: int) -> None:
    """Produce batches as fast as slots come back; poison every released slot."""
    torch.set_num_threads(1)
    layout = SlotLayout(**layout_d)
    pool = create_pool(layout, "cpu", name=name)
    _send(conn, {"descriptor": pool.descriptor()})
    rng = random.Random(seed)
    free, sent = list(range(layout.num_slots)), 0
    while True:
        # Take every pending release; block for one when no slot is free, and at the end
        # until all slots are back.
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
        data = _batch(seed * 1_000_003 + sent, num_tokens, layout)
        pool.write_view(slot, num_tokens).copy_(data)
        pool.publish(slot)
        _send(conn, {"batch": sent, "slot": slot, "n": num_tokens, "digest": _digest(data)})
        sent += 1
    _send(conn, {"done": sent})
    _recv(conn)  # the test's go-ahead: close only once it has checked everything
    pool.close()


def _hold_one_batch_main(conn, name: str, layout_d: dict) -> None:
    """Publish one batch, then wait to be killed."""
    layout = SlotLayout(**layout_d)
    pool = create_pool(layout, "cpu", name=name)
    data = _batch(7, 5, layout)
    pool.write_view(0, 5).copy_(data)
    pool.publish(0)
    _send(conn, {"descriptor": pool.descriptor(), "n": 5, "digest": _digest(data)})
    time.sleep(300)


def _spawn(target, *args):
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    proc = ctx.Process(target=target, args=(theirs, *args), daemon=True)
    proc.start()
    return proc, ours


@pytest.fixture(autouse=True)
def _no_leftovers():
    yield
    assert list_segments(PREFIX) == []


# --- layout and start-up checks -----------------------------------------------------------


def test_layout_sizes_and_validation():
    layout = SlotLayout(num_slots=3, max_tokens=10, feature_dim=7, dtype="bfloat16")
    assert layout.slot_bytes == 10 * 7 * 2
    assert layout.slot_stride_bytes == 512 and layout.pool_bytes == 3 * 512
    assert SlotLayout(1, 512, 4, "float32").slot_stride_bytes == 512 * 4 * 4
    assert SlotLayout.required_max_tokens(32768) == 32768
    with pytest.raises(ConfigError, match="bfloat16"):
        SlotLayout(1, 1, 1, "int8")
    with pytest.raises(ConfigError, match="num_slots"):
        SlotLayout(0, 1, 1, "float32")
    with pytest.raises(TransportError, match="out of range"):
        layout.byte_range(3, 1)
    with pytest.raises(TransportError, match="0..10"):
        layout.byte_range(0, 11)


def test_peer_access_check_without_gpus():
    check_peer_access(["cpu"], ["cpu", "cpu"])
    with pytest.raises(TransportError, match="not a GPU"):
        check_peer_access(["cuda:0"], ["cpu"])
    if not torch.cuda.is_available():
        with pytest.raises(TransportError, match="CUDA is not available"):
            check_peer_access(["cuda:0"], ["cuda:1"])


# --- in-process pool and reader -----------------------------------------------------------


def test_descriptor_survives_msgpack_and_reads_back():
    layout = SlotLayout(2, 8, 3, "float16")
    with create_pool(layout, "cpu", name=PREFIX + "rt") as pool:
        desc = pool.descriptor()
        wire = msgpack.unpackb(msgpack.packb(desc))
        assert wire == desc
        data = _batch(1, 6, layout)
        pool.write_view(1, 6).copy_(data)
        pool.publish(1)
        reader = open_reader(wire, "cpu")
        assert reader.last_copy_s is None
        got = reader.read(1, 6)
        assert reader.last_copy_s > 0
        assert torch.equal(got, data) and got.dtype == torch.float16
        out = torch.empty(6, 3, dtype=torch.float16)
        assert reader.read(1, 6, out=out).data_ptr() == out.data_ptr()
        assert torch.equal(out, data)
        with pytest.raises(TransportError, match=r"shape \[6, 3\], dtype float16"):
            reader.read(1, 6, out=torch.empty(6, 3))
        reader.close()
        with pytest.raises(TransportError, match="closed"):
            reader.read(1, 6)
    pool.close()  # idempotent
    with pytest.raises(TransportError, match="closed"):
        pool.write_view(0, 1)


def test_reader_of_closed_pool_and_bad_descriptors():
    layout = SlotLayout(1, 4, 4, "float32")
    pool = create_pool(layout, "cpu", name=PREFIX + "bad")
    desc = pool.descriptor()
    with pytest.raises(TransportError, match="version"):
        open_reader({**desc, "version": 99}, "cpu")
    with pytest.raises(TransportError, match="backend 'nccl'"):
        open_reader({**desc, "backend": "nccl"}, "cpu")
    with pytest.raises(TransportError, match="lacks"):
        open_reader({k: v for k, v in desc.items() if k != "layout"}, "cpu")
    with pytest.raises(TransportError, match="never leave their node"):
        open_reader({**desc, "producer": {**desc["producer"], "host": "elsewhere"}}, "cpu")
    # A pid that was reused by another process reads as a dead producer: another start in
    # clock ticks since boot where /proc has them, else another start time.
    producer = desc["producer"]
    reused = ({**producer, "start_ticks": producer["start_ticks"] + 1} if producer["start_ticks"] is not None
              else {**producer, "create_time": producer["create_time"] - 1000.0})
    with pytest.raises(ProducerGoneError, match=f"pid {os.getpid()}"):
        open_reader({**desc, "producer": reused}, "cpu")
    with pytest.raises(TransportError, match="start_ticks, a count or null"):
        open_reader({**desc, "producer": {**producer, "start_ticks": "soon"}}, "cpu")
    # A descriptor claiming more bytes than the segment holds: refused, the segment not grown.
    path = os.path.join("/dev/shm", desc["segment"])
    size = os.path.getsize(path)
    with pytest.raises(TransportError, match=f"holds {size} bytes, its descriptor says {size + 4096}"):
        open_reader({**desc, "nbytes": size + 4096}, "cpu")
    assert os.path.getsize(path) == size
    pool.close()
    with pytest.raises(TransportError, match="does not exist"):
        open_reader(desc, "cpu")
    assert not os.path.exists(path)  # opening it did not make it again


@pytest.mark.parametrize("use_pidfd", [True, False])
def test_producer_watch_sees_death_before_reaping(monkeypatch, use_pidfd):
    if not use_pidfd:
        monkeypatch.delattr(os, "pidfd_open", raising=False)  # the psutil fallback
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        import psutil

        ident = {"pid": child.pid, "create_time": psutil.Process(child.pid).create_time(),
                 "host": socket.gethostname()}
        watch = ProducerWatch(ident, "pool-w")
        assert watch.alive()
        watch.check("now")
        child.kill()
        deadline = time.monotonic() + 5
        while watch.alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not watch.alive()  # a zombie (not reaped yet) counts as dead
        with pytest.raises(ProducerGoneError, match=f"pool-w: producer pid {child.pid}"):
            watch.check("now")
        watch.close()
    finally:
        child.kill()
        child.wait(5)


def test_segment_sweep_by_prefix():
    with pytest.raises(ConfigError, match="too short"):
        list_segments("d")
    with pytest.raises(ConfigError, match="letters, digits"):
        unlink_segments("../etc")
    pool = create_pool(SlotLayout(1, 1, 1, "float32"), "cpu", name=PREFIX + "sweep")
    assert list_segments(PREFIX) == [pool.descriptor()["segment"]]
    assert unlink_segments(PREFIX) == 1
    assert list_segments(PREFIX) == []
    pool.close()  # already unlinked by the sweep: still fine


def test_node_sweep_leaves_other_nodes_segments(tmp_path):
    # Nodes of one run may share a machine (tests) or /dev/shm: node 1's sweep at its start
    # or stop must not unlink node 10's live pools, whose names also start with "...-n1".
    from dflash_ipc.config.load import load_config

    def node(rank: int):
        return load_config(None, [f"run.run_dir={tmp_path}", "run.num_nodes=11", f"run.node_rank={rank}",
                                  "dispatch.address=tcp://127.0.0.1:5555"])

    layout = SlotLayout(1, 1, 1, "float32")
    ten = create_pool(layout, "cpu", name=node(10).files.pool_name(3))
    one = create_pool(layout, "cpu", name=node(1).files.pool_name(0))
    try:
        assert unlink_segments(node(1).files.segments_prefix) == 1
        assert list_segments(node(10).files.segments_prefix) == [ten.descriptor()["segment"]]
    finally:
        ten.close()
        one.close()


def test_a_signal_while_the_segment_is_made_leaves_none_and_a_stale_one_is_not_ours(monkeypatch):
    import dflash_ipc.transport.shm as shm
    real_create = shm._create_segment

    def interrupted(segment, nbytes):  # a SIGTERM (SystemExit) right after the file exists
        real_create(segment, nbytes)
        raise SystemExit(143)

    monkeypatch.setattr(shm, "_create_segment", interrupted)
    with pytest.raises(SystemExit):
        create_pool(SlotLayout(1, 1, 1, "float32"), "cpu", name=PREFIX + "signal")
    assert list_segments(PREFIX) == []
    monkeypatch.setattr(shm, "_create_segment", real_create)
    stale = f"{PREFIX}stale-{os.getpid()}"
    open(os.path.join(shm.SHM_DIR, stale), "wb").close()
    try:
        with pytest.raises(TransportError, match="already exists"):
            create_pool(SlotLayout(1, 1, 1, "float32"), "cpu", name=PREFIX + "stale")
        import gc
        gc.collect()  # the failed pool's finalizer, had it stayed attached, would run here
        assert list_segments(PREFIX) == [stale]
    finally:
        unlink_segments(PREFIX)


_TWICE_TERMINATED = """
import os, signal, sys, time
from dflash_ipc.run.child_env import exit_on_sigterm as _exit_on_sigterm
from dflash_ipc.transport.backends import create_pool
from dflash_ipc.transport.slots import SlotLayout
_exit_on_sigterm()
pool = create_pool(SlotLayout(1, 1, 1, "float32"), "cpu", name=sys.argv[1])
try:
    print("ready", flush=True)
    time.sleep(60)
finally:
    print("unwinding", flush=True)
    time.sleep(1.0)  # closing sockets and files takes a while; the second SIGTERM lands here
    pool.close()
    print("closed", flush=True)
"""


def test_a_second_sigterm_does_not_cut_the_unwinding_short():
    # A dead supervisor's children hear SIGTERM twice: the parent-death signal, then
    # ParentWatch. The second must not skip the `finally` that closes the pool.
    child = subprocess.Popen([sys.executable, "-c", _TWICE_TERMINATED, PREFIX + "twice"],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        child.send_signal(signal.SIGTERM)
        assert child.stdout.readline().strip() == "unwinding"
        child.send_signal(signal.SIGTERM)
        out, _ = child.communicate(timeout=30)
        assert child.returncode == 128 + signal.SIGTERM and out.split() == ["closed"]
    finally:
        if child.poll() is None:
            child.kill()
        child.wait(5)
        unlink_segments(PREFIX)


# --- producer and consumer in separate processes -------------------------------------------


def test_cross_process_random_batches_with_poisoned_reuse():
    layout = SlotLayout(2, 96, 40, "bfloat16")
    num_batches = 240
    proc, conn = _spawn(_producer_main, PREFIX + "xp", layout.to_dict(), num_batches, 11)
    try:
        desc = _recv(conn)["descriptor"]
        cache = ReaderCache("cpu")
        reader = cache.get(desc)
        assert cache.get(desc) is reader and len(cache) == 1
        buf = torch.empty(layout.max_tokens, layout.feature_dim, dtype=torch.bfloat16)
        slots_seen = set()
        for i in range(num_batches):
            msg = _recv(conn)
            assert msg["batch"] == i
            out = buf[: msg["n"]] if i % 2 else None
            got = reader.read(msg["slot"], msg["n"], out=out)
            assert not bool((got == POISON).any()), f"batch {i} read a released slot"
            assert _digest(got) == msg["digest"], f"batch {i}: checksum mismatch"
            slots_seen.add(msg["slot"])
            _send(conn, {"release": msg["slot"]})
        assert _recv(conn) == {"done": num_batches}
        assert slots_seen == {0, 1}
        _send(conn, {"close": True})
        proc.join(RECV_TIMEOUT_S)
        assert proc.exitcode == 0
        cache.close()
        assert len(cache) == 0
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join(5)
        unlink_segments(PREFIX)


def test_killed_producer_gives_producer_gone_quickly():
    layout = SlotLayout(1, 8, 16, "float32")
    proc, conn = _spawn(_hold_one_batch_main, PREFIX + "kill", layout.to_dict())
    try:
        msg = _recv(conn)
        desc = msg["descriptor"]
        cache = ReaderCache("cpu")
        reader = cache.get(desc)
        assert _digest(reader.read(0, msg["n"])) == msg["digest"]
        assert reader.producer_alive()
        os.kill(proc.pid, signal.SIGKILL)
        start = time.monotonic()
        while reader.producer_alive() and time.monotonic() - start < 5:
            time.sleep(0.01)  # SIGKILL is asynchronous; not yet reaped: a zombie
        with pytest.raises(ProducerGoneError, match=f"pid {proc.pid}"):
            reader.read(0, msg["n"])
        assert time.monotonic() - start < 5
        proc.join(5)
        with pytest.raises(ProducerGoneError):
            reader.read(0, msg["n"])
        with pytest.raises(ProducerGoneError):
            open_reader(desc, "cpu")
        cache.drop(desc["pool_id"])  # what a drafter does with the pool of a dead target
        assert len(cache) == 0
        # SIGKILL left the segment behind: exactly what the supervisor's sweep is for.
        assert list_segments(PREFIX) == [desc["segment"]]
        assert unlink_segments(PREFIX) == 1
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join(5)
        unlink_segments(PREFIX)


def test_identity_names_this_host():
    ident = producer_identity()
    assert ident["pid"] == os.getpid() and ident["host"] == socket.gethostname()


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs /proc (Linux)")
def test_a_producer_is_recognised_after_the_wall_clock_moved():
    """The boot time psutil adds to a start follows the wall clock: where that is stepped or
    drifts, a consumer reading later computes another create_time for the same producer. Its
    start in clock ticks since boot does not move: still the same, live process."""
    ident = producer_identity()
    assert isinstance(ident["start_ticks"], int)
    moved = {**ident, "create_time": ident["create_time"] + 3.0}  # three seconds of drift
    watch = ProducerWatch(moved, "pool-drift")
    assert watch.alive()
    watch.check("after the drift")
    watch.close()


def test_transport_bench_runs_on_shm():
    from dflash_ipc.bench.transport import run_transport_bench

    lines: list[str] = []
    rows = run_transport_bench(
        pairs=[("cpu", "cpu")], sizes_mib=[0.25, 1], iters=3, warmup=1, settle_us=2000,
        print_fn=lines.append,
    )
    assert len(lines) == 5 and lines[0] == "publish_sync ipc_event"
    assert "read us" in lines[1] and "copy ratio" in lines[1]
    assert [r["size_mib"] for r in rows] == [0.25, 1]
    for row in rows:
        assert row["bytes"] == int(row["size_mib"] * 2**20) and row["iters"] == 3
        assert row["read_gbps"] > 0 and row["baseline_gbps"] > 0
        assert row["copy_gbps"] > 0 and row["baseline_copy_gbps"] > 0
        # The copy is part of the read; the settle wait is part of the handoff, not the read.
        assert row["read_p50_us"] >= row["copy_p50_us"] > 0
        assert row["latency_p50_us"] >= row["read_p50_us"] + 2000
        assert row["settle_us"] == 2000
        assert row["baseline_switched_p50_us"] > 0 and row["switched_ratio"] > 0
        assert row["publish_sync"] == "ipc_event"
    with pytest.raises(ConfigError, match="publish_sync 'x' not allowed"):
        run_transport_bench(pairs=[("cpu", "cpu")], publish_sync="x")
    with pytest.raises(ConfigError, match="settle_us"):
        run_transport_bench(pairs=[("cpu", "cpu")], settle_us=-1)
    with pytest.raises(ConfigError, match="cuda:N"):
        run_transport_bench(pairs=[("cuda:0", "cuda:64")], iters=1)
