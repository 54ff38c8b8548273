"""The liveness beacon read back: a torn, damaged or crafted file is 'no beacon', never a crash
of the supervisor that reads it."""

import json

from dflash_ipc.liveness import read_beacon


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
