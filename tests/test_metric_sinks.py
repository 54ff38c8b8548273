"""TensorBoardSink: scalars from scripted status dicts, read back from the event files."""

import logging
import os
import sys

import pytest

from dflash_ipc.run_files import RunFiles
from dflash_ipc.metric_sinks import TensorBoardSink


def _status(elapsed, targets=None, drafters=None, committed=0):
    return {
        "elapsed_s": elapsed, "num_batches": 20,
        "batches": {"pending": 20 - committed, "leased": 0, "produced": 0, "consumed": 0, "committed": committed},
        "epochs": [{"epoch": 0, "batches": 10, "committed": min(committed, 10)},
                   {"epoch": 1, "batches": 10, "committed": max(0, committed - 10)}],
        "tokens": {"produced": 100 * committed, "consumed": 100 * committed, "trained": 100 * committed,
                   "committed": 100 * committed},
        "rates": {"tgt_rate": 10.0 * elapsed, "dft_rate": 9.0 * elapsed, "tok_rate": 8.0 * elapsed},
        "produced_waiting": committed % 3,
        "targets": targets or {}, "drafters": drafters or {},
        "refusals": 0, "dropped_targets": {}, "finished": False,
    }


def _target(pid, **metrics):
    return {"pid": pid, "credits": 2, "free_slots": 3, "batches": 0, "tokens": 0, "compute_s": 0.0,
            "metrics": metrics, "heartbeat_age_s": 0.5}


def _drafter(**metrics):
    return {"credits": 1, "batches": 0, "tokens": 0, "metrics": metrics, "heartbeat_age_s": 0.25}


SCRIPT = [
    # t=10: target 0 has reported once, target 1 registered without metrics, drafter 0 without a step
    _status(10.0, targets={"0": _target(100, busy_s=1.0, wait_s=1.0, tokens=100, rss_mib=500.0,
                                        gpu_mem_allocated_mib=1000.0, gpu_mem_reserved_mib=1200.0),
                           "1": _target(200)},
            drafters={"0": _drafter()}),
    # t=15: target 0 busy 3 s of 4 s, 600 tokens; drafter 0 at step 3
    _status(15.0, committed=4,
            targets={"0": _target(100, busy_s=4.0, wait_s=2.0, tokens=700, rss_mib=510.0), "1": _target(200)},
            drafters={"0": _drafter(step=3, loss=2.5, lr=1e-4, grad_norm=0.5, anchors=64, time=1000.0,
                                    wait_s=1.0, trained_tokens=300, rank=0, rss_mib=800.0)}),
    # t=20: target 0 restarted (new pid, counters from 0): no fraction; target 1 reports first;
    #       drafter 0 waited 1 s of 4 s and trained 400 tokens
    _status(20.0, committed=12,
            targets={"0": _target(101, busy_s=1.0, wait_s=0.0, tokens=50), "1": _target(200, busy_s=2.0, wait_s=2.0,
                                                                                          tokens=10)},
            drafters={"0": _drafter(step=5, loss=2.0, lr=2e-4, grad_norm=0.25, anchors=32, time=1004.0,
                                    wait_s=2.0, trained_tokens=700, rank=0)}),
    # t=25: target 0 busy 2 s of 4 s; target 1 no heartbeat since (no fraction); drafters gone: step kept
    _status(25.0, committed=13,
            targets={"0": _target(101, busy_s=3.0, wait_s=2.0, tokens=250), "1": _target(200, busy_s=2.0, wait_s=2.0,
                                                                                          tokens=10)}),
]


