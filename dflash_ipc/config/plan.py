"""``dflash-ipc plan``: the target/drafter GPU split that maximises tok_rate, from capacities.

With ``t`` target workers of ``K`` GPUs each (``target.gpus_per_worker``; 1 for a target that
fits one GPU) and ``N - t K`` GPUs of drafters, the pipeline cannot train faster than its
slower side, so the predicted end-to-end rate is

    tok_rate(t) = min(t x target capacity, (N - t K) x drafter capacity)

with the target capacity in tokens/s per worker (of K GPUs) and the drafter capacity per GPU, as
``dflash-ipc bench pipeline`` measures them (one worker alone: ``target_capacity`` and
``drafter_capacity`` of its JSON, which also records K). Every split with at least one worker on
each side is listed; the best is the highest prediction (ties: the split that leaves less
capacity idle, then fewer target workers). The prediction assumes both sides scale linearly
with workers (drafters add gradient all-reduces; ``bench pipeline``'s ratio says how close
one pair comes to its capacity).

    dflash-ipc plan --gpus 8 --target-capacity 40000 --drafter-capacity 11000
    dflash-ipc plan --gpus 8 --gpus-per-target 2 --target-capacity 9000 --drafter-capacity 4500
    dflash-ipc plan --gpus 8 --from-bench bench.json
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass

from dflash_ipc.errors import ConfigError, DataError
from dflash_ipc.run.json_files import read_json_object


@dataclass(frozen=True)
class Split:
    targets: int           # target workers (of gpus_per_target GPUs each)
    drafters: int          # GPUs (and workers) of drafters
    target_side: float     # targets x target capacity, tok/s
    drafter_side: float    # drafters x drafter capacity, tok/s
    tok_rate: float        # predicted: min of the two sides
    bottleneck: str        # target, drafter or balanced
    gpus_per_target: int = 1  # GPUs of one target worker (target.gpus_per_worker)

    @property
    def target_gpus(self) -> int:
        return self.targets * self.gpus_per_target


def _check_capacity(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{name} must be a positive number of tokens/s, got {value!r}")
    return float(value)


def splits(num_gpus: int, target_capacity: float, drafter_capacity: float, gpus_per_target: int = 1) -> list[Split]:
    """Every split of ``num_gpus`` GPUs into >= 1 target worker of ``gpus_per_target`` GPUs and
    >= 1 drafter GPU, fewest target workers first."""
    k = gpus_per_target
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ConfigError(f"--gpus-per-target must be an integer >= 1, got {k!r}")
    if isinstance(num_gpus, bool) or not isinstance(num_gpus, int) or num_gpus < k + 1:
        raise ConfigError(f"--gpus must be an integer >= {k + 1} (at least one target worker of {k} GPUs and one "
                          f"drafter GPU), got {num_gpus!r}")
    t_cap = _check_capacity("target capacity", target_capacity)
    d_cap = _check_capacity("drafter capacity", drafter_capacity)
    out = []
    for t in range(1, (num_gpus - 1) // k + 1):
        drafters = num_gpus - t * k
        t_side, d_side = t * t_cap, drafters * d_cap
        bottleneck = "target" if t_side < d_side else "drafter" if d_side < t_side else "balanced"
        out.append(Split(t, drafters, t_side, d_side, min(t_side, d_side), bottleneck, k))
    return out


def best_split(options: list[Split]) -> Split:
    """Highest predicted tok_rate; ties: less idle capacity, then fewer target GPUs."""
    return max(options, key=lambda s: (s.tok_rate, -(s.target_side + s.drafter_side - 2 * s.tok_rate),
                                       -s.targets))


def gpus_per_target_from_bench(path: str) -> int:
    """The ``target_gpus_per_worker`` a ``bench pipeline --json`` file was measured with (1 if absent)."""
    value = read_json_object(path, "bench pipeline --json file").get("target_gpus_per_worker", 1)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise DataError(f"{path}: field target_gpus_per_worker must be an integer >= 1, got {value!r}")
    return value


def capacities_from_bench(path: str) -> tuple[float, float]:
    """``target_capacity`` and ``drafter_capacity`` of a ``bench pipeline --json`` file."""
    if not os.path.isfile(path):
        raise DataError(f"{path}: no such bench file (write one with dflash-ipc bench pipeline --json)")
    data = read_json_object(path, "bench pipeline --json file")
    values = []
    for field in ("target_capacity", "drafter_capacity"):
        if field not in data:
            raise DataError(f"{path}: field {field} is missing (expected the output of dflash-ipc bench "
                            "pipeline --json)")
        value = data[field]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise DataError(f"{path}: field {field} must be a positive number of tokens/s, got {value!r}")
        values.append(float(value))
    return values[0], values[1]


def config_lines(split: Split) -> dict:
    """The config of a split: target workers on cuda:0.. (K consecutive GPUs each), drafters
    after them, one per GPU."""
    k = split.gpus_per_target
    targets = [f"cuda:{i}" for i in range(split.target_gpus)]
    drafters = [f"cuda:{i}" for i in range(split.target_gpus, split.target_gpus + split.drafters)]
    per_worker = [f"  gpus_per_worker: {k}"] if k > 1 else []
    yaml_lines = ["target:", f"  num_workers: {split.targets}", *per_worker, f"  devices: [{', '.join(targets)}]",
                  "drafter:", f"  num_workers: {split.drafters}", f"  devices: [{', '.join(drafters)}]"]
    overrides = [f"target.num_workers={split.targets}", *([f"target.gpus_per_worker={k}"] if k > 1 else []),
                 f"target.devices=[{','.join(targets)}]",
                 f"drafter.num_workers={split.drafters}", f"drafter.devices=[{','.join(drafters)}]"]
    return {"target.devices": targets, "target.num_workers": split.targets, "target.gpus_per_worker": k,
            "drafter.devices": drafters, "drafter.num_workers": split.drafters,
            "yaml": "\n".join(yaml_lines), "overrides": overrides}


def make_plan(num_gpus: int, target_capacity: float, drafter_capacity: float, gpus_per_target: int = 1) -> dict:
    """Every split, the best one and its config, as plain data (what ``--json`` prints)."""
    options = splits(num_gpus, target_capacity, drafter_capacity, gpus_per_target)
    best = best_split(options)
    return {"gpus": num_gpus, "gpus_per_target": gpus_per_target, "target_capacity": float(target_capacity),
            "drafter_capacity": float(drafter_capacity),
            "splits": [asdict(s) | {"target_gpus": s.target_gpus, "best": s == best} for s in options],
            "best": asdict(best) | {"target_gpus": best.target_gpus}, "config": config_lines(best)}


def format_plan(plan: dict) -> str:
    k = plan.get("gpus_per_target", 1)
    target = (f"per GPU: target {plan['target_capacity']:,.0f} tok/s" if k == 1 else
              f"per target worker of {k} GPUs: {plan['target_capacity']:,.0f} tok/s; per GPU:")
    lines = [f"{plan['gpus']} GPUs; {target}{',' if k == 1 else ''} drafter {plan['drafter_capacity']:,.0f} tok/s",
             "predicted tok_rate = min(targets x target capacity, drafters x drafter capacity)",
             f"  {'targets':>7} {'drafters':>8} {'target side':>12} {'drafter side':>13} {'tok_rate':>12}  bottleneck"]
    for s in plan["splits"]:
        mark = "  <- best" if s["best"] else ""
        lines.append(f"  {s['targets']:>7} {s['drafters']:>8} {s['target_side']:>12,.0f} {s['drafter_side']:>13,.0f} "
                     f"{s['tok_rate']:>12,.0f}  {s['bottleneck']}{mark}")
    cfg = plan["config"]
    best = plan["best"]
    targets = (f"{best['targets']} target" if k == 1 else
               f"{best['targets']} target workers x {k} GPUs ({best['target_gpus']} GPUs)")
    lines += [f"best: {targets} + {best['drafters']} drafter GPUs, {best['tok_rate']:,.0f} tok/s "
              "predicted; config:", *("  " + line for line in cfg["yaml"].splitlines()),
              "or as overrides: " + " ".join(f"-o '{o}'" for o in cfg["overrides"])]
    return "\n".join(lines)
