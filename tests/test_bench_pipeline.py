"""`dflash-ipc bench pipeline`: the steady-state tok_rate of a scripted timeline, the figures'
arithmetic, and the whole command on CPU with the embedded default's tiny target (1+1)."""

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from dflash_ipc.bench import pipeline as bp
from dflash_ipc.config.load import load_config
from dflash_ipc.errors import ConfigError
from dflash_ipc.obs.timelines import load_timelines

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
T0 = 1_700_000_000.0  # wall-clock seconds, as the timelines hold them


def _write(run_dir, role, rows):
    folder = run_dir / "metrics"
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / (role.replace("/", "-") + ".jsonl"), "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def _step(t0, t1, tokens):
    return {"t0": T0 + t0, "t1": T0 + t1, "state": "step", "loss": 1.0, "anchors": 8, "sequences": 2,
            "tokens": tokens}


@pytest.fixture
def scripted(tmp_path):
    """Two drafters and one target; the window is (T0+10, T0+20]."""
    _write(tmp_path, "drafter/0", [
        {"t0": T0 + 0, "t1": T0 + 8, "state": "wait_hidden"},
        _step(8, 10, 1000),        # ends at the window's start: before it, not counted
        _step(10, 12, 100),        # in
        _step(12, 15, 200),        # in
        {"t0": T0 + 15, "t1": T0 + 16, "state": "wait_hidden"},
        _step(16, 20, 300),        # ends exactly at the window's end: in
        _step(20, 23, 5000),       # after
    ])
    _write(tmp_path, "drafter/1", [
        _step(9, 11, 40),          # starts before, ends inside: in
        _step(11, 19, 60),         # in
        _step(19, 21, 7000),       # ends after: out
    ])
    _write(tmp_path, "target/0", [
        {"t0": T0 + 5, "t1": T0 + 12, "state": "busy", "tokens": 900, "batch": 1},   # in (ends at 12)
        {"t0": T0 + 12, "t1": T0 + 18, "state": "wait_work"},
        {"t0": T0 + 18, "t1": T0 + 22, "state": "busy", "tokens": 50, "batch": 2},   # out (ends at 22)
    ])
    return load_timelines(str(tmp_path))


def test_window_rates_of_a_scripted_timeline(scripted):
    r = bp.window_rates(scripted, T0 + 10, T0 + 20)
    assert r["window_s"] == 10
    assert r["tokens"] == 100 + 200 + 300 + 40 + 60 and r["steps"] == 5
    assert r["tok_rate"] == pytest.approx(70.0)
    assert r["per_drafter"]["drafter/0"] == {"tokens": 600, "steps": 3, "tok_rate": 60.0}
    assert r["per_drafter"]["drafter/1"] == {"tokens": 100, "steps": 2, "tok_rate": 10.0}
    assert r["tgt_rate"] == pytest.approx(90.0)
    # drafter/0 stepped 2+3+4 = 9 s of 10, drafter/1 1+8+1 = 10 s; target busy 2+2 = 4 s of 10
    assert r["drafter_busy_fraction"] == pytest.approx(0.95)
    assert r["target_busy_fraction"] == pytest.approx(0.4)


def test_window_rates_refuses_an_empty_window(scripted):
    with pytest.raises(bp.BenchError, match="empty measurement window"):
        bp.window_rates(scripted, T0 + 10, T0 + 10)


def test_combine_ratio_and_bottleneck():
    e2e = {"tok_rate": 900.0}
    f = bp.combine({"tok_per_s": 5000.0}, {"tok_per_s": 1000.0}, e2e)
    assert f["pipeline_capacity"] == 1000.0 and f["ratio"] == pytest.approx(0.9) and f["bottleneck"] == "drafter"
    f = bp.combine({"tok_per_s": 800.0}, {"tok_per_s": 1000.0}, e2e)
    assert f["ratio"] == pytest.approx(900 / 800) and f["bottleneck"] == "target"
    # capacities are per GPU: one target GPU against three drafter GPUs
    f = bp.combine({"tok_per_s": 2400.0}, {"tok_per_s": 1000.0}, {"tok_rate": 2280.0}, target_gpus=1,
                   drafter_gpus=3)
    assert f["pipeline_capacity"] == 2400.0 and f["bottleneck"] == "target" and f["ratio"] == pytest.approx(0.95)
    assert bp.gpus_of(["cuda:0"], 5) == 1 and bp.gpus_of(["cuda:1", "cuda:2"], 2) == 2


