"""Wire codec: every message round-trips; garbage is refused with a ProtocolError."""

import dataclasses
import time
import typing

import msgpack
import pytest

from dflash_ipc.wire import protocol as p
from dflash_ipc.errors import ProtocolError
from dflash_ipc.wire import status as st
from statuses import drafter, make_status, target

EXAMPLES = [
    p.Register(role="target", rank=3, pid=123, node=0, device="cuda:3", pool={"backend": "shm", "h": b"\x00\x01"},
               num_slots=4),
    p.Registered(role="drafter", rank=1, num_batches=99),
    p.Refused(reason="no"),
    p.Ready(credits=2),
    p.Batch(batch_id=7, epoch=1, slot=2, sample_ids=[5, 9, 11], padded_len=128),
    p.Produced(batch_id=7, slot=2, num_tokens=300, compute_s=0.25),
    p.WantHidden(credits=1),
    p.Assign(batch_id=7, epoch=1, target=3, pool={"backend": "shm"}, slot=2, sample_ids=[5], num_tokens=3),
    p.Consumed(batch_id=7),
    p.Lost(batch_id=7, attempt=4, reason="producer gone"),
    p.Committed(step=10, batch_ids=[1, 2], ranks=[0, 1], attempts=[4, 9], samples=[[5, 6], [7]]),
    p.CommitDone(step=10),
    p.Resumed(step=-1),
    p.Heartbeat(metrics={"loss": 1.5, "step": 3}),
    p.StatusRequest(),
    p.StatusReply(status=make_status([(3, 1), (3, 0)], tok_rate=12.5, trained=30, committed_tokens=20)),
    p.EndOfData(),
    p.Shutdown(reason="done"),
    p.Rejected(kind=5, reason="bad"),
    p.Unregistered(instance="ab12", reason="unknown sender"),
    p.Assign(batch_id=7, epoch=1, target=3, pool={}, slot=2, sample_ids=[5], num_tokens=3, attempt=4),
    p.Consumed(batch_id=7, attempt=4),
    p.Register(role="drafter", rank=0, pid=9, replaces_pids=[7, 8]),
    p.Registered(role="drafter", rank=0, num_batches=9, resume_step=20, committed_steps=[10, 20]),
]


def test_every_kind_has_an_example():
    assert {type(m) for m in EXAMPLES} == set(typing.get_args(p.Message))


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(msg):
    frames = p.encode(msg)
    assert len(frames[0]) == 1 and frames[0][0] == msg.KIND
    assert p.decode(frames) == msg


def _body(msg):
    return {f.name: getattr(msg, f.name) for f in dataclasses.fields(msg)}


@pytest.mark.parametrize("frames, needle", [
    ([b"\x05"], "expected 2 frames"),
    ([b"\x05\x05", b""], "1 byte"),
    ([b"\xff", msgpack.packb({})], "unknown message kind"),
    ([bytes((p.Kind.READY,)), b"\xc1garbage"], "undecodable"),
    ([bytes((p.Kind.BATCH,)), msgpack.packb([1, 2])], "must be a map"),
    ([bytes((p.Kind.READY,)), msgpack.packb([1, 2])], "max_array_len"),  # Ready holds no list
    ([bytes((p.Kind.READY,)), msgpack.packb({})], "missing ['credits']"),
    ([bytes((p.Kind.READY,)), msgpack.packb({"credits": 1, "x": 2})], "unknown fields ['x']"),
    ([bytes((p.Kind.READY,)), msgpack.packb({"credits": "1"})], "READY.credits"),
    ([bytes((p.Kind.READY,)), msgpack.packb({"credits": True})], "READY.credits"),
    ([bytes((p.Kind.BATCH,)), msgpack.packb({**_body(EXAMPLES[4]), "sample_ids": [1, "a"]})], "sample_ids"),
    ([bytes((p.Kind.HEARTBEAT,)), msgpack.packb({"metrics": {"a": "x"}})], "metrics"),
])
def test_garbage_is_refused(frames, needle):
    with pytest.raises(ProtocolError) as info:
        p.decode(frames)
    assert needle in str(info.value)


def test_oversized_body_is_refused():
    with pytest.raises(ProtocolError, match="exceeds"):
        p.decode([bytes((p.Kind.READY,)), b"\x00" * (p.MAX_BODY_BYTES + 1)])


