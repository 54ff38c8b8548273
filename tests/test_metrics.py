"""Timeline writer (buffering, merging, files) and the metric arithmetic on scripted timelines."""

import json
import time

import numpy as np
import pytest

from dflash_ipc.obs.timelines import (TimelineWriter, load_timeline, load_timelines, rate_series, state_seconds,
                                summarize)
from dflash_ipc.run.files import RunFiles


def _rows(*spec):
    return [{"t0": t0, "t1": t1, "state": state, **extra} for t0, t1, state, extra in spec]


def test_target_summary_on_scripted_timeline():
    rows = _rows((10.0, 11.0, "wait_work", {}), (11.0, 13.0, "busy", {"tokens": 100}),
                 (13.0, 14.0, "wait_work", {}), (14.0, 15.0, "busy", {"tokens": 50}))
    s = summarize(rows)
    assert s["start"] == 10.0 and s["span_s"] == pytest.approx(5.0)
    assert s["busy_fraction"] == pytest.approx(3 / 5)
    assert s["wait_work_s"] == pytest.approx(2.0) and s["busy_s"] == pytest.approx(3.0)
    assert s["other_s"] == pytest.approx(0.0)
    assert s["tokens"] == 150 and s["tokens_per_s"] == pytest.approx(30.0)
    assert s["count"] == 2 and "step_s_mean" not in s


def test_drafter_summary_on_scripted_timeline():
    rows = _rows((0.0, 2.0, "wait_hidden", {}),
                 (2.0, 3.0, "step", {"loss": 2.0, "anchors": 10, "sequences": 2, "tokens": 40}),
                 # 3.0 .. 3.5 not recorded (a checkpoint)
                 (3.5, 5.0, "step", {"loss": 1.0, "anchors": 8, "sequences": 1, "tokens": 20}),
                 (5.0, 5.0, "step", {"loss": float("nan"), "anchors": 0, "sequences": 0, "tokens": 0}))
    s = summarize(rows)
    assert s["span_s"] == pytest.approx(5.0)
    assert s["busy_fraction"] == pytest.approx(2.5 / 5)
    assert s["wait_hidden_s"] == pytest.approx(2.0) and s["other_s"] == pytest.approx(0.5)
    assert s["step_s_mean"] == pytest.approx(2.5 / 3)
    assert s["anchors_per_s"] == pytest.approx(18 / 5) and s["sequences_per_s"] == pytest.approx(3 / 5)
    assert s["tokens_per_s"] == pytest.approx(12.0)
    assert s["loss_last"] == 1.0  # the NaN of an empty step is skipped


def test_state_seconds_lists_every_state():
    seconds = state_seconds(_rows((0.0, 1.5, "wait_slot", {})))
    assert seconds == {"busy": 0.0, "wait_work": 0.0, "wait_slot": 1.5, "wait_hidden": 0.0, "step": 0.0}
    assert summarize([]) == {"span_s": 0.0, "busy_fraction": 0.0}


def test_rate_series_counts_at_interval_end_and_smooths():
    rows = _rows((0.0, 0.5, "busy", {"tokens": 100}), (1.9, 2.5, "busy", {"tokens": 50}),
                 (2.5, 2.6, "wait_work", {}))
    assert rate_series(rows, "tokens", 0.0, 3.0, 1.0).tolist() == [100.0, 0.0, 50.0]
    assert rate_series(rows, "tokens", 0.0, 3.0, 0.5).tolist() == [0.0, 200.0, 0.0, 0.0, 0.0, 100.0]
    smooth = rate_series(rows, "tokens", 0.0, 3.0, 1.0, window_bins=3)
    np.testing.assert_allclose(smooth, [50.0, 50.0, 25.0])  # edges average over the bins inside


def test_writer_buffers_merges_and_closes(tmp_path):
    path = RunFiles(str(tmp_path)).timeline("target/3")
    writer = TimelineWriter(path, "target/3", flush_interval_s=3600)
    assert path == str(tmp_path / "metrics" / "target-3.jsonl") == writer.path
    base = time.perf_counter()
    writer.record("wait_work", base, base + 0.02)
    writer.record("wait_work", base + 0.02, base + 0.04)    # back to back: one interval
    writer.record("wait_work", base + 0.04, base + 0.04 + 1e-6)  # a poll: dropped
    writer.record("busy", base + 0.05, base + 0.15, tokens=7, batch=2)
    writer.record("wait_work", base + 0.15, base + 0.2)
    assert (tmp_path / "metrics" / "target-3.jsonl").read_text() == ""  # buffered
    writer.close()
    writer.close()  # idempotent
    rows = load_timeline(path)
    assert [r["state"] for r in rows] == ["wait_work", "busy", "wait_work"]
    assert rows[0]["t1"] - rows[0]["t0"] == pytest.approx(0.04, abs=1e-5)
    assert rows[1] == {"t0": pytest.approx(rows[0]["t0"] + 0.05), "t1": pytest.approx(rows[0]["t0"] + 0.15),
                       "state": "busy", "tokens": 7, "batch": 2}
    assert abs(rows[0]["t0"] - time.time()) < 60  # wall clock, comparable across processes


def test_writer_flushes_on_interval_but_keeps_growing_tail(tmp_path):
    writer = TimelineWriter(RunFiles(str(tmp_path)).timeline("drafter/0"), "drafter/0", flush_interval_s=0.0)
    base = time.perf_counter()
    writer.record("step", base, base + 0.1, loss=1.5, anchors=4, sequences=1, tokens=9)
    writer.record("wait_hidden", base + 0.1, base + 0.2)
    lines = open(writer.path).read().splitlines()
    assert [json.loads(line)["state"] for line in lines] == ["step"]  # the wait may still grow
    writer.record("wait_hidden", base + 0.2, base + 0.3)
    writer.close()
    rows = load_timeline(writer.path)
    assert [r["state"] for r in rows] == ["step", "wait_hidden"]
    assert rows[1]["t1"] - rows[1]["t0"] == pytest.approx(0.2, abs=1e-5)


def test_writer_rejects_unknown_state(tmp_path):
    writer = TimelineWriter(RunFiles(str(tmp_path)).timeline("target/0"), "target/0")
    with pytest.raises(ValueError, match="idle.*busy"):
        writer.record("idle", 0.0, 1.0)
    writer.close()


def test_load_skips_torn_line_and_orders_roles(tmp_path):
    folder = tmp_path / "metrics"
    folder.mkdir()
    row = json.dumps({"t0": 1.0, "t1": 2.0, "state": "busy"})
    for name in ("drafter-0", "target-10", "target-2"):
        (folder / f"{name}.jsonl").write_text(row + "\n")
    (folder / "target-2.jsonl").write_text(row + "\n" + '{"t0": 3.0, "t1"')  # killed mid-write
    timelines = load_timelines(str(tmp_path))
    assert list(timelines) == ["target/2", "target/10", "drafter/0"]
    assert len(timelines["target/2"]) == 1
    assert load_timelines(str(tmp_path / "missing")) == {}


def test_process_memory_reports_this_process_rss_and_no_gpu_on_cpu():
    import psutil

    from dflash_ipc.obs.timelines import process_memory
    got = process_memory("cpu")
    assert set(got) == {"rss_mib"}
    assert abs(got["rss_mib"] - psutil.Process().memory_info().rss / 2**20) < 64
