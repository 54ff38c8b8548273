"""``dflash-ipc plan``: the target/drafter GPU split that maximises tok_rate, from capacities.

With ``t`` GPUs of targets (one target worker each) and ``N - t`` GPUs of drafters, the
pipeline cannot train faster than its slower side, so the predicted end-to-end rate is

    tok_rate(t) = min(t x target capacity, (N - t) x drafter capacity)

with capacities in tokens/s per GPU, as ``dflash-ipc bench pipeline`` measures them (one
worker alone on one GPU: ``target_capacity`` and ``drafter_capacity`` of its JSON). Every split
``t = 1 .. N-1`` is listed; the best is the highest prediction (ties: the split that leaves
less capacity idle, then fewer target GPUs). The prediction assumes both sides scale linearly
with GPUs (drafters add gradient all-reduces; ``bench pipeline``'s ratio says how close
one pair comes to its capacity).

    dflash-ipc plan --gpus 8 --target-capacity 40000 --drafter-capacity 11000
    dflash-ipc plan --gpus 8 --from-bench bench.json
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass

from dflash_ipc.errors import ConfigError, DataError


@dataclass(frozen=True)
class Split:
    targets: int           # GPUs (and workers) of targets
    drafters: int          # GPUs (and workers) of drafters
    target_side: float     # targets x target capacity, tok/s
    drafter_side: float    # drafters x drafter capacity, tok/s
    tok_rate: float        # predicted: min of the two sides
    bottleneck: str        # target, drafter or balanced


def _check_capacity(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{name} must be a positive number of tokens/s, got {value!r}")
    return float(value)


def splits(num_gpus: int, target_capacity: float, drafter_capacity: float) -> list[Split]:
    """Every split of ``num_gpus`` GPUs into >= 1 target and >= 1 drafter, fewest targets first."""
    if isinstance(num_gpus, bool) or not isinstance(num_gpus, int) or num_gpus < 2:
        raise ConfigError(f"--gpus must be an integer >= 2 (at least one target GPU and one drafter GPU), "
                          f"got {num_gpus!r}")
    t_cap = _check_capacity("target capacity", target_capacity)
    d_cap = _check_capacity("drafter capacity", drafter_capacity)
    out = []
    for t in range(1, num_gpus):
        t_side, d_side = t * t_cap, (num_gpus - t) * d_cap
        bottleneck = "target" if t_side < d_side else "drafter" if d_side < t_side else "balanced"
        out.append(Split(t, num_gpus - t, t_side, d_side, min(t_side, d_side), bottleneck))
    return out


def best_split(options: list[Split]) -> Split:
    """Highest predicted tok_rate; ties: less idle capacity, then fewer target GPUs."""
    return max(options, key=lambda s: (s.tok_rate, -(s.target_side + s.drafter_side - 2 * s.tok_rate),
                                       -s.targets))


def capacities_from_bench(path: str) -> tuple[float, float]:
    """``target_capacity`` and ``drafter_capacity`` of a ``bench pipeline --json`` file."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise DataError(f"{path}: no such bench file (write one with dflash-ipc bench pipeline --json)") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"{path}: cannot read it: {exc}") from None
    except json.JSONDecodeError as exc:
        raise DataError(f"{path}: not JSON ({exc}); expected the output of dflash-ipc bench pipeline --json") \
            from None
    if not isinstance(data, dict):
        raise DataError(f"{path}: expected a JSON object with target_capacity and drafter_capacity, "
                        f"got {type(data).__name__}")
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
    """The config of a split, one worker per GPU: targets on cuda:0.., drafters after them."""
    targets = [f"cuda:{i}" for i in range(split.targets)]
    drafters = [f"cuda:{i}" for i in range(split.targets, split.targets + split.drafters)]
    yaml_lines = ["target:", f"  num_workers: {split.targets}", f"  devices: [{', '.join(targets)}]",
                  "drafter:", f"  num_workers: {split.drafters}", f"  devices: [{', '.join(drafters)}]"]
    overrides = [f"target.num_workers={split.targets}", f"target.devices=[{','.join(targets)}]",
                 f"drafter.num_workers={split.drafters}", f"drafter.devices=[{','.join(drafters)}]"]
    return {"target.devices": targets, "target.num_workers": split.targets,
            "drafter.devices": drafters, "drafter.num_workers": split.drafters,
            "yaml": "\n".join(yaml_lines), "overrides": overrides}


def make_plan(num_gpus: int, target_capacity: float, drafter_capacity: float) -> dict:
    """Every split, the best one and its config, as plain data (what ``--json`` prints)."""
    options = splits(num_gpus, target_capacity, drafter_capacity)
    best = best_split(options)
    return {"gpus": num_gpus, "target_capacity": float(target_capacity), "drafter_capacity": float(drafter_capacity),
            "splits": [asdict(s) | {"best": s == best} for s in options],
            "best": asdict(best), "config": config_lines(best)}


def format_plan(plan: dict) -> str:
    lines = [f"{plan['gpus']} GPUs; per GPU: target {plan['target_capacity']:,.0f} tok/s, "
             f"drafter {plan['drafter_capacity']:,.0f} tok/s",
             "predicted tok_rate = min(targets x target capacity, drafters x drafter capacity)",
             f"  {'targets':>7} {'drafters':>8} {'target side':>12} {'drafter side':>13} {'tok_rate':>12}  bottleneck"]
    for s in plan["splits"]:
        mark = "  <- best" if s["best"] else ""
        lines.append(f"  {s['targets']:>7} {s['drafters']:>8} {s['target_side']:>12,.0f} {s['drafter_side']:>13,.0f} "
                     f"{s['tok_rate']:>12,.0f}  {s['bottleneck']}{mark}")
    cfg = plan["config"]
    best = plan["best"]
    lines += [f"best: {best['targets']} target + {best['drafters']} drafter GPUs, {best['tok_rate']:,.0f} tok/s "
              "predicted; config:", *("  " + line for line in cfg["yaml"].splitlines()),
              "or as overrides: " + " ".join(f"-o '{o}'" for o in cfg["overrides"])]
    return "\n".join(lines)
