"""The dispatcher process against hostile peers: bounded memory, bounded logs, liveness and
signals on time, seats not stolen, and CURVE refusing strangers on tcp://."""

import logging
import multiprocessing as mp
import os
import signal
import socket
import time

import numpy as np
import psutil
import pytest
import zmq

from dflash_ipc.wire import protocol as p
from dflash_ipc.config.load import load_config
from dflash_ipc.wire.link import DispatcherLink
from dflash_ipc.wire.security import ensure_keys

RSS_BOUND_MIB = 100  # the dispatcher may grow by this much through the whole hostile sequence


def _serve(overrides: list[str], log_path: str) -> None:
    """Child: a real DispatcherProc over a small plan, logging to `log_path`."""
    from dflash_ipc.dispatch.buckets import BucketSpec, plan_epoch
    from dflash_ipc.dispatch.dispatcher import Dispatcher
    from dflash_ipc.dispatch.proc import DispatcherProc
    logging.basicConfig(filename=log_path, level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    cfg = load_config(None, overrides)
    epochs = [plan_epoch(np.full(64, 32), BucketSpec(boundaries=(64,), token_budget=64), seed=0, epoch=0)]
    dispatcher = Dispatcher(epochs, policy="pull", num_targets=2, num_drafters=1,
                            heartbeat_timeout_s=cfg.dispatch.heartbeat_timeout_s)
    proc = DispatcherProc(cfg, dispatcher, address=cfg.dispatcher_address)
    signal.signal(signal.SIGTERM, lambda *_: setattr(proc, "stop_requested", True))
    try:
        proc.run()
    finally:
        proc.close()


def start(tmp_path, *extra, keys=False):
    overrides = [f"run.run_dir={tmp_path}", "target.num_workers=2", "drafter.num_workers=1",
                 "dispatch.heartbeat_timeout_s=3", "dispatch.heartbeat_interval_s=0.5", *extra]
    cfg = load_config(None, overrides)
    if keys:
        ensure_keys(cfg.files.curve_keys)  # what node 0's supervisor does before it starts anything
    child = mp.get_context("spawn").Process(target=_serve, args=(overrides, str(tmp_path / "dispatcher.log")),
                                            daemon=True)
    child.start()
    return cfg, child


def dealer(address, identity=None, **curve):
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if identity:
        sock.setsockopt(zmq.IDENTITY, identity)
    for key, value in curve.items():
        setattr(sock, key, value)
    sock.connect(address)
    return sock


def ask(sock, msg, timeout_ms=3000):
    # A DEALER whose connection never completes its handshake (a peer without the job's key)
    # has no pipe to queue on, and its send would block for ever: unanswered after timeout_ms.
    sock.setsockopt(zmq.SNDTIMEO, timeout_ms)
    try:
        sock.send_multipart(p.encode(msg) if not isinstance(msg, list) else msg)
    except zmq.Again:
        return None
    while sock.poll(timeout_ms):
        reply = p.decode(sock.recv_multipart())
        if not isinstance(reply, p.Heartbeat):
            return reply
    return None


def rss_mib(child) -> float:
    return psutil.Process(child.pid).memory_info().rss / 2**20


@pytest.mark.timeout(120)
def test_a_hostile_wire_sequence_leaves_the_dispatcher_small_on_time_and_serving(tmp_path):
    cfg, child = start(tmp_path)
    try:
        probe = dealer(cfg.dispatcher_address, b"probe")
        deadline = time.monotonic() + 60
        while ask(probe, p.StatusRequest(), timeout_ms=500) is None:
            assert time.monotonic() < deadline and child.is_alive(), "the dispatcher did not start"
        base = rss_mib(child)
        # A real target and drafter hold seats; the target then goes silent.
        target = dealer(cfg.dispatcher_address, b"target/0/1")
        assert isinstance(ask(target, p.Register(role="target", rank=0, pid=1, pool={"b": 1}, num_slots=1)), p.Registered)
        drafter = dealer(cfg.dispatcher_address, b"drafter/0/2")
        assert isinstance(ask(drafter, p.Register(role="drafter", rank=0, pid=os.getpid())), p.Registered)
        batch = ask(target, p.Ready(credits=1))
        assert isinstance(batch, p.Batch)
        silent_from = time.monotonic()
        evil = dealer(cfg.dispatcher_address, b"evil")
        # 1) absurd counts are refused: slot pools, tokens, a slot the pool does not have
        assert isinstance(ask(evil, p.Register(role="target", rank=1, pid=3, pool={"b": 1}, num_slots=5_000_000)),
                          p.Refused)
        assert isinstance(ask(target, [bytes((p.Kind.PRODUCED,)), __import__("msgpack").packb(
            {"batch_id": batch.batch_id, "slot": 0, "num_tokens": -10**12, "compute_s": 0.0})]), p.Rejected)
        assert isinstance(ask(target, p.Produced(batch_id=batch.batch_id, slot=7, num_tokens=32, compute_s=0.0)),
                          p.Rejected)
        # 2) a stray second drafter rank 0 from another socket does not take the live seat
        refused = ask(evil, p.Register(role="drafter", rank=0, pid=4))
        assert isinstance(refused, p.Refused) and "held by live pid" in refused.reason
        # 3) oversized frames are refused by the socket before they are buffered
        big = dealer(cfg.dispatcher_address, b"big")
        big.send_multipart([bytes((p.Kind.HEARTBEAT,)), b"\x00" * (100 << 20)])
        big.send_multipart([bytes((p.Kind.HEARTBEAT,)), b"\x00" * (11 << 20)])
        # 4) ten thousand status requests never read, and a 4-second garbage flood
        for _ in range(10_000):
            evil.send_multipart(p.encode(p.StatusRequest()), copy=False)
        flood_end = time.monotonic() + 4.0
        while time.monotonic() < flood_end:
            for _ in range(200):
                evil.send_multipart([b"\x04", b"\xc1garbage"])
        # Through all of it: small, and serving at once. (A fresh socket: the probe's may still
        # hold late answers to the start-up polls, statuses from before the drop.)
        started = time.monotonic()
        status = ask(dealer(cfg.dispatcher_address, b"probe2"), p.StatusRequest(), timeout_ms=10_000)
        assert isinstance(status, p.StatusReply) and time.monotonic() - started < 5.0
        assert rss_mib(child) - base < RSS_BOUND_MIB, (base, rss_mib(child))
        # The silent target was dropped on time (timeout 3 s, checked every 0.25 s), not after the flood.
        why = status.status.dropped_targets.get("1", "")
        assert why.startswith("silent for "), status.status.dropped_targets
        assert float(why.split()[2].rstrip("s")) < 3.0 + 1.0
        assert time.monotonic() - silent_from > 4.0
        assert all(v >= 0 for v in status.status.to_json()["tokens"].values())
        # The log holds a bounded number of refusals, not one line per garbage message.
        lines = (tmp_path / "dispatcher.log").read_text().count("refused a message")
        assert lines < 200, lines
        # SIGTERM stops it promptly.
        os.kill(child.pid, signal.SIGTERM)
        child.join(timeout=5)
        assert child.exitcode is not None
    finally:
        if child.is_alive():
            child.kill()
        child.join(timeout=5)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(90)
def test_curve_refuses_peers_without_the_jobs_key(tmp_path):
    cfg, child = start(tmp_path, f"dispatch.address=tcp://127.0.0.1:{_free_port()}", "dispatch.auth=curve",
                       keys=True)
    keys = cfg.files.curve_keys
    assert oct(os.stat(keys).st_mode & 0o777) == "0o700"
    assert oct(os.stat(os.path.join(keys, "worker.key_secret")).st_mode & 0o777) == "0o600"
    try:
        link = DispatcherLink.for_job(cfg, "observer/test", heartbeat_interval_s=3600, timeout_s=60)
        try:
            reply = link.request(p.StatusRequest(), timeout_s=60)  # the job's key: answered
            assert isinstance(reply, p.StatusReply)
        finally:
            link.close()
        plain = dealer(cfg.dispatcher_address)
        assert ask(plain, p.StatusRequest(), timeout_ms=2000) is None  # no key: never answered
        other = tmp_path / "other-job"
        ensure_keys(str(other))  # another job's worker key
        import zmq.auth
        public, secret = zmq.auth.load_certificate(str(other / "worker.key_secret"))
        server_public, _ = zmq.auth.load_certificate(os.path.join(keys, "dispatcher.key"))
        stranger = dealer(cfg.dispatcher_address, curve_secretkey=secret, curve_publickey=public,
                          curve_serverkey=server_public)
        assert ask(stranger, p.StatusRequest(), timeout_ms=2000) is None
    finally:
        child.kill()
        child.join(timeout=5)
