"""The dispatcher process on a real socket keeps serving through garbage and misbehaviour."""

import threading

import msgpack
import numpy as np
import pytest
import zmq

from dflash_ipc.wire import protocol as p
from dflash_ipc.config.load import load_config
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
        garbage = [[b"\xff", b"x"], [b"\x04"], [b"", b""]]
        for frames in garbage:
            reply = _request(sock, frames)
            assert isinstance(reply, p.Rejected)
        # A known kind other than Register and StatusRequest from a sender without a seat is
        # not read at all: it is told to register, whatever its body holds.
        for frames in ([b"\x04", b"\xc1\xc1"], [bytes((p.Kind.READY,)), b"\x91\x01"]):
            reply = _request(sock, frames)
            assert isinstance(reply, p.Unregistered) and "not read" in reply.reason
        garbage += [None, None]
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
        assert isinstance(status, p.StatusReply) and status.status.refusals == len(garbage) + 4
    finally:
        sock.close(linger=0)
        proc.stop_requested = True
        thread.join(timeout=5)
        assert not thread.is_alive()
        proc.close()


def test_slow_requests_never_hold_up_liveness_checks_or_the_stop(tmp_path):
    """Slow requests (20 ms each here, standing in for any costly one): a flood of them must
    not delay the drop of a silent target (it did by 256 messages per pass) nor the end on a stop."""
    import time
    cfg = load_config(None, [f"run.run_dir={tmp_path}", "target.num_workers=1", "drafter.num_workers=1",
                             "dispatch.heartbeat_interval_s=0.2", "dispatch.heartbeat_timeout_s=0.5"])
    epochs = [plan_epoch(np.full(8, 32), BucketSpec(boundaries=(64,), token_budget=64), seed=0, epoch=0)]
    dispatcher = Dispatcher(epochs, policy="pull", num_targets=1, num_drafters=1, heartbeat_timeout_s=0.5)
    real_status = dispatcher.status
    dispatcher.status = lambda: (time.sleep(0.02), real_status())[1]  # a large ledger's status
    proc = DispatcherProc(cfg, dispatcher, address=cfg.dispatcher_address)
    ctx = zmq.Context.instance()
    target, flood = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
    for sock in (target, flood):
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(cfg.dispatcher_address)
    thread = threading.Thread(target=proc.run, daemon=True)
    thread.start()
    try:
        assert isinstance(_request(target, p.encode(p.Register(role="target", rank=0, pid=1, pool={"b": 1},
                                                                num_slots=1))), p.Registered)
        silent_from = time.monotonic()
        for _ in range(2000):  # 40 s of status work queued
            flood.send_multipart(p.encode(p.StatusRequest()))
        while dispatcher.targets and time.monotonic() - silent_from < 3.0:
            time.sleep(0.05)
        assert not dispatcher.targets, "the silent target was not dropped on time"
        assert time.monotonic() - silent_from < 0.5 + 1.0
    finally:
        stopped = time.monotonic()
        proc.stop_requested = True
        thread.join(timeout=5)
        assert not thread.is_alive() and time.monotonic() - stopped < 2.0
        for sock in (target, flood):
            sock.close(linger=0)
        proc.close()


def test_the_final_status_carries_the_audit_of_the_ledger_against_the_plan(tmp_path):
    """Driven in process to the end (no socket traffic): final_status.json says whether every
    planned sample of every epoch was committed exactly once, and the tokens per epoch."""
    import json
    cfg = load_config(None, [f"run.run_dir={tmp_path}", "target.num_workers=1", "drafter.num_workers=1"])
    epochs = [plan_epoch(np.full(6, 32), BucketSpec(boundaries=(64,), token_budget=64), seed=0, epoch=e,
                         first_batch_id=3 * e) for e in range(2)]
    dispatcher = Dispatcher(epochs, policy="pull", num_targets=1, num_drafters=1)
    proc = DispatcherProc(cfg, dispatcher, address=cfg.dispatcher_address)
    try:
        dispatcher.handle(b"t", p.Register(role="target", rank=0, pid=1, pool={"b": 1}, num_slots=1))
        dispatcher.handle(b"d", p.Register(role="drafter", rank=0, pid=2))
        step = 0
        for _ in range(3 * 2):
            (_, batch), = [m for m in dispatcher.handle(b"t", p.Ready(credits=1)) if isinstance(m[1], p.Batch)]
            dispatcher.handle(b"t", p.Produced(batch_id=batch.batch_id, slot=batch.slot, num_tokens=64, compute_s=0.0))
            (_, a), = dispatcher.handle(b"d", p.WantHidden(credits=1))
            dispatcher.handle(b"d", p.Consumed(batch_id=a.batch_id, attempt=a.attempt))
            if step == 4:  # four of six batches committed: four of twelve samples are missing
                proc.write_final_status()
                midway = json.loads(open(cfg.files.final_status).read())["audit"]
                assert not midway["ok"] and midway["missing"] == 4 and midway["duplicated"] == 0
            step += 1
            dispatcher.handle(b"d", p.Committed(step=step, batch_ids=[a.batch_id], ranks=[0], attempts=[a.attempt],
                                                samples=[a.sample_ids]))
        assert dispatcher.finished
        proc.write_final_status()
        final = json.loads(open(cfg.files.final_status).read())
        assert final["audit"]["ok"] and final["audit"]["committed_samples"] == 12
        assert final["committed_tokens_by_epoch"] == {"0": 6 * 32, "1": 6 * 32}
    finally:
        proc.close()


