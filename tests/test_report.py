"""The report: its numbers (report.json) from scripted run directories, the PNG decoded back,
the clear error without matplotlib, and both from a real `dflash-ipc up` run on CPU."""

import json
import sys

import numpy as np
import pytest

from dflash_ipc.errors import DataError, MissingExtraError
from dflash_ipc.run.eval_results import save_eval_results
from dflash_ipc.report import PANELS, build_report, format_summary
from dflash_ipc.report.collect import collect

T = 1_800_000_000.0  # wall-clock start of the scripted timelines


def _write_lines(path, rows):
    path.parent.mkdir(exist_ok=True)
    with open(path, "w") as f:
        f.writelines((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows)


def _timelines(run_dir):
    # target/0 works 90 % of the time, target/1 waits 90 %: a starved target
    _write_lines(run_dir / "metrics" / "target-0.jsonl",
                 [{"t0": T + i, "t1": T + i + 0.9, "state": "busy", "tokens": 90} for i in range(10)])
    _write_lines(run_dir / "metrics" / "target-1.jsonl",
                 [{"t0": T, "t1": T + 9, "state": "wait_work"},
                  {"t0": T + 9, "t1": T + 10, "state": "busy", "tokens": 100}])
    _write_lines(run_dir / "metrics" / "drafter-0.jsonl", [
        {"t0": T, "t1": T + 5, "state": "wait_hidden"},
        {"t0": T + 5, "t1": T + 10, "state": "step", "loss": 3.0, "anchors": 50, "sequences": 5, "tokens": 900}])


def _decode(path) -> np.ndarray:
    from matplotlib.image import imread
    return imread(path)


def test_timelines_alone_give_the_lanes_and_rates(tmp_path):
    _timelines(tmp_path)
    report = build_report(str(tmp_path))
    assert report["png"] == str(tmp_path / "report.png") and report["json"] == str(tmp_path / "report.json")
    numbers = json.loads((tmp_path / "report.json").read_text())
    assert numbers["panels"] == ["states", "rates"]  # no history, step metrics or eval here
    assert numbers["memory"] is numbers["training"] is numbers["eval"] is None
    workers = numbers["workers"]
    assert list(workers) == ["target/0", "target/1", "drafter/0"]
    assert workers["target/0"]["busy_fraction"] == pytest.approx(0.9 * 10 / 9.9)
    assert workers["target/1"]["busy_fraction"] == pytest.approx(0.1)
    assert workers["drafter/0"]["anchors_per_s"] == pytest.approx(5.0)
    assert numbers["states"]["target/1"] == [[0.0, 9.0, "wait_work"], [9.0, 10.0, "busy"]]
    assert numbers["span_s"] == pytest.approx(10.0)
    rates = numbers["rates"]
    assert len(rates["t"]) == len(rates["produced_tokens_per_s"]) == len(rates["trained_tokens_per_s"]) == 100
    # target/0 produces 90 tokens a second; the one step ends at 10 s, so training shows at the end only
    assert np.mean(rates["produced_tokens_per_s"][20:80]) == pytest.approx(90, rel=0.1)  # 6 whole periods
    assert max(rates["trained_tokens_per_s"][:50]) == 0 and rates["trained_tokens_per_s"][-1] > 0
    image = _decode(report["png"])
    assert image.ndim == 3 and image.shape[1] > 1000 and image.shape[0] > 300
    assert "target/1" in format_summary(report) and "10.0%" in format_summary(report)


def test_every_panel_from_its_file(tmp_path):
    _timelines(tmp_path)
    # a resumed job retrains steps 3-4 and appends them: the last line of a step wins
    steps = [{"step": s, "loss": 5.0 - 0.1 * s, "lr": 1e-3 * s} for s in range(1, 5)]
    steps += [{"step": 3, "loss": 4.5, "lr": 3e-3}, {"step": 4, "loss": float("nan"), "lr": 4e-3}, "{torn"]
    _write_lines(tmp_path / "drafter_metrics.jsonl", [json.dumps(s) if isinstance(s, dict) else s for s in steps])
    history = [{"time": T + 2 * i,
                "workers": {"target/0": {"pid": 1, "rss_mib": 500.0, "gpu_mem_reserved_mib": 1000.0 + i},
                            "drafter/0": {"pid": 2, "rss_mib": 800.0}}} for i in range(3)]
    _write_lines(tmp_path / "status_history.jsonl", history)
    save_eval_results(str(tmp_path), [{"label": "older", "tau": 9.0, "acceptance_per_position": [1.0, 1.0, 1.0]}])
    save_eval_results(str(tmp_path), [
        {"label": "untrained", "prompt_set": "held-out", "tau": 1.0, "acceptance_per_position": [0.0, 0.0, 0.0]},
        {"label": "trained", "prompt_set": "held-out", "tau": 2.5, "acceptance_per_position": [0.9, 0.5, None],
         "num_generated_tokens": 120, "wall_s": 2.0},
        {"label": "trained", "prompt_set": "gsm8k", "tau": 1.5, "acceptance_per_position": [0.4, 0.1, 0.0],
         "speedup": 1.25}], baseline=[True, False, False])
    (tmp_path / "out").mkdir()
    report = build_report(str(tmp_path), str(tmp_path / "out" / "r.png"))  # the JSON goes beside it
    assert report["json"] == str(tmp_path / "out" / "r.json")
    numbers = json.loads((tmp_path / "out" / "r.json").read_text())
    assert numbers["panels"] == list(PANELS)
    assert numbers["training"] == {"step": [1, 2, 3, 4], "loss": [4.9, 4.8, 4.5, None], "lr": [1e-3, 2e-3, 3e-3, 4e-3]}
    assert numbers["loss_first"] == 4.9 and numbers["loss_last"] == 4.5
    memory = numbers["memory"]
    # GPU memory where any process reports it; the drafter reported host memory only
    assert memory["metric"] == "gpu_mem_reserved_mib"
    assert memory["workers"] == {"target/0": {"t": [0.0, 2.0, 4.0], "mib": [1000.0, 1001.0, 1002.0]}}
    # every prompt set of the newest evaluation, its untrained baseline and the older one left out
    when = numbers["eval"][0]["time"]
    assert numbers["eval"] == [
        {"label": "trained", "prompt_set": "held-out", "time": when, "tau": 2.5,
         "acceptance_per_position": [0.9, 0.5, None], "tokens_per_s": 60.0},
        {"label": "trained", "prompt_set": "gsm8k", "time": when, "tau": 1.5, "acceptance_per_position": [0.4, 0.1, 0.0],
         "speedup": 1.25}]
    summary = format_summary(report)
    assert "[held-out]: tau 2.50" in summary and "[gsm8k]: tau 1.50" in summary and "tau 9.00" not in summary
    _decode(report["png"])


def test_host_memory_when_no_gpu_memory_is_reported(tmp_path):
    _timelines(tmp_path)
    _write_lines(tmp_path / "status_history.jsonl",
                 [{"time": T + 1, "workers": {"target/1": {"rss_mib": 300.0}, "drafter/0": {"rss_mib": 800.0}}},
                  {"time": T + 3, "workers": {"target/1": {"rss_mib": 310.0}}}])
    memory = collect(str(tmp_path))["memory"]  # the numbers alone: no picture needed
    assert memory == {"metric": "rss_mib", "workers": {"target/1": {"t": [1.0, 3.0], "mib": [300.0, 310.0]},
                                                       "drafter/0": {"t": [1.0], "mib": [800.0]}}}


def test_without_metrics_names_the_folder(tmp_path):
    with pytest.raises(DataError, match="metrics"):
        build_report(str(tmp_path))


def test_without_matplotlib_names_the_extra(tmp_path, monkeypatch):
    _timelines(tmp_path)
    for name in ("matplotlib", "matplotlib.figure", "matplotlib.backends.backend_agg", "matplotlib.patches"):
        monkeypatch.setitem(sys.modules, name, None)  # `import matplotlib...` raises ImportError
    with pytest.raises(MissingExtraError, match=r"pip install 'dflash-ipc\[report\]'"):
        build_report(str(tmp_path))
    assert not (tmp_path / "report.png").exists() and not (tmp_path / "report.json").exists()


@pytest.mark.slow
def test_report_from_a_real_cpu_run(cpu_run, tmp_path):
    """A small real job (2 targets, 1 drafter, 1 epoch) and its saved eval: every panel."""
    from click.testing import CliRunner

    from dflash_ipc.cli import main
    result = CliRunner().invoke(main, ["report", cpu_run.run_dir, "--out", str(tmp_path / "out.png")])
    assert result.exit_code == 0, result.output
    assert "panels states, rates, memory, training, eval" in result.output
    numbers = json.loads((tmp_path / "out.json").read_text())
    assert numbers["panels"] == list(PANELS)
    workers = numbers["workers"]
    assert set(workers) == set(numbers["states"]) == {"target/0", "target/1", "drafter/0"}
    final = json.loads(open(f"{cpu_run.run_dir}/final_status.json").read())
    produced = sum(t["tokens"] for t in final["targets"].values())
    assert sum(workers[f"target/{r}"]["tokens"] for r in range(2)) == produced
    drafter = workers["drafter/0"]
    assert drafter["count"] > 0 and drafter["anchors"] > 0 and 0 < drafter["busy_fraction"] <= 1
    assert all(0 < workers[f"target/{r}"]["busy_fraction"] < 1 for r in range(2))
    assert max(numbers["rates"]["produced_tokens_per_s"]) > 0 and max(numbers["rates"]["trained_tokens_per_s"]) > 0
    steps = numbers["training"]["step"]
    latest = json.loads(open(f"{cpu_run.run_dir}/checkpoints/latest.json").read())
    assert steps == list(range(1, latest["step"] + 1))  # every step, up to the closing checkpoint
    assert all(v is not None and v > 0 for v in numbers["training"]["lr"][:-1])
    # CPU: host memory of every process, from the supervisor's polls
    assert numbers["memory"]["metric"] == "rss_mib"
    assert set(numbers["memory"]["workers"]) == set(workers)
    assert all(min(lane["mib"]) > 50 for lane in numbers["memory"]["workers"].values())
    [saved] = cpu_run.eval_json
    [shown] = numbers["eval"]
    assert shown["prompt_set"] == saved["prompt_set"] and shown["tau"] == pytest.approx(saved["tau"])
    assert shown["acceptance_per_position"] == pytest.approx(saved["acceptance_per_position"])
    image = _decode(tmp_path / "out.png")
    assert image.shape[:2] == (900, 1600)  # 16:9, a slide


def test_a_long_lane_is_binned_by_majority_state(tmp_path):
    # 30,000 batches of 0.3 s busy + 0.1 s waiting: far more intervals than pixels
    rows = []
    for i in range(30_000):
        rows += [{"t0": T + 0.4 * i, "t1": T + 0.4 * i + 0.3, "state": "busy", "tokens": 10},
                 {"t0": T + 0.4 * i + 0.3, "t1": T + 0.4 * i + 0.4, "state": "wait_work"}]
    rows[-20_000:] = [{"t0": r["t0"], "t1": r["t1"], "state": "wait_work"} for r in rows[-20_000:]]  # idle tail
    _write_lines(tmp_path / "metrics" / "target-0.jsonl", rows)
    numbers = collect(str(tmp_path))
    lane = numbers["states"]["target/0"]
    assert len(lane) <= 2000 and [state for _, _, state in lane] == ["busy", "wait_work"]  # merged runs
    busy_end = lane[0][1]
    assert busy_end == pytest.approx(0.4 * 20_000, rel=0.002) and lane[-1][1] == pytest.approx(12_000.0)
    assert numbers["workers"]["target/0"]["busy_s"] == pytest.approx(0.3 * 20_000)  # exact, unbinned


HOSTILE_LINES = [
    "[" * 100_000,                                # nesting past the recursion limit
    '{"t0": ' + "9" * 5000 + "}",                 # an integer past 4,300 digits
    b'{"t0": "\xff"}',                            # bad UTF-8
    '{"t0": 1, "t1": 2}',                         # no state
    '{"t0": "a", "t1": 2, "state": "busy"}',      # a time that is no number
    '{"t0": NaN, "t1": 2, "state": "busy"}',
    '{"t0": 1e308, "t1": Infinity, "state": "busy"}',
    '{"t0": 5, "t1": 1, "state": "busy"}',        # ends before it starts
    '{"t0": 1, "t1": 2, "state": "sleeping"}',    # no such state
    '{"t0": 1, "t1": 2, "state": "busy", "tokens": -1e300}',
    "[1, 2]",
    "x" * 100,
]


def test_damaged_or_hostile_run_files_are_skipped_and_the_report_is_strict_json(tmp_path, caplog):
    """Every line of every file `report` reads may be torn, edited or crafted: those lines are
    skipped with a bounded number of warnings naming file and line, and the report is still
    made, as strict JSON (no NaN, no Infinity)."""
    _timelines(tmp_path)
    rows = [line if isinstance(line, bytes) else line.encode() for line in HOSTILE_LINES]
    for name in ("metrics/target-0.jsonl", "metrics/drafter-0.jsonl", "drafter_metrics.jsonl",
                 "status_history.jsonl", "eval_results.jsonl"):
        with open(tmp_path / name, "ab") as f:
            f.write(b"\n".join(rows) + b"\n")
    with open(tmp_path / "eval_results.jsonl", "a") as f:
        f.write(json.dumps({"label": "x", "tau": 2.0, "acceptance_per_position": [], "time": "yesterday"}) + "\n")
        f.write(json.dumps({"label": ["x"], "tau": 2.0, "acceptance_per_position": []}) + "\n")
    with open(tmp_path / "status_history.jsonl", "a") as f:
        f.write(json.dumps({"time": T, "workers": ["target/0"]}) + "\n")
    numbers = collect(str(tmp_path))
    assert numbers["workers"]["target/0"]["busy_fraction"] == pytest.approx(0.9 * 10 / 9.9)  # the good lines
    assert numbers["eval"] is None and numbers["memory"] is None and numbers["training"] is None
    json.dumps(numbers, allow_nan=False)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any("target-0.jsonl:11: not a timeline interval" in w for w in warnings)
    assert len(warnings) <= 5 * 6 and any("more lines skipped" in w for w in warnings)


def test_a_line_over_the_cap_is_skipped_without_holding_it(tmp_path):
    from dflash_ipc.run.json_lines import read_json_lines
    path = tmp_path / "big.jsonl"
    path.write_text('{"a": 1}\n' + '{"b": "' + "y" * 5000 + '"}\n{"c": 3}\n')
    assert list(read_json_lines(str(path), max_line_bytes=1000)) == [{"a": 1}, {"c": 3}]


@pytest.mark.timeout(10)
def test_a_json_lines_path_that_is_a_fifo_or_a_device_is_skipped_with_a_warning(tmp_path, caplog):
    import os

    from dflash_ipc.run.json_lines import read_json_lines
    os.mkfifo(tmp_path / "eval_results.jsonl")
    os.symlink("/dev/zero", tmp_path / "metrics.jsonl")
    for name, kind in (("eval_results.jsonl", "a FIFO"), ("metrics.jsonl", "a character device")):
        assert list(read_json_lines(str(tmp_path / name))) == []
        assert f"{name}: a JSON-lines file is {kind}" in caplog.text


# --- slide-ready: title, 16:9 grid, shared time axes, legends off the data, honest eval --------


def _every_panel(run_dir, acceptance):
    _timelines(run_dir)
    _write_lines(run_dir / "drafter_metrics.jsonl", [{"step": s, "loss": 5.0 - 0.1 * s, "lr": 1e-3} for s in range(1, 9)])
    # the supervisor's polls go on 3 s past the last interval: the time axes still end together
    _write_lines(run_dir / "status_history.jsonl",
                 [{"time": T + i, "workers": {"target/0": {"rss_mib": 500.0}}} for i in range(14)])
    save_eval_results(str(run_dir), [{"label": "trained", "prompt_set": "held-out", "tau": 1.0,
                                      "acceptance_per_position": acceptance}])
    return collect(str(run_dir))


def test_the_picture_is_a_16_9_slide_titled_with_the_jobs_name_and_one_time_axis(tmp_path):
    from dflash_ipc.report.plot import figure
    run_dir = tmp_path / "qwen3-8b-try2"
    run_dir.mkdir()
    numbers = _every_panel(run_dir, [0.8, 0.4, 0.1])
    fig = figure(numbers)
    assert tuple(fig.get_size_inches()) == (16.0, 9.0)
    assert fig.get_suptitle() == "qwen3-8b-try2: 10s, 2 targets, 1 drafter"  # the name, not a path
    axes = {a.get_title(loc="left").split(" ")[0]: a for a in fig.axes if a.get_title(loc="left")}
    time_axes = [axes["worker"], axes["valid"], axes["host"]]
    assert all(a.get_xlim() == (0.0, numbers["span_s"]) for a in time_axes)
    assert all(time_axes[0].get_shared_x_axes().joined(time_axes[0], a) for a in time_axes[1:])
    assert [a.get_xlabel() for a in time_axes] == ["", "", "seconds since the first worker interval"]
    # two columns: the time panels left, training and eval right (a grid, not five stacked panels)
    assert axes["drafter"].get_position().x0 > time_axes[0].get_position().x1
    fig.canvas.draw()
    for ax in time_axes:  # every legend above its panel's data area
        legend = ax.get_legend()
        assert legend is not None
        assert legend.get_window_extent().y0 >= ax.get_window_extent().y1 - 1
    assert not axes["latest"].texts and len(axes["latest"].patches) == 3


def test_an_evaluation_without_accepted_tokens_says_so_instead_of_an_empty_frame(tmp_path):
    from dflash_ipc.report.plot import figure, no_accepted_note
    numbers = _every_panel(tmp_path, [0.0, 0.0, None])
    [panel] = [a for a in figure(numbers).axes if a.get_title(loc="left").startswith("latest eval")]
    assert [t.get_text() for t in panel.texts] == [no_accepted_note(numbers["eval"])]
    assert not panel.patches  # no zero-height bars
    assert no_accepted_note([{"acceptance_per_position": [0.0, 0.01]}]) is None
    assert build_report(str(tmp_path))["panels"][-1] == "eval"


def test_the_eval_title_fits_the_slide_with_a_drafters_long_path(tmp_path):
    # The label eval writes is the drafter's absolute path: the title must keep tau on the picture.
    from dflash_ipc.report.plot import figure, short_label
    _timelines(tmp_path)
    label = "drafter /home/someone/projects/drafters/runs/qwen3-8b-try2/checkpoints/step_00001000"
    save_eval_results(str(tmp_path), [{"label": label, "prompt_set": "held-out", "tau": 2.69,
                                       "tokens_per_s": 1234.5, "acceptance_per_position": [0.8, 0.4]}])
    fig = figure(collect(str(tmp_path)))
    [panel] = [a for a in fig.axes if a.get_title(loc="left").startswith("latest eval")]
    fig.canvas.draw()
    title = panel._left_title  # the Text set_title(loc="left") drew: matplotlib has no public getter for it
    assert "tau 2.69" in title.get_text() and "step_00001000" in title.get_text()
    assert title.get_window_extent().x1 <= fig.bbox.x1
    assert short_label(label) == "drafter .../checkpoints/step_00001000"
    assert short_label("drafter org/name") == "drafter org/name" and short_label("untrained") == "untrained"
