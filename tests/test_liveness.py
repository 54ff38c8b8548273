"""The liveness beacon: a thread rewrites it, the reader refuses anything malformed (a torn,
damaged or crafted file is 'no beacon', never a crash of the supervisor that reads it), and the
verdict tells a stopped process and a phase past its limit from a long but alive one."""

import json
import os
import time

import pytest

from dflash_ipc.run.liveness import BEAT_S, Beacon, beacon_problem, read_beacon

LIMITS = {"compile": 100.0, "step": 10.0, "checkpoint": 50.0}


def test_the_beacon_is_written_at_once_and_rewritten_by_its_thread(tmp_path):
    path = str(tmp_path / "beacons" / "drafter-0")
    beacon = Beacon(path)
    try:
        first = read_beacon(path)
        assert first["pid"] == os.getpid() and first["phase"] == "start" and first["step"] == 0
        beacon.phase("step", 7)
        since = None
        deadline = time.monotonic() + 10 * BEAT_S
        while time.monotonic() < deadline:
            record = read_beacon(path)
            if record["phase"] == "step":
                since = record["since"]
                break
            time.sleep(BEAT_S / 5)
        assert since is not None and record["step"] == 7 and record["time"] >= first["time"]
        beacon.phase("step", 8)  # the same phase again: its start does not move
        deadline = time.monotonic() + 10 * BEAT_S  # the thread's next rewrite, on a loaded machine too
        while (again := read_beacon(path))["step"] != 8 and time.monotonic() < deadline:
            time.sleep(BEAT_S / 5)
        assert again["since"] == since and again["step"] == 8 and again["time"] > record["time"]
        with pytest.raises(ValueError, match="not one of"):
            beacon.phase("sleeping")
    finally:
        beacon.close()
    closed = read_beacon(path)
    assert closed["phase"] == "exit" and closed["step"] == 8  # the last record says the worker is leaving
    time.sleep(1.5 * BEAT_S)
    assert read_beacon(path)["time"] == closed["time"]  # the thread stopped with close()


@pytest.mark.parametrize("text", ["", "{", "[1]", json.dumps({"time": 1, "pid": 2, "since": 1, "phase": "nap"}),
                                  json.dumps({"time": "1", "pid": 2, "since": 1, "phase": "step"})])
def test_a_malformed_beacon_reads_as_none(tmp_path, text):
    path = tmp_path / "b"
    path.write_text(text)
    assert read_beacon(str(path)) is None
    assert read_beacon(str(tmp_path / "missing")) is None


def test_the_verdict_tells_stopped_and_stuck_from_slow():
    now = 1000.0
    record = {"time": now - 1, "pid": 42, "phase": "step", "since": now - 9, "step": 3}
    assert beacon_problem(record, pid=42, now=now, stall_s=30, limits=LIMITS) is None  # a slow step
    assert beacon_problem({**record, "time": now - 31}, pid=42, now=now, stall_s=30, limits=LIMITS).startswith(
        "its liveness beacon stopped 31.0s ago")
    assert "11s in phase 'step' (limit 10s)" in beacon_problem({**record, "since": now - 11}, pid=42, now=now,
                                                                stall_s=30, limits=LIMITS)
    waiting = {**record, "phase": "wait", "since": now - 5000}  # waiting for hidden states has no limit
    assert beacon_problem(waiting, pid=42, now=now, stall_s=30, limits=LIMITS) is None
    # Closed on the way out (Beacon.close): however old, no hang; the process's exit is seen as any.
    assert beacon_problem({**record, "phase": "exit", "time": now - 300}, pid=42, now=now, stall_s=30,
                          limits=LIMITS) is None
    # Not this process's beacon yet (its predecessor's), or none: the start-up timeout judges.
    assert beacon_problem({**record, "time": 0.0}, pid=43, now=now, stall_s=30, limits=LIMITS) is None
    assert beacon_problem(None, pid=42, now=now, stall_s=30, limits=LIMITS) is None


def test_a_damaged_beacon_reads_as_none(tmp_path):
    path = tmp_path / "drafter-0"
    path.write_text(json.dumps({"time": 1.0, "since": 0.5, "pid": 7, "phase": "step"}))
    assert read_beacon(str(path))["pid"] == 7
    for text in ("[" * 100_000, '{"time": 1', "[1]", '{"time": "x", "since": 0, "pid": 7, "phase": "step"}',
                 '{"time": 1, "since": 0, "pid": 7, "phase": "dancing"}', '{"pid": ' + "9" * 5000 + "}"):
        path.write_text(text)
        assert read_beacon(str(path)) is None
    path.write_bytes(b"\xff\xfe")
    assert read_beacon(str(path)) is None
    assert read_beacon(str(tmp_path / "missing")) is None