class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def _drive(dispatcher, clock, drafter, step, *, seconds=10.0, trained=None):
    """One batch through a target and drafter 0 of the current group, committed at `step`;
    `seconds` pass, and drafter 0's heartbeat reports `trained` tokens (its own count)."""
    (_, batch), = [m for m in dispatcher.handle(b"t", p.Ready(credits=1)) if isinstance(m[1], p.Batch)]
    dispatcher.handle(b"t", p.Produced(batch_id=batch.batch_id, slot=batch.slot,
                                       num_tokens=dispatcher.ledger.entry(batch.batch_id).remaining_tokens,
                                       compute_s=0.0))
    (_, a), = dispatcher.handle(drafter, p.WantHidden(credits=1))
    dispatcher.handle(drafter, p.Consumed(batch_id=a.batch_id, attempt=a.attempt))
    clock.now += seconds
    if trained is not None:
        dispatcher.handle(drafter, p.Heartbeat(metrics={"trained_tokens": float(trained)}))
    dispatcher.handle(drafter, p.Committed(step=step, batch_ids=[a.batch_id], ranks=[0], attempts=[a.attempt],
                                           samples=[a.sample_ids]))
    dispatcher.tick()
    return a.num_tokens


def _final(proc, cfg):
    import json
    proc.write_final_status()
    with open(cfg.files.final_status) as f:
        return json.load(f)


def test_after_a_drafter_group_restart_the_average_tok_rate_counts_the_whole_run(tmp_path):
    """The new group's drafters count their trained tokens from 0: the whole-run average
    must not divide that reset count by the whole elapsed time."""
    cfg = load_config(None, [f"run.run_dir={tmp_path}", "target.num_workers=1", "drafter.num_workers=1"])
    epochs = [plan_epoch(np.full(8, 32), BucketSpec(boundaries=(64,), token_budget=64), seed=0, epoch=0)]
    clock = _Clock()
    dispatcher = Dispatcher(epochs, policy="pull", num_targets=1, num_drafters=1, clock=clock)
    proc = DispatcherProc(cfg, dispatcher, address=cfg.dispatcher_address)
    try:
        dispatcher.handle(b"t", p.Register(role="target", rank=0, pid=1, pool={"b": 1}, num_slots=1))
        dispatcher.handle(b"d/1", p.Register(role="drafter", rank=0, pid=2))
        tokens = trained = 0
        for step in (1, 2):
            trained += _drive(dispatcher, clock, b"d/1", step, trained=trained + 64)
        tokens = trained
        dispatcher.handle(b"d/2", p.Register(role="drafter", rank=0, pid=3, replaces_pids=[2]))
        dispatcher.handle(b"d/2", p.Resumed(step=2))
        fresh = 0
        for step in (3, 4):
            fresh += _drive(dispatcher, clock, b"d/2", step, trained=fresh + 64)
        tokens += fresh
        final = _final(proc, cfg)
        assert final["tokens"]["committed"] == tokens == 4 * 64
        assert final["average_rates"]["tok_rate"] == pytest.approx(tokens / clock.now)
    finally:
        proc.close()


