"""Tests of `dflash_ipc.bench.dispatch`: the metric arithmetic on a scripted timeline, the
workload models, and the real bench end to end at a tiny scale (real dispatcher process,
real sockets, both policies)."""

import multiprocessing as mp

import numpy as np
import pytest

from dflash_ipc.bench.dispatch import (CostModel, Interval, LengthModel, busy_s, ideal_s, makespan_s,
                                       parse_speeds, run_dispatch_bench, run_policy, summarize, tail_s,
                                       utilisation)
from dflash_ipc.dispatch.buckets import BucketSpec, plan_epoch
from dflash_ipc.errors import ConfigError, DataError, WorkerDeadError

# Three workers from t=0 to t=8:
#   w0 |00|000|...|      busy 0-2 and 2-5, then idle to 8 (tail 3)
#   w1 .|11|.|11|..      idle 0-1 (starved), busy 1-3, starved 3-4, busy 4-6, tail 2
#   w2 |22222222|        busy 0-8 (the last to finish, tail 0)
TIMELINE = [Interval(0, 0.0, 2.0, 10), Interval(1, 1.0, 3.0, 11), Interval(2, 0.0, 8.0, 12),
            Interval(0, 2.0, 5.0, 13), Interval(1, 4.0, 6.0, 14)]


def test_metrics_on_a_scripted_timeline():
    assert busy_s(TIMELINE, 3) == [5.0, 4.0, 8.0]
    assert makespan_s(TIMELINE) == 8.0
    assert makespan_s(TIMELINE, start=-1.0) == 9.0
    assert ideal_s(TIMELINE, 3) == pytest.approx(17 / 3)
    assert utilisation(TIMELINE, 3) == pytest.approx([5 / 8, 4 / 8, 1.0])
    assert tail_s(TIMELINE, 3) == [3.0, 2.0, 0.0]
    s = summarize(TIMELINE, 3, start=0.0)
    assert s["makespan_s"] == 8.0
    assert s["ideal_s"] == pytest.approx(17 / 3)
    assert s["ratio"] == pytest.approx(17 / 24)
    assert s["starved_s"] == pytest.approx([0.0, 2.0, 0.0])
    assert s["batches"] == [2, 2, 1]
    for busy, starved, tail in zip(s["busy_s"], s["starved_s"], s["tail_s"]):
        assert busy + starved + tail == pytest.approx(s["makespan_s"])


def test_metrics_with_speeds_an_idle_worker_and_an_earlier_start():
    # w2 at half speed did 8 s * 0.5 = 4 units of work: ideal = (5 + 4 + 4) / 2.5.
    assert ideal_s(TIMELINE, 3, speeds=[1, 1, 0.5]) == pytest.approx(13 / 2.5)
    # A fourth worker that never worked: all of its time is tail; plain tuples work too.
    plain = [tuple(iv[:3]) for iv in TIMELINE]
    s = summarize(plain, 4, start=-2.0)
    assert s["makespan_s"] == 10.0
    assert s["ideal_s"] == pytest.approx(17 / 4)
    assert s["ratio"] == pytest.approx(17 / 40)
    assert s["utilisation"] == pytest.approx([0.5, 0.4, 0.8, 0.0])
    assert s["tail_s"] == pytest.approx([3.0, 2.0, 0.0, 10.0])
    assert s["starved_s"] == pytest.approx([2.0, 4.0, 2.0, 0.0])
    assert s["batches"] == [2, 2, 1, 0]
    empty = summarize([], 2)
    assert (empty["makespan_s"], empty["ratio"], empty["busy_s"]) == (0.0, 0.0, [0.0, 0.0])


def test_metrics_reject_bad_intervals_and_speeds():
    with pytest.raises(DataError, match="interval 1: end 1.0 < start 2.0"):
        busy_s([(0, 0.0, 1.0), (0, 2.0, 1.0)], 1)
    with pytest.raises(DataError, match=r"worker 3 outside \[0, 3\)"):
        busy_s([(3, 0.0, 1.0)], 3)
    with pytest.raises(ConfigError, match="need 3 values > 0"):
        ideal_s(TIMELINE, 3, speeds=[1, 1])
    with pytest.raises(ConfigError, match="need 3 values > 0"):
        ideal_s(TIMELINE, 3, speeds=[1, 1, 0])


