"""`dflash-ipc report RUN_DIR`: who worked, who waited, how training went, in one PNG and its JSON.

    report = build_report("runs/qwen3-8b")       # writes report.png and report.json there
    print(format_summary(report))

collect.py gathers the numbers from the run directory (timelines, per-step metrics, the
supervisor's status history, saved evaluations); plot.py draws them with matplotlib (the
`report` extra). `report.json` holds exactly what the picture shows, plus each worker's
summary: a script or a test reads the figures there, not off the pixels.
"""

from __future__ import annotations

import os

from dflash_ipc.report.collect import PANELS, collect
from dflash_ipc.report.plot import render
from dflash_ipc.run.files import RunFiles
from dflash_ipc.run.json_files import write_json_atomic

__all__ = ["PANELS", "build_report", "format_summary"]


def build_report(run_dir: str, out_path: str | None = None, json_path: str | None = None) -> dict:
    """Writes the PNG (default `RUN_DIR/report.png`) and its numbers as JSON (default: the
    PNG's path with `.json`); returns the numbers with `png` and `json` set to the two paths."""
    numbers = collect(run_dir)
    files = RunFiles(run_dir)
    out_path = out_path or files.report_png
    json_path = json_path or (files.report_json if out_path == files.report_png
                              else os.path.splitext(out_path)[0] + ".json")
    render(numbers, out_path)
    write_json_atomic(json_path, numbers, indent=None)
    return {**numbers, "png": out_path, "json": json_path}


def _cell(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def format_summary(report: dict) -> str:
    """The per-worker table `dflash-ipc report` prints, then a line per prompt set of the latest eval."""
    lines = [f"{'worker':<11} {'busy':>6} {'wait_s':>8} {'work_s':>8} {'n':>6} {'tok/s':>9} "
             f"{'anch/s':>8} {'seq/s':>7} {'step_ms':>8} {'loss':>7}"]
    for role, s in report["workers"].items():
        wait = s["wait_work_s"] + s["wait_hidden_s"] + s["wait_slot_s"]
        step_s = s.get("step_s_mean")
        step_ms = _cell(None if step_s is None else 1000 * step_s, ".1f")
        lines.append(f"{role:<11} {100 * s['busy_fraction']:5.1f}% {wait:8.1f} {s['busy_s'] + s['step_s']:8.1f} "
                     f"{s['count']:6d} {s['tokens_per_s']:9.0f} {s['anchors_per_s']:8.1f} "
                     f"{s['sequences_per_s']:7.2f} {step_ms:>8} {_cell(s.get('loss_last'), '.3f'):>7}")
    for result in report.get("eval") or ():
        lines.append(f"latest eval ({result.get('label', '')}) [{result.get('prompt_set') or '-'}]: "
                     f"tau {_cell(result.get('tau'), '.2f')}, acceptance by position "
                     + " ".join(_cell(v, ".2f") for v in result["acceptance_per_position"]))
    return "\n".join(lines)