def test_a_rerun_final_status_covers_the_whole_run(tmp_path):
    """A second dispatcher finishes the job from the first one's ledger: final_status.json's
    tokens are the whole run's, its average tok_rate this dispatcher's commits over its time."""
    from dflash_ipc.dispatch.ledger_file import load_ledger, save_ledger
    cfg = load_config(None, [f"run.run_dir={tmp_path}", "target.num_workers=1", "drafter.num_workers=1"])
    epochs = [plan_epoch(np.full(8, 32), BucketSpec(boundaries=(64,), token_budget=64), seed=0, epoch=0)]
    clock = _Clock()
    first = Dispatcher(epochs, policy="pull", num_targets=1, num_drafters=1, clock=clock)
    first.handle(b"t", p.Register(role="target", rank=0, pid=1, pool={"b": 1}, num_slots=1))
    first.handle(b"d", p.Register(role="drafter", rank=0, pid=2))
    before = sum(_drive(first, clock, b"d", step) for step in (1, 2))
    save_ledger(first.ledger, cfg.files.ledger)
    clock2 = _Clock()
    second = Dispatcher(epochs, policy="pull", num_targets=1, num_drafters=1, clock=clock2,
                        ledger=load_ledger(cfg.files.ledger))
    proc = DispatcherProc(cfg, second, address=cfg.dispatcher_address)
    try:
        second.handle(b"t", p.Register(role="target", rank=0, pid=3, pool={"b": 1}, num_slots=1))
        second.handle(b"d", p.Register(role="drafter", rank=0, pid=4))
        after = sum(_drive(second, clock2, b"d", step, trained=64 * (step - 2)) for step in (3, 4))
        assert second.finished
        final = _final(proc, cfg)
        assert final["tokens"]["committed"] == final["tokens"]["total"] == before + after
        assert final["committed_tokens_by_epoch"] == {"0": before + after}
        assert final["average_rates"]["tok_rate"] == pytest.approx(after / clock2.now)
    finally:
        proc.close()


def test_a_register_with_mixed_key_types_is_refused_and_the_handler_returns(tmp_path):
    cfg = load_config(None, [f"run.run_dir={tmp_path}", "target.num_workers=1", "drafter.num_workers=1"])
    lengths = np.full(8, 32)
    epochs = [plan_epoch(lengths, BucketSpec(boundaries=(64,), token_budget=64), seed=0, epoch=0)]
    dispatcher = Dispatcher(epochs, policy="pull", num_targets=1, num_drafters=1)
    proc = DispatcherProc(cfg, dispatcher, address=cfg.dispatcher_address)
    try:
        body = msgpack.packb({"role": "target", "rank": 0, "pid": 1, "x": 1, b"y": 2},
                             use_bin_type=True)
        proc._on_frames([b"stranger", bytes((p.Kind.REGISTER,)), body])  # raised TypeError before
        assert dispatcher.refusals == 1
    finally:
        proc.close()


def test_an_observer_with_the_secret_is_trusted_past_the_budgets(tmp_path):
    from dflash_ipc.dispatch.peer_budget import PeerBudget, StatusAnswers
    cfg = load_config(None, [f"run.run_dir={tmp_path}", "target.num_workers=1", "drafter.num_workers=1"])
    lengths = np.full(8, 32)
    epochs = [plan_epoch(lengths, BucketSpec(boundaries=(64,), token_budget=64), seed=0, epoch=0)]
    secret = b"k" * 32
    dispatcher = Dispatcher(epochs, policy="pull", num_targets=1, num_drafters=1, secret=secret)
    proc = DispatcherProc(cfg, dispatcher, address=cfg.dispatcher_address)
    try:
        register = p.encode(p.Register(role="observer", rank=0, pid=1, secret=secret))
        proc._on_frames([b"supervisor", *register])  # admitted: the budget is not full yet
        proc._on_frames([b"guesser", *p.encode(p.Register(role="observer", rank=0, pid=2, secret=b"x" * 32))])
        assert dispatcher.trusted(b"supervisor") and not dispatcher.trusted(b"guesser")
        assert not dispatcher.holds_seat(b"supervisor")  # trusted, but no seat
        # A flood spent every budget and filled the waiting table.
        proc.budget = PeerBudget(frames=0, nbytes=0, window_s=1.0, max_peers=0)
        proc.status_answers = StatusAnswers(interval_s=0.2, max_waiting=1)
        proc.status_answers.ask(b"flooder")
        for identity in (b"guesser", b"supervisor"):
            proc._on_frames([identity, *p.encode(p.StatusRequest())])
        assert proc.status_answers.due() == [b"flooder", b"supervisor"]
    finally:
        proc.close()