def test_timed_loop_counts_only_measured_calls():
    calls = []

    def one():
        calls.append(1)
        return 10
    f = bp.timed_loop(one, torch.device("cpu"), seconds=0.01, warmup_s=0.0, min_warmup=3)
    assert f["warmup_calls"] == 3 and f["calls"] >= 1 and len(calls) == 3 + f["calls"]
    assert f["tokens"] == 10 * f["calls"] and f["tok_per_s"] == pytest.approx(f["tokens"] / f["seconds"])


def test_cpu_worker_threads(monkeypatch):
    cfg = load_config(None, ["target.num_workers=1", "drafter.num_workers=2"])
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    assert bp.worker_threads(cfg, "target") == 4 and bp.worker_threads(cfg, "drafter") == 2
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setattr(os, "cpu_count", lambda: 6)
    assert bp.worker_threads(cfg, "target") == 2 and bp.worker_threads(cfg, "drafter") == 1
    gpu = load_config(None, ["target.devices=[cuda:0]", "drafter.devices=[cuda:1]"])
    assert bp.worker_threads(gpu, "target") is None


def test_end_to_end_needs_a_fresh_run_dir(tmp_path):
    (tmp_path / "old.txt").write_text("x")
    with pytest.raises(ConfigError, match="not empty"):
        bp.end_to_end(load_config(None), seconds=1, warmup_s=0, run_dir=str(tmp_path))
    with pytest.raises(ConfigError, match="--seconds"):
        bp.run_pipeline_bench(load_config(None), seconds=0, warmup_s=0)


SMALL = ["target.num_workers=1", "drafter.num_workers=1",
         "builtin.samples=120", "builtin.min_len=24", "builtin.max_len=200",
         "data.bucket_boundaries=[64,128,200]", "data.token_budget=800", "data.num_epochs=3",
         "model.num_layers=1", "model.target_layer_ids=[1,2]", "objective.anchors_per_step=64",
         "objective.max_anchors_per_seq=32", "checkpoint.every_steps=1000", "dispatch.status_interval_s=2"]


# Each phase's measured window: a drafter step takes ~0.1 s here (the bench's own figure), so
# 1 s still holds several steps and target batches.
BENCH_SECONDS = 1.0


@pytest.mark.slow
def test_bench_pipeline_on_cpu(tmp_path, tiny_cache):
    """The whole command, 1 target + 1 drafter on CPU: three phases, JSON, table, exit 0."""
    out = tmp_path / "bench.json"
    argv = [sys.executable, "-m", "dflash_ipc.cli", "bench", "pipeline", "--seconds", f"{BENCH_SECONDS:g}",
            "--warmup-s", "0.5",
            "--json", str(out), "--run-dir", str(tmp_path / "e2e"), "-o", f"run.run_dir={tmp_path / 'job'}"]
    for o in SMALL:
        argv += ["-o", o]
    env = dict(os.environ, DFLASH_IPC_CACHE=str(tiny_cache), PYTHONUNBUFFERED="1")
    proc = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "pipeline capacity" in proc.stdout and "ratio" in proc.stdout and "bottleneck" in proc.stdout

    f = json.loads(out.read_text())
    for key in ("target_capacity", "drafter_capacity", "tok_rate", "pipeline_capacity", "ratio"):
        assert isinstance(f[key], float) and math.isfinite(f[key]) and f[key] > 0, (key, f[key])
    assert f["ratio"] == pytest.approx(f["tok_rate"] / min(f["target_capacity"], f["drafter_capacity"]))
    assert f["bottleneck"] == ("target" if f["target_capacity"] < f["drafter_capacity"] else "drafter")
    assert f["target"]["device"] == "cpu" and f["target"]["batches"] >= 1 and f["target"]["tokens"] > 0
    assert f["drafter"]["steps"] >= 1 and f["drafter"]["tokens"] > 0 and f["drafter"]["warmup_steps"] >= 3
    e2e = f["e2e"]
    assert e2e["targets"] == 1 and e2e["drafters"] == 1 and e2e["steps"] >= 1
    assert e2e["window_s"] == pytest.approx(BENCH_SECONDS) or e2e["finished_early"]
    assert e2e["tok_rate"] == f["tok_rate"] == pytest.approx(e2e["tokens"] / e2e["window_s"])
    # the end-to-end job ran in its own run directory, not the config's
    assert os.path.isdir(tmp_path / "e2e" / "metrics") and not os.path.exists(tmp_path / "job")
