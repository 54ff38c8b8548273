"""`dflash-ipc plan`: every split, the best one, its config, and clear errors."""

import json
import subprocess
import sys

import pytest
from click.testing import CliRunner

from dflash_ipc.config import plan as pl
from dflash_ipc.cli import main
from dflash_ipc.config.load import load_config
from dflash_ipc.errors import ConfigError, DataError


def test_every_split_and_the_best():
    options = pl.splits(4, 40_000, 11_000)
    assert [(s.targets, s.drafters) for s in options] == [(1, 3), (2, 2), (3, 1)]
    assert [s.tok_rate for s in options] == [33_000, 22_000, 11_000]
    assert all(s.bottleneck == "drafter" for s in options)
    assert pl.best_split(options).targets == 1
    # balanced capacities: the middle split, neither side idle
    best = pl.best_split(pl.splits(6, 1000, 1000))
    assert (best.targets, best.tok_rate, best.bottleneck) == (3, 3000, "balanced")
    # drafters 6x faster: 7 targets + 1 drafter (6 + 2 predicts the same 6,000 with more idle)
    best = pl.best_split(pl.splits(8, 1000, 6000))
    assert (best.targets, best.drafters, best.tok_rate) == (7, 1, 6000)


def test_best_is_the_maximum_of_min():
    for n in range(2, 10):
        for t_cap, d_cap in ((1.0, 1.0), (3.0, 1.0), (1.0, 7.5), (40_000.0, 11_000.0)):
            best = pl.best_split(pl.splits(n, t_cap, d_cap))
            assert best.tok_rate == max(min(t * t_cap, (n - t) * d_cap) for t in range(1, n))


def test_ties_prefer_less_idle_capacity():
    # 3 GPUs, T=2, D=1: t=1 -> min(2, 2) = 2, t=2 -> min(4, 1) = 1; no tie. T=D=1 on 3 GPUs:
    # t=1 -> min(1, 2) = 1 and t=2 -> min(2, 1) = 1 tie with equal idle capacity: fewer targets
    assert pl.best_split(pl.splits(3, 1, 1)).targets == 1
    # 5 GPUs, T=3, D=1: t=1 -> min(3, 4) = 3 (1 idle), t=2 -> min(6, 3) = 3 (3 idle): t=1
    assert pl.best_split(pl.splits(5, 3, 1)).targets == 1


def test_config_lines_load_as_a_config():
    split = pl.best_split(pl.splits(8, 40_000, 11_000))  # min(80,000, 66,000) at 2 + 6
    lines = pl.config_lines(split)
    assert lines["target.devices"] == ["cuda:0", "cuda:1"] and lines["target.num_workers"] == 2
    assert lines["drafter.devices"] == [f"cuda:{i}" for i in range(2, 8)] and lines["drafter.num_workers"] == 6
    cfg = load_config(None, lines["overrides"])
    assert cfg.target.devices == ["cuda:0", "cuda:1"] and cfg.target.num_workers == 2
    assert cfg.drafter.devices == lines["drafter.devices"] and cfg.drafter.num_workers == 6


@pytest.mark.parametrize("gpus", [1, 0, -3])
def test_too_few_gpus(gpus):
    with pytest.raises(ConfigError, match="--gpus must be an integer >= 2"):
        pl.splits(gpus, 1000, 1000)


@pytest.mark.parametrize("bad", [0, -5.0, float("nan"), float("inf"), "100", True])
def test_non_positive_capacity(bad):
    with pytest.raises(ConfigError, match="target capacity must be a positive number"):
        pl.splits(4, bad, 1000)
    with pytest.raises(ConfigError, match="drafter capacity must be a positive number"):
        pl.splits(4, 1000, bad)


def _bench(tmp_path, data, raw=None):
    path = tmp_path / "bench.json"
    path.write_text(raw if raw is not None else json.dumps(data))
    return str(path)


def test_capacities_from_bench(tmp_path):
    path = _bench(tmp_path, {"target_capacity": 41_000.5, "drafter_capacity": 10_500, "tok_rate": 10_000})
    assert pl.capacities_from_bench(path) == (41_000.5, 10_500.0)


@pytest.mark.parametrize("data,raw,match", [
    (None, "{not json", "not valid JSON"),
    ([1, 2], None, "is not a JSON object"),
    ({"drafter_capacity": 5.0}, None, "field target_capacity is missing"),
    ({"target_capacity": 5.0}, None, "field drafter_capacity is missing"),
    ({"target_capacity": "fast", "drafter_capacity": 5.0}, None, "field target_capacity must be a positive"),
    ({"target_capacity": 5.0, "drafter_capacity": 0}, None, "field drafter_capacity must be a positive"),
    ({"target_capacity": 5.0, "drafter_capacity": None}, None, "field drafter_capacity must be a positive"),
])
def test_malformed_bench_names_file_and_field(tmp_path, data, raw, match):
    path = _bench(tmp_path, data, raw)
    with pytest.raises(DataError, match=match) as info:
        pl.capacities_from_bench(path)
    assert path in str(info.value)