@pytest.mark.parametrize("kind, body, needle", [
    (p.Kind.PRODUCED, {"batch_id": 1, "slot": 0, "num_tokens": -10**12, "compute_s": 0.1}, "outside [-1, 2**62]"),
    (p.Kind.PRODUCED, {"batch_id": 1, "slot": 0, "num_tokens": 1, "compute_s": float("nan")}, "not a finite"),
    (p.Kind.REGISTER, {"role": "target", "rank": 0, "pid": 1, "num_slots": 5 * 10**18}, "outside [-1, 2**62]"),
    (p.Kind.HEARTBEAT, {"metrics": {f"m{i}": 1.0 for i in range(p.MAX_METRICS + 1)}}, "max_map_len(64)"),
    (p.Kind.HEARTBEAT, {"metrics": {"x" * (p.MAX_METRIC_NAME + 1): 1.0}}, "max_str_len(64)"),
    (p.Kind.BATCH, {"batch_id": 1, "epoch": 0, "slot": 0, "sample_ids": [], "padded_len": 1,
                    "x": "x" * (p.MAX_STR + 1)}, "max_str_len"),
    (p.Kind.REJECTED, {"kind": 1, "reason": "r" * (p.MAX_STR + 1)}, "max_str_len"),
    (p.Kind.PRODUCED, {"batch_id": 1, "slot": 0, "num_tokens": 1, "compute_s": 1e308}, "within 2**62"),
    (p.Kind.HEARTBEAT, {"metrics": {"trained_tokens": -1e300}}, "within 2**62"),
    (p.Kind.REGISTER, {"role": "target", "rank": 0, "pid": 1, "pool": {"h": msgpack.ExtType(5, b"x")}},
     "max_ext_len"),
    (p.Kind.REGISTER, {"role": "target", "rank": 0, "pid": 1, "pool": {"t": msgpack.Timestamp(1, 0)}},
     "max_ext_len"),
])
def test_values_outside_the_wire_bounds_are_refused(kind, body, needle):
    """Whatever a peer sends, a decoded message is small and finite: no sender can grow the
    dispatcher's memory or poison its arithmetic (negative rates, NaN in the status)."""
    with pytest.raises(ProtocolError) as info:
        p.decode([bytes((kind,)), msgpack.packb(body)])
    assert needle in str(info.value)


def test_deep_nesting_is_refused_not_a_crash():
    deep = b"\x91" * 100_000 + b"\x01"  # [[[...1...]]] 100k deep
    with pytest.raises(ProtocolError):
        p.decode([bytes((p.Kind.HEARTBEAT,)), msgpack.packb({"metrics": 1})[:-1] + deep])


def test_nesting_below_the_recursion_limit_is_refused_at_max_depth():
    """600 levels fit msgpack's stack (1,024) but used to exhaust Python's recursion limit in
    the validator (RecursionError: the dispatcher died on one 1,841-byte Register)."""
    pool: dict = {}
    for _ in range(600):
        pool = {"p": pool}
    body = msgpack.packb({"role": "target", "rank": 0, "pid": 1, "pool": pool}, use_bin_type=True)
    with pytest.raises(ProtocolError, match=f"nested deeper than {p.MAX_DEPTH}"):
        p.decode([bytes((p.Kind.REGISTER,)), body])
    deep_list = [1]
    for _ in range(600):
        deep_list = [deep_list]
    assert "nested deeper" in p.check_value({"x": deep_list}, dict)
    assert p.check_value({"x": [[1]]}, dict) is None


def test_a_body_of_millions_of_empty_lists_is_refused_at_its_header():
    """~4.2M empty lists in 4 MB: refused when msgpack reads the outer list's length, before
    it builds one list object (that used to cost ~300 MB and seconds per message)."""
    n = p.MAX_BODY_BYTES - 64
    body = msgpack.packb({"step": 1, "batch_ids": [], "ranks": [], "attempts": [], "samples": []})[:-1]
    body += b"\xdd" + n.to_bytes(4, "big") + b"\x90" * n
    started = time.perf_counter()
    with pytest.raises(ProtocolError, match="max_array_len"):
        p.decode([bytes((p.Kind.COMMITTED,)), body])
    assert time.perf_counter() - started < 0.05


def test_register_bounds_its_body_and_secret_and_hides_the_secret():
    reg = p.Register(role="target", rank=0, pid=1, secret=b"s" * 32)
    assert "sss" not in repr(reg) and p.decode(p.encode(reg)).secret == b"s" * 32
    with pytest.raises(ProtocolError, match="at most 64"):
        p.decode(p.encode(p.Register(role="target", rank=0, pid=1, secret=b"s" * 65)))
    big = p.encode(p.Register(role="target", rank=0, pid=1, pool={f"k{i}": "v" * 4000 for i in range(20)}))
    with pytest.raises(ProtocolError, match=f"exceeds {p.MAX_REGISTER_BYTES}"):
        p.decode(big)
    with pytest.raises(ProtocolError, match="exceeds 64"):
        p.decode([bytes((p.Kind.STATUS_REQUEST,)), msgpack.packb({"x" * 100: 1})])


def test_nothing_is_pickled():
    # msgpack ext types (the only way to smuggle objects) are refused as undecodable or mistyped.
    ext = msgpack.packb({"credits": msgpack.ExtType(1, b"\x80\x04")})
    with pytest.raises(ProtocolError):
        p.decode([bytes((p.Kind.READY,)), ext])


def _status_reply(change) -> list[bytes]:
    """A StatusReply's frames with its status map changed by `change` (as a hostile or broken
    dispatcher might send it)."""
    status = make_status([(3, 1)])
    status.targets = {"0": target(metrics={"loss": 1.0})}
    status.drafters = {"0": drafter()}
    plain = status.to_json()
    change(plain)
    return [bytes((p.Kind.STATUS_REPLY,)), msgpack.packb({"status": plain}, use_bin_type=True)]


