"""TensorBoardSink: scalars from scripted statuses, read back from the event files."""

import json
import logging
import os
import sys

import pytest

from dflash_ipc.run.files import RunFiles
from dflash_ipc.obs.sinks import TensorBoardSink
from dflash_ipc.wire.status import JobStatus


def _status(elapsed, targets=None, drafters=None, committed=0):
    return JobStatus.from_json({
        "elapsed_s": elapsed, "policy": "pull", "num_batches": 20,
        "batches": {"pending": 20 - committed, "leased": 0, "produced": 0, "consumed": 0, "committed": committed,
                    "assigned": 0},
        "epochs": [{"epoch": 0, "batches": 10, "committed": min(committed, 10)},
                   {"epoch": 1, "batches": 10, "committed": max(0, committed - 10)}],
        "tokens": {"total": 2000, "produced": 100 * committed, "consumed": 100 * committed,
                   "trained": 100 * committed, "committed": 100 * committed},
        "committed_tokens_by_epoch": {}, "last_committed_step": None,
        "rates": {"tgt_rate": 10.0 * elapsed, "dft_rate": 9.0 * elapsed, "tok_rate": 8.0 * elapsed},
        "produced_waiting": committed % 3,
        "targets": targets or {}, "drafters": drafters or {},
        "refusals": 0, "instance": "i", "drafter_generation": 0, "dropped_targets": {}, "finished": False,
    }, "test")


def _target(pid, **metrics):
    return {"pid": pid, "credits": 2, "free_slots": 3, "batches": 0, "tokens": 0, "compute_s": 0.0,
            "metrics": metrics, "heartbeat_age_s": 0.5}


def _drafter(**metrics):
    return {"pid": 300, "credits": 1, "batches": 0, "tokens": 0, "metrics": metrics, "heartbeat_age_s": 0.25}


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
    # train/* come per optimizer step from the drafter's step records, never per poll
    assert not any(tag.startswith("train/") for tag in events.tags)
    assert "drafter/0/rank" not in events.tags and "drafter/0/time" not in events.tags


def test_job_scalars_and_wall_time(events):
    assert events("rates/tok_rate") == [(0, 80.0), (3, 120.0), (5, 160.0), (5, 200.0)]
    assert events("batches/committed") == [(0, 0.0), (3, 4.0), (5, 12.0), (5, 13.0)]
    assert events("batches/pending") == [(0, 20.0), (3, 16.0), (5, 8.0), (5, 7.0)]
    assert events("progress/committed_fraction") == [(0, 0.0), (3, 0.2), (5, 0.6), (5, 0.65)]
    assert events("progress/trained_fraction") == [(0, 0.0), (3, 0.2), (5, 0.6), (5, 0.65)]  # 100 x committed / 2000
    assert events("progress/epoch") == [(0, 1.0), (3, 1.0), (5, 2.0), (5, 2.0)]
    assert events("queue/produced_waiting") == [(0, 0.0), (3, 1.0), (5, 0.0), (5, 1.0)]
    assert events("tokens/trained") == [(0, 0.0), (3, 400.0), (5, 1200.0), (5, 1300.0)]
    assert events("health/targets") == [(0, 2.0), (3, 2.0), (5, 2.0), (5, 2.0)]
    wall = events.wall("rates/tok_rate")
    assert [b - a for a, b in zip(wall, wall[1:])] == [pytest.approx(5.0, abs=1e-3)] * 3


def test_sparse_statuses_are_written(tmp_path):
    """No plan yet, workers without heartbeats, a drafter whose step is not finite or absent."""
    pytest.importorskip("tensorboard")
    sink = TensorBoardSink.open(RunFiles(str(tmp_path)).tensorboard)
    empty = _status(0.0)
    empty.num_batches, empty.epochs = 0, []
    sink.write(empty)
    sink.write(_status(1.0, targets={"0": _target(1)}, drafters={"0": _drafter()}))
    odd = _status(2.0, drafters={"0": _drafter(loss=None)})
    odd.drafters["0"].metrics["step"] = float("nan")  # in process: the wire holds no NaN
    sink.write(odd)
    sink.close()
    assert sink.writes == 3
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(sink.log_dir))


