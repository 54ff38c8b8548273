"""A drafter's training state as data: tensors in safetensors, everything else in JSON.

    tensors: model.<name>                  float32 master weights
             optimizer.<param index>.<key>  AdamW moments and step counters
             rng.torch                      the CPU RNG state
    json:    step, total_steps, scheduler, optimizer param_groups and the non-tensor per-
             parameter state, and `extra` (what the checkpoint commits, sequence by sequence)

Loading checks every name and shape against the live model and optimizer before anything
is copied in, so a file of another shape or a hand-edited one is a clear error, never a
silent partial load; nothing read can execute code.
"""

from __future__ import annotations

import os

import torch

from dflash_ipc.drafter.checkpoint_store import STATE_JSON, STATE_TENSORS, read_json_file, write_json_file
from dflash_ipc.errors import DamagedCheckpointError

FORMAT = 1


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
                        device: torch.device) -> tuple[dict, dict, torch.Tensor, dict]:
    """(model state, optimizer state, rng state, json meta) of a verified checkpoint, each
    checked against the live model and optimizer."""
    from safetensors import SafetensorError, safe_open

    path = os.path.join(directory, STATE_TENSORS)
    meta = read_json_file(os.path.join(directory, STATE_JSON), "training state")
    if meta.get("format") != FORMAT:
        raise DamagedCheckpointError(f"{directory}/{STATE_JSON}: format {meta.get('format')!r}, this code reads {FORMAT}")
    try:
        with safe_open(path, framework="pt", device="cpu") as f:
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except (OSError, SafetensorError, ValueError) as exc:
        raise DamagedCheckpointError(f"{path}: unreadable ({exc})") from None
    model_state = _model_state(path, tensors, model, device)
    optimizer_state = _optimizer_state(path, tensors, meta, optimizer, device)
    if "rng.torch" not in tensors:
        raise DamagedCheckpointError(f"{path}: no rng.torch")
    return model_state, optimizer_state, tensors["rng.torch"], meta


def _model_state(path: str, tensors: dict, model: torch.nn.Module, device) -> dict:
    live = model.state_dict()
    stored = {n[len("model."):]: t for n, t in tensors.items() if n.startswith("model.")}
    if set(stored) != set(live):
        raise DamagedCheckpointError(f"{path}: model tensors differ from this drafter's (missing "
                                     f"{sorted(set(live) - set(stored))[:3]}, unexpected {sorted(set(stored) - set(live))[:3]})")
    for name, t in stored.items():
        if t.shape != live[name].shape:
            raise DamagedCheckpointError(f"{path}: model.{name} has shape {tuple(t.shape)}, "
                                         f"this drafter's is {tuple(live[name].shape)}")
    return {n: t.to(device) for n, t in stored.items()}


def _optimizer_state(path: str, tensors: dict, meta: dict, optimizer, device) -> dict:
    groups = meta.get("param_groups")
    live_groups = optimizer.state_dict()["param_groups"]
    if not isinstance(groups, list) or [g.get("params") for g in groups] != [g["params"] for g in live_groups]:
        raise DamagedCheckpointError(f"{path}: optimizer parameter groups differ from this drafter's")
    params = {i: p for group, live in zip(optimizer.param_groups, live_groups) for i, p in zip(live["params"], group["params"])}
    state: dict[int, dict] = {}
    for name, t in tensors.items():
        if not name.startswith("optimizer."):
            continue
        index_text, _, key = name[len("optimizer."):].partition(".")
        index = _param_index(path, name, index_text, params)
        if not key:
            raise DamagedCheckpointError(f"{path}: tensor {name!r:.80} names no optimizer state key")
        target = params[index]
        if key.startswith("exp_avg") and t.shape != target.shape:
            raise DamagedCheckpointError(f"{path}: {name} has shape {tuple(t.shape)}, the parameter's is "
                                         f"{tuple(target.shape)}")
        state.setdefault(index, {})[key] = t.to(device) if key != "step" else t
    plain_state = meta.get("optimizer_plain_state") or {}
    if not isinstance(plain_state, dict):
        raise DamagedCheckpointError(f"{path}: optimizer_plain_state must be a JSON object")
    for index, plain in plain_state.items():
        if not isinstance(plain, dict):
            raise DamagedCheckpointError(f"{path}: optimizer_plain_state[{index!r:.40}] must be a JSON object")
        state.setdefault(_param_index(path, "optimizer_plain_state", index, params), {}).update(plain)
    for group in groups:
        if isinstance(group.get("betas"), list):
            group["betas"] = tuple(group["betas"])
    return {"state": state, "param_groups": groups}


def _param_index(path: str, what: str, index: str, params: dict) -> int:
    """The parameter index an entry of the optimizer state names, checked against the live
    optimizer's parameters."""
    if not index.isdigit() or int(index) not in params:
        raise DamagedCheckpointError(f"{path}: {what!r:.80} names no parameter of this drafter "
                                     f"(index {index!r:.20}; it has 0..{len(params) - 1})")
    return int(index)


def _jsonable(value):
    """Tuples as lists, tensors refused: what json.dump writes is exactly what was meant."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, torch.Tensor):
        raise TypeError("a tensor in the JSON part of the training state")
    return value