def test_cost_model_is_calibrated_and_quadratic():
    cost = CostModel(tokens_per_s=30_000, ref_len=2048, attn_crossover_len=8192)
    assert cost.batch_s(1, 2048) == pytest.approx(2048 / 30_000)  # the calibration point
    # Same 16384 padded tokens: 2 x 8192 pays (1 + 1) per token, 8 x 2048 pays (1 + 1/4).
    assert cost.batch_s(2, 8192) / cost.batch_s(8, 2048) == pytest.approx(2 / 1.25)
    assert cost.batch_s(4, 1024) == pytest.approx(2 * cost.batch_s(2, 1024))
    with pytest.raises(ConfigError, match="CostModel"):
        CostModel(tokens_per_s=0)


def test_length_model_is_seeded_and_clipped():
    model = LengthModel(median=1024, sigma=0.9, min_len=64, max_len=8192)
    a, b = model.sample(20000, seed=3), model.sample(20000, seed=3)
    assert np.array_equal(a, b) and not np.array_equal(a, model.sample(20000, seed=4))
    assert a.dtype == np.int64 and a.min() == 64 and a.max() == 8192
    assert 0.95 * 1024 < np.median(a) < 1.05 * 1024
    with pytest.raises(ConfigError, match="min_len <= max_len"):
        LengthModel(min_len=10, max_len=5)


def test_bench_end_to_end_both_policies_with_a_slow_target():
    lines = []
    speeds = (1.0, 1.0, 1.0, 1.0, 0.5)
    out = run_dispatch_bench(num_samples=400, time_scale=0.05, target_speeds=speeds, seed=1,
                             print_fn=lines.append, timeout_s=60)
    num_batches = out["plan"]["num_batches"]
    assert num_batches >= 20
    for policy in ("pull", "round_robin"):
        r = out["policies"][policy]
        ids = sorted(iv[3] for iv in r["intervals"])
        assert ids == list(range(num_batches))  # every batch produced exactly once
        assert r["dispatcher"]["batches"]["committed"] == num_batches
        assert r["dispatcher"]["refusals"] == 0
        assert sum(r["batches"]) == num_batches
        for w in range(5):  # one device: a worker's batches never overlap
            mine = sorted((s, e) for worker, s, e, _ in r["intervals"] if worker == w)
            assert all(e0 <= s1 + 1e-9 for (_, e0), (s1, _) in zip(mine, mine[1:]))
        assert 0 < r["ratio"] <= 1.0 + 1e-6
    pull, rr = out["policies"]["pull"], out["policies"]["round_robin"]
    assert pull["ratio"] >= rr["ratio"]
    # Round-robin strands a fifth of the work on the half-speed target: it alone stays busy.
    assert max(range(5), key=lambda w: rr["utilisation"][w]) == 4
    assert pull["batches"][4] < min(pull["batches"][:4])  # pull gives it less
    assert any(line.startswith("pull") for line in lines) and any(line.startswith("round_robin") for line in lines)
    assert not mp.active_children()


def test_bench_stops_its_dispatcher_on_timeout():
    lengths = np.full(40, 1000, dtype=np.int64)
    batches = plan_epoch(lengths, BucketSpec(boundaries=(1024,), token_budget=2048), seed=0, epoch=0)
    with pytest.raises(WorkerDeadError, match="did not finish within"):
        run_policy("pull", batches, lengths, num_targets=1, num_drafters=1, speeds=[1.0],
                   cost=CostModel(), time_scale=10.0, timeout_s=1.0)
    assert not mp.active_children()


def test_bench_rejects_bad_arguments():
    with pytest.raises(ConfigError, match="policy 'push' not allowed; allowed: pull, round_robin"):
        run_dispatch_bench(policies=("push",), print_fn=lambda line: None)
    with pytest.raises(ConfigError, match="need 5 values > 0"):
        run_dispatch_bench(target_speeds=(1, 1), print_fn=lambda line: None)
    with pytest.raises(ConfigError, match="'1,x' is not a comma-separated list"):
        parse_speeds("1,x")
    assert parse_speeds("1,1,0.5") == [1.0, 1.0, 0.5]