def test_missing_bench_file(tmp_path):
    with pytest.raises(DataError, match="no such bench file"):
        pl.capacities_from_bench(str(tmp_path / "nope.json"))


def test_cli_table_and_json(tmp_path):
    runner = CliRunner()
    result = runner.invoke(main, ["plan", "--gpus", "4", "--target-capacity", "40000", "--drafter-capacity", "11000"])
    assert result.exit_code == 0, result.output
    out = result.output
    assert "33,000" in out and "<- best" in out and "devices: [cuda:1, cuda:2, cuda:3]" in out
    assert "-o 'drafter.devices=[cuda:1,cuda:2,cuda:3]'" in out
    assert sum("<- best" in line for line in out.splitlines()) == 1

    path = _bench(tmp_path, {"target_capacity": 40000.0, "drafter_capacity": 11000.0})
    result = runner.invoke(main, ["plan", "--gpus", "4", "--from-bench", path, "--json"])
    assert result.exit_code == 0, result.output
    plan = json.loads(result.output)
    assert plan["best"]["targets"] == 1 and plan["best"]["tok_rate"] == 33000.0
    assert [s["best"] for s in plan["splits"]] == [True, False, False]
    assert plan["config"]["drafter.num_workers"] == 3


def test_cli_argument_errors(tmp_path):
    runner = CliRunner()
    result = runner.invoke(main, ["plan", "--gpus", "4", "--target-capacity", "1000"])
    assert isinstance(result.exception, ConfigError) and "--drafter-capacity" in str(result.exception)
    path = _bench(tmp_path, {"target_capacity": 1.0, "drafter_capacity": 1.0})
    result = runner.invoke(main, ["plan", "--gpus", "4", "--from-bench", path, "--target-capacity", "5"])
    assert isinstance(result.exception, ConfigError) and "not both" in str(result.exception)


def test_cli_error_is_one_line_and_exit_2(tmp_path):
    path = _bench(tmp_path, {"target_capacity": 1.0})
    proc = subprocess.run([sys.executable, "-m", "dflash_ipc.cli", "plan", "--gpus", "2", "--from-bench", path],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"error: {path}: field drafter_capacity is missing (expected the output of " \
                                  "dflash-ipc bench pipeline --json)"


def test_two_gpu_target_workers_70b_on_8_gpus():
    """A 70B target needs 2 GPUs per worker: 3 workers (6 GPUs) + 2 drafters is the best of
    1..3 workers when one worker makes 10,000 tok/s and one drafter GPU trains 15,000."""
    options = pl.splits(8, 10_000, 15_000, gpus_per_target=2)
    assert [(s.targets, s.target_gpus, s.drafters) for s in options] == [(1, 2, 6), (2, 4, 4), (3, 6, 2)]
    assert [s.tok_rate for s in options] == [10_000, 20_000, 30_000]
    plan = pl.make_plan(8, 10_000, 15_000, gpus_per_target=2)
    assert (plan["best"]["targets"], plan["best"]["target_gpus"], plan["best"]["drafters"]) == (3, 6, 2)
    cfg = plan["config"]
    assert cfg["target.devices"] == [f"cuda:{i}" for i in range(6)] and cfg["drafter.devices"] == ["cuda:6", "cuda:7"]
    loaded = load_config(None, cfg["overrides"])  # the printed overrides are a valid job
    assert loaded.target.gpus_per_worker == 2 and loaded.target.devices_of(2) == ["cuda:4", "cuda:5"]
    text = pl.format_plan(plan)
    assert "per target worker of 2 GPUs: 10,000 tok/s" in text
    assert "best: 3 target workers x 2 GPUs (6 GPUs) + 2 drafter GPUs, 30,000 tok/s" in text
    assert "gpus_per_worker: 2" in text
    with pytest.raises(ConfigError, match="at least one target worker of 4 GPUs and one drafter GPU"):
        pl.splits(4, 1, 1, gpus_per_target=4)


def test_plan_takes_the_gpus_per_target_from_the_bench_file(tmp_path):
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"target_capacity": 10_000, "drafter_capacity": 15_000, "target_gpus_per_worker": 2}))
    result = CliRunner().invoke(main, ["plan", "--gpus", "8", "--from-bench", str(bench), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["config"]["target.gpus_per_worker"] == 2
