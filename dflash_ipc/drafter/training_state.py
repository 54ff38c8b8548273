"""A drafter's training state as data: tensors in safetensors, everything else in JSON.

    tensors: model.<name>                  float32 master weights
             optimizer.<param index>.<key>  AdamW moments and step counters, Muon momentum
                                            (parameters numbered across param groups:
                                            drafter/optimizers.py for Muon + AdamW)
             rng.torch                      the CPU RNG state
    json:    step, total_steps, scheduler, optimizer param_groups and the non-tensor per-
             parameter state, and `extra` (the caller's notes: the step the run resumed from;
             what a checkpoint commits is the dispatcher's ledger's)

Loading checks every name, dtype and shape against the live model and optimizer, and the
JSON part against what this process would write (the same keys or fewer, the same kinds of
values, finite numbers), before anything is copied in: a file of another shape, a hand-edited
or a crafted one is a clear error, never a silent partial load, and no value read can set an
attribute the live objects do not have (a scheduler's `load_state_dict` sets every key it is
given); nothing read can execute code.
"""

from __future__ import annotations

import math
import os

import torch

from dflash_ipc.run.checkpoints import STATE_JSON, STATE_TENSORS, read_json_file, write_json_file
from dflash_ipc.errors import DamagedCheckpointError

FORMAT = 1
# Per-parameter state keys of the optimizers the drafter uses (drafter/optimizers.py).
OPTIMIZER_STATE_KEYS = ("step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq",  # AdamW
                        "momentum_buffer")                                   # Muon
SIGNED_GROUP_KEYS = ("ns_coefficients",)  # Muon's Newton-Schulz polynomial (3.4445, -4.775, 2.0315)


def write_training_state(directory: str, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                         scheduler, step: int, total_steps: int, extra: dict, model_state: dict | None = None,
                         optimizer_state: dict | None = None) -> None:
    """Writes `training_state.safetensors` and `training_state.json` into `directory`
    (`model_state`, `optimizer_state`: the full states when the model is sharded, in the
    format of `state_dict()`; drafter/sharding.py gathers them)."""
    from safetensors.torch import save_file

    model_state = model.state_dict() if model_state is None else model_state
    tensors = {f"model.{n}": t.detach().to("cpu").contiguous() for n, t in model_state.items()}
    opt = optimizer.state_dict() if optimizer_state is None else optimizer_state
    plain_state: dict[str, dict] = {}
    for index, entries in opt["state"].items():
        for key, value in entries.items():
            if isinstance(value, torch.Tensor):
                tensors[f"optimizer.{index}.{key}"] = value.detach().to("cpu").contiguous()
            else:
                plain_state.setdefault(str(index), {})[key] = value
    tensors["rng.torch"] = torch.get_rng_state()
    save_file(tensors, os.path.join(directory, STATE_TENSORS), metadata={"format": str(FORMAT)})
    meta = {"format": FORMAT, "step": step, "total_steps": total_steps, "scheduler": scheduler.state_dict(),
            "param_groups": opt["param_groups"], "optimizer_plain_state": plain_state, "extra": extra}
    write_json_file(os.path.join(directory, STATE_JSON), _jsonable(meta))


def read_training_state(directory: str, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                        device: torch.device, scheduler=None) -> tuple[dict, dict, torch.Tensor, dict]:
    """(model state, optimizer state, rng state, json meta) of a verified checkpoint, each
    checked against the live model, optimizer and (when given) scheduler."""
    from safetensors import SafetensorError, safe_open

    path = os.path.join(directory, STATE_TENSORS)
    json_path = os.path.join(directory, STATE_JSON)
    meta = read_json_file(json_path, "training state")
    if meta.get("format") != FORMAT:
        raise DamagedCheckpointError(f"{json_path}: format {meta.get('format')!r:.40}, this code reads {FORMAT}")
    _check_meta(json_path, meta, scheduler)
    try:
        with safe_open(path, framework="pt", device="cpu") as f:
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except (OSError, SafetensorError, ValueError, RuntimeError) as exc:
        raise DamagedCheckpointError(f"{path}: unreadable ({str(exc)[:200]})") from None
    model_state = _model_state(path, tensors, model, device)
    optimizer_state = _optimizer_state(path, json_path, tensors, meta, optimizer, device)
    rng = tensors.get("rng.torch")
    live_rng = torch.get_rng_state()
    if rng is None or rng.dtype != live_rng.dtype or rng.shape != live_rng.shape:
        raise DamagedCheckpointError(f"{path}: rng.torch missing or not a {live_rng.dtype} {tuple(live_rng.shape)}")
    return model_state, optimizer_state, rng, meta


def _check_meta(path: str, meta: dict, scheduler) -> None:
    for key, low in (("step", 0), ("total_steps", 1)):
        value = meta.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value < 1 << 62:
            raise DamagedCheckpointError(f"{path}: field {key} must be an integer >= {low}, got {value!r:.40}")
    if not isinstance(meta.get("extra", {}), dict):
        raise DamagedCheckpointError(f"{path}: field extra must be an object")
    if not isinstance(meta.get("scheduler"), dict):
        raise DamagedCheckpointError(f"{path}: field scheduler must be an object")
    if scheduler is not None:
        _check_like(meta["scheduler"], scheduler.state_dict(), f"{path}: scheduler")