def test_a_status_reply_is_typed_and_read_by_attribute():
    status = make_status([(3, 1)])
    status.targets = {"0": target(free_slots=2, metrics={"busy_s": 1.5})}
    reply = p.decode(p.encode(p.StatusReply(status=status)))
    assert isinstance(reply.status, st.JobStatus) and isinstance(reply.status.targets["0"], st.TargetStatus)
    assert reply.status.targets["0"].free_slots == 2 and reply.status.batches.committed == 1
    assert reply.status.epochs[0] == st.EpochProgress(epoch=0, batches=3, committed=1)


def test_a_status_without_the_epochs_planned_tokens_reads_as_0():
    """`EpochProgress.tokens` is optional on the way in: a dispatcher or a final_status.json
    that does not send it is read with 0 (unknown); one of the wrong type is refused naming it."""
    reply = p.decode(_status_reply(lambda s: s["epochs"][0].pop("tokens")))
    assert reply.status.epochs[0] == st.EpochProgress(epoch=0, batches=3, committed=1, tokens=0)
    status = make_status([(3, 1)], total_tokens=300)
    assert p.decode(p.encode(p.StatusReply(status=status))).status.epochs[0].tokens == 300
    assert st.JobStatus.from_json(status.to_json(), "here").epochs[0].tokens == 300
    with pytest.raises(ProtocolError, match=r"status.epochs\[0\].tokens: str '2' is not int"):
        p.decode(_status_reply(lambda s: s["epochs"][0].update(tokens="2")))


@pytest.mark.parametrize("change, needle", [
    (lambda s: s.pop("tokens"), r"status: unknown fields \[\], missing \['tokens'\]"),
    (lambda s: s["batches"].update(committed=True), r"status.batches.committed: bool True is not int"),
    (lambda s: s["targets"]["0"].update(extra=1), r"status.targets\['0'\]: unknown fields \['extra'\]"),
    (lambda s: s["rates"].update(tok_rate=float("inf")), r"status.rates.tok_rate: inf is not a finite number"),
    (lambda s: s.update(policy="x" * (st.MAX_STR + 1)), r"16385"),  # msgpack's own string limit, first
    (lambda s: s["targets"]["0"]["metrics"].update({f"m{i}": 1.0 for i in range(st.MAX_METRICS)}),
     r"status.targets\['0'\].metrics: 65 entries, at most 64"),
    (lambda s: s.update(dropped_targets={str(i): "x" for i in range(st.MAX_MAP + 1)}),
     r"status.dropped_targets: 257 entries, at most 256"),
    (lambda s: s["epochs"].append({"epoch": [[[[1]]]], "batches": 1, "committed": 0}),
     r"status.epochs\[1\].epoch: list .* is not int"),
    (lambda s: s.update(last_committed_step=-5), r"status.last_committed_step: integer -5 outside"),
])
def test_a_status_reply_out_of_shape_or_bounds_is_refused(change, needle):
    with pytest.raises(ProtocolError, match=needle):
        p.decode(_status_reply(change))


def test_the_status_bounds_are_the_wires():
    assert (st.MAX_STR, st.MAX_INT, st.MAX_MAP, st.MAX_LIST, st.MAX_METRICS) == (
        p.MAX_STR, p.MAX_INT, p.MAX_MAP, p.MAX_LIST, p.MAX_METRICS)


def test_unknown_keys_mixing_str_and_bytes_are_refused_not_a_crash():
    # a bin-typed key decodes to bytes; str and bytes do not sort together
    body = msgpack.packb({"role": "target", "rank": 0, "pid": 1, "x": 1, b"y": 2}, use_bin_type=True)
    with pytest.raises(ProtocolError, match="unknown fields"):
        p.decode([bytes((p.Kind.REGISTER,)), body])


def test_an_unexpected_error_while_checking_a_body_is_a_protocol_error(monkeypatch):
    def broken(value, hint):
        raise KeyError("boom")
    monkeypatch.setattr(p, "check_value", broken)
    with pytest.raises(ProtocolError, match="malformed body"):
        p.decode(p.encode(p.Ready(credits=1)))



@pytest.mark.parametrize("text", ["é" * 500, "é" * 501, "路径" * 400, "x" * 5000, "a" + "€" * 600])
def test_a_long_non_ascii_lost_reason_cut_by_cut_reason_is_accepted(text):
    reason = p.cut_reason(text)
    assert len(reason.encode()) <= p.MAX_REASON and text.startswith(reason)
    assert p.decode(p.encode(p.Lost(batch_id=1, attempt=0, reason=reason))).reason == reason
    if len(text.encode()) > p.MAX_REASON:  # one limit, in bytes: the uncut reason is refused
        with pytest.raises(ProtocolError):
            p.decode(p.encode(p.Lost(batch_id=1, attempt=0, reason=text)))


def test_a_mistyped_secret_is_not_echoed():
    hex_secret = "ab" * 32
    body = msgpack.packb({"role": "target", "rank": 0, "pid": 1, "secret": hex_secret})
    with pytest.raises(ProtocolError, match="secret") as err:
        p.decode([bytes((p.Kind.REGISTER,)), body])
    assert "abab" not in str(err.value)