def test_open_without_tensorboard_returns_none(tmp_path, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # `import tensorboard` raises ImportError
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with caplog.at_level(logging.INFO, logger="dflash_ipc.obs.sinks"):
        assert TensorBoardSink.open(RunFiles(str(tmp_path)).tensorboard) is None
    assert [r.levelno for r in caplog.records] == [logging.INFO]
    assert "pip install tensorboard" in caplog.records[0].getMessage()
    assert not os.path.exists(tmp_path / "tensorboard")


# ---- Weights & Biases (offline), the status history, the sinks of a job ------------------------

def _job(tmp_path, *overrides):
    from dflash_ipc.config.load import load_config
    return load_config(None, [f"run.run_dir={tmp_path / 'run'}", *overrides])


@pytest.fixture
def wandb_offline(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    from cpu_run import wandb_env
    for key, value in wandb_env(tmp_path / "wandb-home").items():
        monkeypatch.setenv(key, value)


def test_wandb_offline_run_holds_the_status_scalars_and_a_resumed_job_appends(tmp_path, wandb_offline):
    from dflash_ipc.obs.wandb_sink import WandbSink, read_run_state
    from wandb_offline import offline_runs
    cfg = _job(tmp_path, "metrics.sinks=[wandb]", "metrics.wandb_mode=offline", "metrics.wandb_project=p",
               "metrics.wandb_run_name=first", "metrics.wandb_tags=[a,b]")
    sink = WandbSink.open(cfg)
    for status in SCRIPT[:3]:
        sink.write(status)
    sink.close()
    state = read_run_state(cfg.files.wandb_run)
    assert state["next_step"] == 3
    # the job runs again in the same run directory (its supervisor restarted): the same run
    again = WandbSink.open(cfg)
    assert again.run.id == state["id"] and again.next_step == 3
    again.write(SCRIPT[3])
    again.close()
    import wandb
    wandb.teardown()  # the W&B service writes the offline file behind finish(); its exit flushes it
    first, second = offline_runs(cfg.files.wandb)
    assert first["id"] == second["id"] == state["id"]
    assert (first["project"], first["name"], first["tags"]) == ("p", "first", ["a", "b"])
    assert first["config"]["optimizer"]["lr"] == cfg.optimizer.lr  # the job's config
    assert [r["_step"] for r in first["history"]] == [0, 1, 2] and [r["_step"] for r in second["history"]] == [3]
    rows = first["history"] + second["history"]
    assert [r["rates/tok_rate"] for r in rows] == [80.0, 120.0, 160.0, 200.0]
    # train/step where drafters report one; W&B itself fills it into a row of drafter/* charts
    # (step_sync: the first row, a drafter without a step yet), not into one without drafters
    assert [r.get("train/step") for r in rows] == [0, 3, 5, None]
    # rates from counter differences: none on a sink's first status (the resumed one's too)
    assert [r.get("target/0/busy_fraction") for r in rows] == [None, 0.75, None, None]
    assert rows[1]["drafter/0/loss"] == 2.5 and rows[1]["target/0/rss_mib"] == 510.0
    assert read_run_state(cfg.files.wandb_run) == {"id": state["id"], "next_step": 4}


def test_wandb_missing_or_a_bad_run_record_is_a_clear_error(tmp_path, monkeypatch):
    from dflash_ipc.errors import ConfigError, MissingExtraError
    from dflash_ipc.obs.job_sinks import open_sinks
    from dflash_ipc.obs.wandb_sink import WandbSink
    cfg = _job(tmp_path, "metrics.sinks=[tensorboard,wandb]")
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(MissingExtraError, match=r"pip install 'dflash-ipc\[wandb\]'"):
        open_sinks(cfg)
    os.makedirs(cfg.run.run_dir, exist_ok=True)
    with open(cfg.files.wandb_run, "w") as f:
        f.write('{"id": "../x", "next_step": 2}')
    monkeypatch.setitem(sys.modules, "wandb", object())  # the record is read before wandb is used
    with pytest.raises(ConfigError, match=r"wandb_run.json: expected .*delete it"):
        WandbSink.open(cfg)


def test_default_sinks_and_the_status_history(tmp_path):
    from dflash_ipc.obs.job_sinks import open_sinks
    from dflash_ipc.obs.status_history import StatusHistorySink, load_status_history
    cfg = _job(tmp_path)
    sinks = open_sinks(cfg)
    kinds = [type(s).__name__ for s in sinks.sinks]
    assert kinds[0] == "StatusHistorySink" and kinds[1:] in (["TensorBoardSink"], [])  # tensorboard if installed
    for status in SCRIPT:
        sinks.write(status)
    sinks.close()
    rows = load_status_history(cfg.files.status_history)
    assert [r["elapsed_s"] for r in rows] == [10.0, 15.0, 20.0, 25.0]
    assert rows[0]["workers"] == {"target/0": {"pid": 100, "rss_mib": 500.0, "gpu_mem_allocated_mib": 1000.0,
                                               "gpu_mem_reserved_mib": 1200.0}}
    assert rows[1]["workers"]["drafter/0"] == {"pid": 300, "rss_mib": 800.0}
    assert rows[2]["rates"] == SCRIPT[2].to_json()["rates"] and rows[2]["batches"]["committed"] == 12
    # a resumed job appends; a torn last line (a killed supervisor) is skipped
    StatusHistorySink(cfg.files.status_history).close()
    with open(cfg.files.status_history, "a") as f:
        f.write('{"time": 1.0, "work')
    assert len(load_status_history(cfg.files.status_history)) == 4


def test_a_failing_sink_is_dropped_with_one_warning(caplog):
    from dflash_ipc.obs.sinks import MetricSinks

    class Broken:
        closed = False

        def write(self, status):
            raise OSError("disk full")

        def close(self):
            self.closed = True

    class Counting:
        writes = 0

        def write(self, status):
            self.writes += 1

        def close(self):
            pass
    broken, counting = Broken(), Counting()
    sinks = MetricSinks([broken, counting])
    with caplog.at_level(logging.WARNING, logger="dflash_ipc.obs.sinks"):
        sinks.write({})
        sinks.write({})
    assert counting.writes == 2 and broken.closed and sinks.sinks == [counting]
    assert [r.getMessage() for r in caplog.records] == ["Broken off: a write failed: disk full"]


@pytest.mark.slow
def test_a_real_job_writes_its_wandb_run(cpu_run):
    """The supervisor of a real CPU job (metrics.sinks: [tensorboard, wandb], offline): one
    history row per status poll plus the final status, ending where the job ended."""
    import json

    from wandb_offline import offline_runs
    (run,) = offline_runs(os.path.join(cpu_run.run_dir, "wandb"))
    assert (run["project"], run["tags"]) == ("cpu-run", ["test", "cpu"])
    history = run["history"]
    assert [r["_step"] for r in history] == list(range(len(history))) and len(history) >= 3
    final = json.loads(open(os.path.join(cpu_run.run_dir, "final_status.json")).read())
    last = history[-1]
    assert last["batches/committed"] == final["num_batches"] and last["progress/committed_fraction"] == 1.0
    assert last["train/step"] == final["drafters"]["0"]["metrics"]["step"]
    assert max(r.get("rates/tok_rate", 0) for r in history) > 0
    assert any("train/loss" in r for r in history) and "target/1/rss_mib" in last
    with open(os.path.join(cpu_run.run_dir, "wandb_run.json")) as f:
        assert json.load(f) == {"id": run["id"], "next_step": len(history)}


def test_tracker_scalars_per_optimizer_step_from_the_drafters_step_records(tmp_path):
    """The supervisor's tail of drafter_metrics.jsonl: the steps since the last poll, each at
    its own step, validation at the step it scores; a line still being written waits."""
    from dflash_ipc.obs.sinks import MetricSinks
    from dflash_ipc.obs.step_log import StepLogTail

    path = tmp_path / "drafter_metrics.jsonl"
    path.write_text(json.dumps({"step": 1, "loss": 9.0, "time": 1.0}) + "\n")  # a previous supervisor's
    tail = StepLogTail(str(path))
    records = [{"step": s, "loss": 5.0 - s, "lr": 1e-4 * s, "grad_norm": 0.5, "time": 100.0 + s} for s in (2, 3, 4)]
    records[1].update(validated_step=2, acceptance_length=2.5, acceptance_blocks=96, acceptance_at=[0.75, 0.5])
    with open(path, "a") as f:
        f.write("".join(json.dumps(r) + "\n" for r in records) + "not json\n" + '{"step": 5, "loss"')
    writer = RecordingWriter()
    sink = TensorBoardSink(writer, str(tmp_path))
    sinks = MetricSinks([sink])
    sinks.write_steps(tail.read())
    assert writer.points("train/loss") == [(2, 3.0, 102.0), (3, 2.0, 103.0), (4, 1.0, 104.0)]
    assert writer.points("validation/acceptance_length") == [(2, 2.5, 103.0)]
    assert writer.points("validation/acceptance_at_2") == [(2, 0.5, 103.0)]
    assert writer.points("validation/acceptance_blocks") == [(2, 96.0, 103.0)]
    assert tail.read() == []  # nothing new; the partial line waits
    with open(path, "a") as f:
        f.write(': 0.5, "time": 105.0}\n')
    assert tail.read() == [{"step": 5, "loss": 0.5, "time": 105.0}]


class RecordingWriter:
    def __init__(self):
        self.calls = []

    def add_scalar(self, tag, value, global_step, walltime):
        self.calls.append((tag, global_step, value, walltime))

    def points(self, tag):
        return [(s, v, w) for t, s, v, w in self.calls if t == tag]


def test_wandb_rows_per_optimizer_step_carry_the_step_they_belong_to(tmp_path):
    from dflash_ipc.obs.wandb_sink import WandbSink, read_run_state

    class FakeRun:
        id = "abc123"
        rows = []

        def log(self, row, step):
            self.rows.append((step, row))

    run = FakeRun()
    sink = WandbSink(run, str(tmp_path / "wandb_run.json"), next_step=7)
    sink.write_step({"step": 3, "loss": 1.5, "validated_step": 2, "acceptance_length": 2.25})
    assert run.rows == [(7, {"train/loss": 1.5, "train/step": 3}),
                        (8, {"validation/acceptance_length": 2.25, "train/step": 2})]
    assert read_run_state(str(tmp_path / "wandb_run.json")) == {"id": "abc123", "next_step": 9}


def test_a_step_log_line_over_the_bound_is_skipped_not_stalled_on(tmp_path, monkeypatch):
    from dflash_ipc.obs import step_log

    monkeypatch.setattr(step_log, "MAX_READ_BYTES", 1000)
    monkeypatch.setattr(step_log, "MAX_LINE_BYTES", 100)
    path = tmp_path / "drafter_metrics.jsonl"
    path.write_bytes(b"")
    tail = step_log.StepLogTail(str(path))
    with open(path, "ab") as f:
        f.write(b"x" * 2500 + b"\n" + json.dumps({"step": 7, "loss": 1.0}).encode() + b"\n")
    reads = [tail.read() for _ in range(5)]
    assert [r for rs in reads for r in rs] == [{"step": 7, "loss": 1.0}] and tail.skipped == 1
    assert tail.offset == path.stat().st_size


def test_a_fifo_at_the_step_log_is_not_opened(tmp_path, caplog):
    from dflash_ipc.obs.step_log import StepLogTail

    path = tmp_path / "drafter_metrics.jsonl"
    os.mkfifo(path)
    tail = StepLogTail(str(path), from_end=False)
    with caplog.at_level(logging.WARNING, logger="dflash_ipc.obs.step_log"):
        assert tail.read() == [] and tail.read() == []  # would block in open() before
    assert len(caplog.records) == 1 and "FIFO" in caplog.records[0].getMessage()


@pytest.mark.parametrize("bad", [
    {"step": int(1e300), "loss": 1.0}, {"step": -1, "loss": 1.0}, {"step": 3.5, "loss": 1.0},
    {"step": True, "loss": 1.0}, {"step": "3", "loss": 1.0}, {"step": 3, "loss": float("nan")},
    {"step": 3, "validated_step": 2, "acceptance_at": [0.5] * 100_000},
    {"step": 3, "validated_step": 2 ** 70, "acceptance_length": 2.0},
])
def test_a_bad_step_record_is_skipped_with_one_warning_and_the_sink_stays_on(tmp_path, bad, caplog):
    from dflash_ipc.obs.sinks import MetricSinks
    from dflash_ipc.obs.step_log import StepLogTail

    path = tmp_path / "drafter_metrics.jsonl"
    path.write_text("")
    tail = StepLogTail(str(path))
    with open(path, "a") as f:
        f.write(json.dumps(bad) + "\n" + json.dumps(bad) + "\n" + json.dumps({"step": 4, "loss": 2.0}) + "\n")
    writer = RecordingWriter()
    sinks = MetricSinks([TensorBoardSink(writer, str(tmp_path))])
    with caplog.at_level(logging.WARNING):
        sinks.write_steps(tail.read())
    assert writer.points("train/loss") == [(4, 2.0, None)] and len(sinks.sinks) == 1
    assert tail.skipped == 2 and len(caplog.records) == 1


def test_a_step_record_a_sink_refuses_is_skipped_and_the_sink_stays_on(caplog):
    from dflash_ipc.obs.sinks import MetricSinks

    class Picky:
        def __init__(self):
            self.steps = []

        def write_step(self, record):
            if record["step"] == 2:
                raise ValueError("no")
            self.steps.append(record["step"])

        def close(self):
            pass
    picky = Picky()
    sinks = MetricSinks([picky])
    with caplog.at_level(logging.WARNING, logger="dflash_ipc.obs.sinks"):
        sinks.write_steps([{"step": 1}, {"step": 2}, {"step": 3}])
        sinks.write_steps([{"step": 2}, {"step": 4}])
    assert picky.steps == [1, 3, 4] and sinks.sinks == [picky] and sinks.skipped_steps == 2
    assert len(caplog.records) == 1
