"""The numbers of `dflash-ipc report`: everything report.png draws, as one JSON-ready dict.

Read from the run directory (each file is optional but the timelines):

    metrics/<role>.jsonl   worker timelines (metrics.py): state lanes, produced and trained tokens/s
    drafter_metrics.jsonl  drafter rank 0, one line per step: loss and learning rate over steps
    status_history.jsonl   the supervisor's polls (status_history.py): memory of each process
    eval_results.jsonl     `dflash-ipc eval --save-to` (eval_results.py): tau, acceptance by position
                           of each prompt set of the latest evaluation

Times are seconds since the first timeline interval began, on the wall clock every process
shares. A panel whose source is missing is left out of `panels` (and of the picture).
"""

from __future__ import annotations

import math

import numpy as np

from dflash_ipc.errors import DataError
from dflash_ipc.run.eval_results import latest_evaluation
from dflash_ipc.run.json_lines import read_json_lines
from dflash_ipc.obs.timelines import STATES, load_timelines, rate_series, summarize
from dflash_ipc.run.files import RunFiles
from dflash_ipc.obs.status_history import load_status_history

PANELS = ("states", "rates", "memory", "training", "eval")
MAX_LANE_INTERVALS = 5000  # a lane with more intervals is drawn (and stored) binned
LANE_BINS = 2000           # the bins of such a lane: more than the picture's pixels across
RATE_BINS = 100       # time bins of the rates panel
RATE_WINDOW_BINS = 7  # rates are moving averages over this many bins (7 % of the run)
GPU_MEMORY = "gpu_mem_reserved_mib"  # what PyTorch's allocator holds: nearest to what the GPU lost
HOST_MEMORY = "rss_mib"              # CPU runs report no GPU memory


def _finite_or_none(value) -> float | None:
    """Strict JSON has no NaN: a missing or non-finite number is None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def _lane(rows: list[dict], start: float, span: float) -> list[list]:
    """One worker's intervals as `[t0, t1, state]`. A long job has far more intervals than the
    picture has pixels (one per batch or step): past MAX_LANE_INTERVALS the lane is cut into
    LANE_BINS equal bins, each given the state that filled most of it (none: left out), and
    runs of equal bins are merged. The exact seconds per state stay in `workers`."""
    if len(rows) <= MAX_LANE_INTERVALS:
        return [[round(r["t0"] - start, 4), round(r["t1"] - start, 4), r["state"]] for r in rows]
    bin_s = span / LANE_BINS
    filled = np.zeros((LANE_BINS, len(STATES)))  # seconds of each state in each bin
    for r in rows:
        t0, t1, state = r["t0"] - start, r["t1"] - start, STATES.index(r["state"])
        for b in range(int(t0 // bin_s), min(LANE_BINS - 1, int(t1 // bin_s)) + 1):
            filled[b, state] += max(0.0, min(t1, (b + 1) * bin_s) - max(t0, b * bin_s))
    lane: list[list] = []
    for b in range(LANE_BINS):
        if filled[b].max() <= 0:
            continue
        state = STATES[int(filled[b].argmax())]
        if lane and lane[-1][2] == state and lane[-1][1] == round(b * bin_s, 4):
            lane[-1][1] = round((b + 1) * bin_s, 4)
        else:
            lane.append([round(b * bin_s, 4), round((b + 1) * bin_s, 4), state])
    return lane


def _rates(timelines: dict[str, list[dict]], start: float, end: float) -> dict:
    """The job's produced (targets) and trained (drafters) valid tokens/s over time."""
    bin_s = max((end - start) / RATE_BINS, 1e-6)
    out = {"t": [round((i + 0.5) * bin_s, 4) for i in range(RATE_BINS)]}
    for kind, name in (("target", "produced_tokens_per_s"), ("drafter", "trained_tokens_per_s")):
        total = np.zeros(RATE_BINS)
        for role, rows in timelines.items():
            if role.startswith(kind + "/"):
                series = rate_series(rows, "tokens", start, end, bin_s, RATE_WINDOW_BINS)[:RATE_BINS]
                total[:len(series)] += series
        out[name] = [round(float(v), 3) for v in total]
    return out


def _training(path: str) -> dict | None:
    """Loss and learning rate by optimizer step. A resumed job retrains the steps after its
    last commit and appends them: the last line of a step is the one the weights contain."""
    by_step: dict[int, dict] = {}
    for row in read_json_lines(path, keep=lambda row: isinstance(row, dict) and isinstance(row.get("step"), int),
                               expected="a step record"):
        by_step[row["step"]] = row
    if not by_step:
        return None
    steps = sorted(by_step)
    return {"step": steps, "loss": [_finite_or_none(by_step[s].get("loss")) for s in steps],
            "lr": [_finite_or_none(by_step[s].get("lr")) for s in steps]}


def _memory(history: list[dict], start: float) -> dict | None:
    """Per process, GPU memory over time (host RSS when no process reports GPU memory)."""
    workers = [(row["time"], role, memory) for row in history
               for role, memory in (row.get("workers") or {}).items() if isinstance(memory, dict)]
    if not workers:
        return None
    metric = GPU_MEMORY if any(GPU_MEMORY in m for _, _, m in workers) else HOST_MEMORY
    series: dict[str, dict[str, list]] = {}
    for t, role, memory in workers:
        value = _finite_or_none(memory.get(metric))
        if value is not None:
            lane = series.setdefault(role, {"t": [], "mib": []})
            lane["t"].append(round(t - start, 3))
            lane["mib"].append(round(value, 1))
    return {"metric": metric, "workers": dict(sorted(series.items(), key=lambda kv: _role_order(kv[0])))}


def _role_order(role: str) -> tuple:
    kind, _, rank = role.partition("/")
    return kind != "target", kind, int(rank) if rank.isdigit() else 0


EVAL_KEYS = ("label", "prompt_set", "time", "tau", "acceptance_per_position", "tokens_per_s", "speedup",
             "block_size", "num_prompts")


def _eval(run_dir: str) -> list[dict] | None:
    """One entry per prompt set of the latest evaluation (None without one)."""
    results = latest_evaluation(run_dir)
    return [{k: result.get(k) for k in EVAL_KEYS if k in result} for result in results] or None


def collect(run_dir: str) -> dict:
    """Every number of the report (see the module doc). DataError without timelines."""
    files = RunFiles(run_dir)
    timelines = {role: rows for role, rows in load_timelines(run_dir).items() if rows}
    if not timelines:
        raise DataError(f"{files.metrics}: no worker timelines (*.jsonl with intervals) to report; "
                        f"was the job run with this version, in this run directory?")
    start = min(r["t0"] for rows in timelines.values() for r in rows)
    end = max(r["t1"] for rows in timelines.values() for r in rows)
    training = _training(files.drafter_metrics)
    losses = [v for v in (training or {}).get("loss", []) if v is not None]
    numbers = {
        "run_dir": files.run_dir, "start": start, "span_s": end - start,
        "workers": {role: {k: _finite_or_none(v) if isinstance(v, float) else v for k, v in summarize(rows).items()}
                    for role, rows in timelines.items()},
        "states": {role: _lane(rows, start, end - start) for role, rows in timelines.items()},
        "rates": _rates(timelines, start, end),
        "memory": _memory(load_status_history(files.status_history), start),
        "training": training,
        "eval": _eval(run_dir),
        "loss_first": losses[0] if losses else None,
        "loss_last": losses[-1] if losses else None,
    }
    numbers["panels"] = [name for name in PANELS if numbers[name]]
    return numbers
