"""Evaluation results kept in a run directory: `RUN_DIR/eval_results.jsonl`.

`dflash-ipc eval ... --save-to RUN_DIR` appends one JSON line per evaluated drafter and prompt set;
the report and the model card show the latest evaluation (every prompt set of it). The shape
they rely on is small, so that any version of `eval` can write it:

    {"time": 1767000000.0,               unix seconds of the evaluation (added when absent)
     "label": "trained (runs/x/checkpoints/step_00000060)",
     "baseline": false,                  true for the untrained drafter of --vs-untrained
     "tau": 2.31,                        committed tokens per target forward (null: none)
     "acceptance_per_position": [0.83, 0.61, ...],   block positions 1..bs-1 (null: never drafted)
     "tokens_per_s": 412.0,              optional: generated tokens / wall seconds
     "prompt_set": "gsm8k",              optional: the set's name (eval writes it)
     ...}                                any other keys `eval --json` gives, kept as they are

A line that is not such an object is skipped with a warning naming the file and line.
"""

from __future__ import annotations

import json
import math
import os
import time

from dflash_ipc.errors import DataError
from dflash_ipc.run.json_lines import read_json_lines
from dflash_ipc.run.files import RunFiles


def _number_or_none(value) -> bool:
    return value is None or (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value))


def valid_result(row) -> bool:
    """The shape above: `tau`, `time`, `tokens_per_s` numbers or null, `acceptance_per_position` a
    list of them, `label` a string."""
    return (isinstance(row, dict) and _number_or_none(row.get("tau"))
            and isinstance(row.get("acceptance_per_position"), list)
            and all(_number_or_none(v) for v in row["acceptance_per_position"])
            and _number_or_none(row.get("tokens_per_s")) and _number_or_none(row.get("time"))
            and isinstance(row.get("label", ""), str))


def save_eval_results(run_dir: str, results: list[dict], *, baseline: list[bool] | None = None) -> str:
    """Appends `results` (`EvalReport.to_dict()` dicts) to the run's file; returns its path.
    `baseline[i]` marks an untrained reference; `tokens_per_s` is derived from
    `num_generated_tokens / wall_s` when the result has both and no rate of its own."""
    path = RunFiles(run_dir).eval_results
    now = time.time()
    lines = []
    for i, result in enumerate(results):
        row = {"time": now, "baseline": bool(baseline[i]) if baseline else False, **result}
        tokens, wall = row.get("num_generated_tokens"), row.get("wall_s")
        if row.get("tokens_per_s") is None and isinstance(tokens, (int, float)) and isinstance(wall, (int, float)) \
                and wall > 0:
            row["tokens_per_s"] = tokens / wall
        if not valid_result(row):
            raise DataError(f"eval result {i} lacks tau / acceptance_per_position numbers: {sorted(row)}")
        lines.append(json.dumps(row) + "\n")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.writelines(lines)
    return path


def check_appendable(run_dir: str) -> str:
    """The run's results file, if results can be appended to it; else DataError saying why. `eval
    --save-to` asks before it loads a model, so that a read-only run directory (or a directory in
    the file's place) is answered at once, not after the whole evaluation."""
    path = RunFiles(run_dir).eval_results
    existed = os.path.lexists(path)
    try:  # O_NONBLOCK: a FIFO in the file's place is refused (ENXIO) instead of waiting for a reader
        os.close(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK, 0o666))
    except OSError as e:
        raise DataError(f"--save-to {run_dir}: cannot append to {path} ({e.strerror or e})") from None
    if not existed:  # leave no empty file behind if the evaluation then fails
        os.unlink(path)
    return path


def load_eval_results(run_dir: str) -> list[dict]:
    """Every valid line, oldest first ([] when the run has none)."""
    return list(read_json_lines(RunFiles(run_dir).eval_results, keep=valid_result,
                                expected="an eval result (tau and acceptance_per_position)"))


def latest_evaluation(run_dir: str) -> list[dict]:
    """The results of the newest evaluation of a trained drafter (baselines left out): every
    prompt set that one `eval --save-to` wrote (its lines share one `time`), in file order;
    [] when the run has none."""
    rows = [r for r in load_eval_results(run_dir) if not r.get("baseline")]
    if not rows:
        return []
    newest = max(r.get("time") or 0.0 for r in rows)
    return [r for r in rows if (r.get("time") or 0.0) == newest]