def _check_like(value, live, where: str, *, flags: bool = False, low: float = -math.inf) -> None:
    """`value` (read from JSON) is shaped like `live` (what this process writes): a dict has
    no key `live` lacks, a list the same length, a scalar the same kind (int, float, bool,
    str, None), a number is finite and >= `low`. `flags`: None and bool stand for each other
    (optimizer flags such as `foreach` are either, by torch version)."""
    if isinstance(live, dict):
        if not isinstance(value, dict):
            raise DamagedCheckpointError(f"{where}: expected an object")
        for key, v in value.items():
            if key not in live:
                raise DamagedCheckpointError(f"{where}: unknown key {key!r:.60}; allowed: {', '.join(map(str, live))}")
            _check_like(v, live[key], f"{where}.{key}", flags=flags, low=low)
    elif isinstance(live, (list, tuple)):
        if not isinstance(value, list) or len(value) != len(live):
            raise DamagedCheckpointError(f"{where}: expected a list of {len(live)}")
        for i, (v, w) in enumerate(zip(value, live)):
            _check_like(v, w, f"{where}[{i}]", flags=flags, low=low)
    elif flags and (live is None or isinstance(live, bool)):
        if value is not None and not isinstance(value, bool):
            raise DamagedCheckpointError(f"{where}: expected true, false or null, got {value!r:.40}")
    elif isinstance(live, bool) or live is None or isinstance(live, str):
        if type(value) is not type(live):
            raise DamagedCheckpointError(f"{where}: expected {type(live).__name__}, got {value!r:.40}")
    elif isinstance(live, (int, float)):
        kinds = (int,) if isinstance(live, int) else (int, float)
        if isinstance(value, bool) or not isinstance(value, kinds) or not math.isfinite(value) or value < low:
            raise DamagedCheckpointError(f"{where}: expected a finite {type(live).__name__} >= {low:g}, "
                                         f"got {value!r:.40}")


def _model_state(path: str, tensors: dict, model: torch.nn.Module, device) -> dict:
    live = model.state_dict()
    stored = {n[len("model."):]: t for n, t in tensors.items() if n.startswith("model.")}
    if set(stored) != set(live):
        raise DamagedCheckpointError(f"{path}: model tensors differ from this drafter's (missing "
                                     f"{sorted(set(live) - set(stored))[:3]}, unexpected {sorted(set(stored) - set(live))[:3]})")
    for name, t in stored.items():
        if t.shape != live[name].shape or t.dtype.is_floating_point != live[name].dtype.is_floating_point:
            raise DamagedCheckpointError(f"{path}: model.{name} is {t.dtype} {tuple(t.shape)}, "
                                         f"this drafter's is {live[name].dtype} {tuple(live[name].shape)}")
    return {n: t.to(device) for n, t in stored.items()}


def _optimizer_state(path: str, json_path: str, tensors: dict, meta: dict, optimizer, device) -> dict:
    groups = meta.get("param_groups")
    live_groups = optimizer.state_dict()["param_groups"]
    if not isinstance(groups, list) or [g.get("params") if isinstance(g, dict) else None for g in groups] != \
            [g["params"] for g in live_groups]:
        raise DamagedCheckpointError(f"{json_path}: optimizer parameter groups differ from this drafter's")
    for i, (group, live) in enumerate(zip(groups, live_groups)):
        if not isinstance(group, dict):
            raise DamagedCheckpointError(f"{json_path}: param_groups[{i}]: expected an object")
        for key, value in group.items():  # rates, decays, betas are >= 0; Muon's polynomial is signed
            if key != "params":
                _check_like({key: value}, {k: v for k, v in live.items() if k != "params"},
                            f"{json_path}: param_groups[{i}]", flags=True,
                            low=-math.inf if key in SIGNED_GROUP_KEYS else 0.0)
    params = {i: p for group, live in zip(optimizer.param_groups, live_groups) for i, p in zip(live["params"], group["params"])}
    state: dict[int, dict] = {}
    for name, t in tensors.items():
        if not name.startswith("optimizer."):
            continue
        index, key = _state_key(path, name, params)
        target = params[index]
        want = () if key == "step" else tuple(target.shape)
        if tuple(t.shape) != want or not t.dtype.is_floating_point:
            raise DamagedCheckpointError(f"{path}: {name} is {t.dtype} {tuple(t.shape)}, the optimizer keeps a "
                                         f"float {want}")
        state.setdefault(index, {})[key] = t.to(device) if key != "step" else t
    plain_state = meta.get("optimizer_plain_state") or {}
    if not isinstance(plain_state, dict):
        raise DamagedCheckpointError(f"{json_path}: optimizer_plain_state must be an object")
    for index, plain in plain_state.items():
        _check_like(plain, dict.fromkeys(OPTIMIZER_STATE_KEYS, 0.0), f"{json_path}: optimizer_plain_state.{index:.20}")
        state.setdefault(_state_key(json_path, f"optimizer.{index}.step", params)[0], {}).update(plain)
    for group, live in zip(groups, live_groups):  # JSON has no tuples: betas, ns_coefficients
        for key, value in live.items():
            if isinstance(value, tuple) and isinstance(group.get(key), list):
                group[key] = tuple(group[key])
    return {"state": state, "param_groups": groups}


def _state_key(path: str, name: str, params: dict) -> tuple[int, str]:
    """(parameter index, optimizer state key) of `optimizer.<index>.<key>`."""
    _, index, key = (name.split(".", 2) + ["", ""])[:3]
    if not index.isdigit() or int(index) not in params or key not in OPTIMIZER_STATE_KEYS:
        raise DamagedCheckpointError(f"{path}: {name[:80]!r} names no optimizer state of a parameter "
                                     f"(optimizer.<0..{len(params) - 1}>.<{'|'.join(OPTIMIZER_STATE_KEYS)}>)")
    return int(index), key


def _jsonable(value):
    """Tuples as lists, tensors refused: what json.dump writes is exactly what was meant."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, torch.Tensor):
        raise TypeError("a tensor in the JSON part of the training state")
    return value
