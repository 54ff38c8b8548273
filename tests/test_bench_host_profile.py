"""bench/host_profile.py: the host's time per step by function, and the garbage collector's share."""

import gc
import sys

import pytest

from dflash_ipc.bench import drafter as bd
from dflash_ipc.bench.host_profile import format_host_profile, profile_host


def _busy(n: int) -> int:
    return sum(i * i for i in range(n))


def test_the_costliest_function_and_the_collectors_passes_are_counted():
    def step():
        _busy(200_000)
        gc.collect()  # one full pass a step, as a collect inside a library would make

    summary = profile_host(step, steps=3, top=5)
    assert summary["steps"] == 3 and summary["wall_ms"] > 0
    wheres = [where for where, *_ in summary["functions"]]
    assert any("_busy" in w or "<genexpr>" in w for w in wheres[:3]), wheres
    assert summary["gc_passes"][2] >= 1  # per step
    assert 0 < summary["gc_ms"] < summary["wall_ms"]
    text = format_host_profile(summary, label="bf16")
    assert text.startswith("host time per step (bf16, 3 steps under cProfile): ")
    assert "garbage collector" in text and "gen2" in text and len(text.splitlines()) == 2 + 5
    with pytest.raises(ValueError, match="steps=0"):
        profile_host(step, steps=0)
    assert all(cb.__name__ != "clock" for cb in gc.callbacks)  # the clock is removed after


def test_bench_drafter_prints_the_host_profile_on_cpu(capsys):
    f = bd.run_drafter_bench("cpu", steps=1, shape="tiny", anchors_per_seq=16, num_seqs=2, seq_len=128, warmup=1,
                             host_profile_steps=2, gc_freeze=True)
    profile = f["host_profile"]
    assert profile["steps"] == 2 and profile["wall_ms"] > 0 and profile["functions"]
    out = capsys.readouterr().out
    assert "host time per step (bf16, 2 steps under cProfile)" in out
    # --gc-freeze: the heap frozen after the warm-up step, unfrozen before the bench returns
    assert f["gc_frozen"]["objects"] > 10_000 and f["gc_frozen"]["collect_ms"] > 0
    assert "heap frozen after the warm-up steps" in out and gc.get_freeze_count() == 0


def test_a_step_that_raises_leaves_no_hook_behind():
    def step():
        raise RuntimeError("a failed step")

    with pytest.raises(RuntimeError, match="a failed step"):
        profile_host(step, steps=2)
    assert sys.getprofile() is None
    assert all(cb.__name__ != "clock" for cb in gc.callbacks)
    profile_host(lambda: None, steps=1)  # a profiler may start again
