"""The dispatcher process on a real socket keeps serving through garbage and misbehaviour."""

import threading

import numpy as np
import zmq

from dflash_ipc import protocol as p
from dflash_ipc.config_load import load_config
from dflash_ipc.dispatch.buckets import BucketSpec, plan_epoch
from dflash_ipc.dispatch.dispatcher import Dispatcher
from dflash_ipc.dispatch.proc import DispatcherProc


def _request(sock, frames, timeout_ms=3000):
    sock.send_multipart(frames)
    assert sock.poll(timeout_ms), "the dispatcher did not answer"
    return p.decode(sock.recv_multipart())


def test_garbage_and_out_of_order_messages_are_refused_and_serving_goes_on(tmp_path):
    cfg = load_config(None, [f"run.run_dir={tmp_path}", "target.num_workers=1", "drafter.num_workers=1"])
    lengths = np.full(8, 32)
    epochs = [plan_epoch(lengths, BucketSpec(boundaries=(64,), token_budget=64), seed=0, epoch=0)]
    dispatcher = Dispatcher(epochs, policy="pull", num_targets=1, num_drafters=1)
    proc = DispatcherProc(cfg, dispatcher, address=cfg.dispatcher_address)
    thread = threading.Thread(target=proc.run, daemon=True)
    thread.start()
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(cfg.dispatcher_address)
    try:
        garbage = [[b"\xff", b"x"], [b"\x04", b"\xc1\xc1"], [b"\x04"], [b"", b""], [bytes((p.Kind.READY,)), b"\x91\x01"]]
        for frames in garbage:
            reply = _request(sock, frames)
            assert isinstance(reply, p.Rejected)
        # Out of order: work messages before registering, a batch never leased.
        # A sender without a seat is told so, with this dispatcher's instance.
        for early in (p.Ready(credits=1), p.Consumed(batch_id=3)):
            reply = _request(sock, p.encode(early))
            assert isinstance(reply, p.Unregistered) and reply.instance == dispatcher.instance
        # Registration refused with a reason, not left unanswered.
        refused = _request(sock, p.encode(p.Register(role="target", rank=7, pid=1, pool={"b": 1}, num_slots=1)))
        assert isinstance(refused, p.Refused) and "outside" in refused.reason
        # Still serving: a valid registration and a pull get their answers.
        ok = _request(sock, p.encode(p.Register(role="target", rank=0, pid=1, pool={"b": 1}, num_slots=2)))
        assert isinstance(ok, p.Registered)
        batch = _request(sock, p.encode(p.Ready(credits=1)))
        assert isinstance(batch, p.Batch)
        bogus = p.Produced(batch_id=batch.batch_id + 1, slot=batch.slot, num_tokens=1, compute_s=0.0)
        assert isinstance(_request(sock, p.encode(bogus)), p.Rejected)  # a batch it does not own
        status = _request(sock, p.encode(p.StatusRequest()))
        assert isinstance(status, p.StatusReply) and status.status["refusals"] == len(garbage) + 4
    finally:
        sock.close(linger=0)
        proc.stop_requested = True
        thread.join(timeout=5)
        assert not thread.is_alive()
        proc.close()