@pytest.fixture
def events(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    sink = TensorBoardSink.open(RunFiles(str(tmp_path)).tensorboard)
    assert sink is not None and sink.log_dir == os.path.join(str(tmp_path), "tensorboard")
    for status in SCRIPT:
        sink.write(status)
    sink.close()
    acc = EventAccumulator(sink.log_dir, size_guidance={"scalars": 0})
    acc.Reload()

    def read(tag):
        return [(e.step, pytest.approx(e.value)) for e in acc.Scalars(tag)]

    read.tags = set(acc.Tags()["scalars"])
    read.wall = lambda tag: [e.wall_time for e in acc.Scalars(tag)]
    return read


def test_target_busy_fraction_and_rate_from_deltas(events):
    # steps: 0 (no drafter step yet), 3, 5, 5 (drafters gone: the last step is kept)
    assert events("target/0/busy_fraction") == [(3, 0.75), (5, 0.5)]
    assert events("target/0/tokens_per_s") == [(3, 150.0), (5, 50.0)]
    assert "target/1/busy_fraction" not in events.tags  # target 1: one sample of counters only
    assert events("target/0/free_slots") == [(0, 3.0), (3, 3.0), (5, 3.0), (5, 3.0)]


def test_memory_per_process_when_reported(events):
    assert events("target/0/rss_mib") == [(0, 500.0), (3, 510.0)]
    assert events("target/0/gpu_mem_allocated_mib") == [(0, 1000.0)]
    assert events("target/0/gpu_mem_reserved_mib") == [(0, 1200.0)]
    assert events("drafter/0/rss_mib") == [(3, 800.0)]
    assert "target/1/rss_mib" not in events.tags


def test_drafter_metrics_and_rates(events):
    assert events("drafter/0/loss") == [(3, 2.5), (5, 2.0)]
    assert events("drafter/0/lr") == [(3, 1e-4), (5, 2e-4)]
    assert events("drafter/0/grad_norm") == [(3, 0.5), (5, 0.25)]
    assert events("drafter/0/anchors") == [(3, 64.0), (5, 32.0)]
    assert events("drafter/0/wait_fraction") == [(5, 0.25)]
    assert events("drafter/0/tokens_per_s") == [(5, 100.0)]
    assert events("train/loss") == [(3, 2.5), (5, 2.0)]
    assert "drafter/0/rank" not in events.tags and "drafter/0/time" not in events.tags


def test_job_scalars_and_wall_time(events):
    assert events("rates/tok_rate") == [(0, 80.0), (3, 120.0), (5, 160.0), (5, 200.0)]
    assert events("batches/committed") == [(0, 0.0), (3, 4.0), (5, 12.0), (5, 13.0)]
    assert events("batches/pending") == [(0, 20.0), (3, 16.0), (5, 8.0), (5, 7.0)]
    assert events("progress/committed_fraction") == [(0, 0.0), (3, 0.2), (5, 0.6), (5, 0.65)]
    assert events("progress/epoch") == [(0, 1.0), (3, 1.0), (5, 2.0), (5, 2.0)]
    assert events("queue/produced_waiting") == [(0, 0.0), (3, 1.0), (5, 0.0), (5, 1.0)]
    assert events("tokens/trained") == [(0, 0.0), (3, 400.0), (5, 1200.0), (5, 1300.0)]
    assert events("health/targets") == [(0, 2.0), (3, 2.0), (5, 2.0), (5, 2.0)]
    wall = events.wall("rates/tok_rate")
    assert [b - a for a, b in zip(wall, wall[1:])] == [pytest.approx(5.0, abs=1e-3)] * 3


def test_missing_keys_are_skipped(tmp_path):
    pytest.importorskip("tensorboard")
    sink = TensorBoardSink.open(RunFiles(str(tmp_path)).tensorboard)
    sink.write({})
    sink.write({"elapsed_s": 1.0, "targets": {"0": {"pid": 1}}, "drafters": {"0": {}},
                "batches": {"committed": 0}, "num_batches": 0, "epochs": []})
    sink.write({"elapsed_s": 2.0, "drafters": {"0": {"metrics": {"step": float("nan"), "loss": "n/a"}}}})
    sink.close()
    assert sink.writes == 3
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(sink.log_dir))


def test_open_without_tensorboard_returns_none(tmp_path, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # `import tensorboard` raises ImportError
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with caplog.at_level(logging.INFO, logger="dflash_ipc.metric_sinks"):
        assert TensorBoardSink.open(RunFiles(str(tmp_path)).tensorboard) is None
    assert [r.levelno for r in caplog.records] == [logging.INFO]
    assert "pip install tensorboard" in caplog.records[0].getMessage()
    assert not os.path.exists(tmp_path / "tensorboard")
