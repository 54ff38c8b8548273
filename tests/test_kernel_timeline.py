"""bench/kernel_timeline.py: a trace's kernels in order, cut into cycles, and what each added."""

import pytest

from dflash_ipc.bench.kernel_timeline import (Kernel, added_times, format_slice, group_added, kernels_of_trace,
                                              slices)


def event(name, ts, dur, grid=(1, 1, 1), cat="kernel"):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": {"grid": list(grid)}}


def test_the_trace_gives_its_kernels_by_start_and_nothing_else():
    trace = {"traceEvents": [event("b", 10.0, 2.0, (4, 2, 1)), event("a", 5.0, 1.0),
                             event("cudaLaunchKernel", 4.0, 1.0, cat="cuda_runtime"), {"ph": "M", "name": "x"}]}
    got = kernels_of_trace(trace)
    assert [k.name for k in got] == ["a", "b"]
    assert got[1] == Kernel("b", 10.0, 12.0, (4, 2, 1))


def test_a_trace_without_events_is_named_as_such():
    with pytest.raises(ValueError, match="traceEvents"):
        kernels_of_trace({"other": 1})


def test_overlapping_kernels_add_only_what_extends_the_end():
    # b starts while a runs (PDL) and ends 3 us after it; c ends inside b; d starts after a gap
    ks = [Kernel("a", 0.0, 10.0), Kernel("b", 5.0, 13.0), Kernel("c", 6.0, 12.0), Kernel("d", 15.0, 16.0)]
    added = added_times(ks)
    assert added == [10.0, 3.0, 0.0, 3.0]  # the gap before d is counted into d
    assert sum(added) == ks[-1].end_us - ks[0].start_us
    assert added_times(ks, before_end_us=-2.0)[0] == 12.0


def test_slices_end_at_the_marker_and_drop_an_unfinished_tail():
    ks = [Kernel(n, float(i), float(i) + 0.5) for i, n in enumerate(["x", "end_k", "y", "z", "end_k", "w"])]
    cut = slices(ks, "end_k")
    assert [[k.name for k in s] for s in cut] == [["x", "end_k"], ["y", "z", "end_k"]]


def test_grouping_sums_by_key_costliest_first_and_the_format_sums_the_span():
    ks = [Kernel("p", 0.0, 4.0, (8,)), Kernel("q", 4.0, 5.0), Kernel("p", 5.0, 9.0, (8,))]
    grouped = group_added(ks, key=lambda k: f"{k.name} {k.grid}")
    assert list(grouped) == ["p (8,)", "q ()"]
    assert grouped["p (8,)"] == (8.0, 2)
    lines = format_slice(ks).splitlines()
    assert lines[1].split() == ["4.00", "4.00", "8", "p"] and lines[2].split() == ["1.00", "1.00", "-", "q"]
    assert lines[-1].strip() == "9.00 us over 3 kernels"
