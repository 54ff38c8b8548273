"""`drafter.sharding: fsdp`: FSDP2 over the drafter group, with the step and checkpoints of `none`.

A drafter of a 70B target (hidden 8192) has several billion trainable parameters; with plain
data parallelism every rank holds all of them plus their float32 AdamW moments. FSDP2
(`torch.distributed.fsdp.fully_shard`, each decoder layer then the root) keeps 1/N of the
parameters, gradients and optimizer state on each of the N ranks, all-gathering a layer's
parameters for its forward and backward and reduce-scattering its gradients.

    shard_model(model, device)                              # before the optimizer is built
    state = full_state(model, optimizer)                    # collective; the whole state on rank 0
    load_full_state(model, optimizer, model_state, optimizer_state)   # every rank: its shards

The same step: the trainer normalises each rank's loss by the weight sum of all ranks and
sums the gradients (drafter/trainer.py); FSDP2 would average them, so the gradient divide
factor is 1 and its reduce-scatter a plain sum. Parameters stay float32 under autocast, as without
sharding, so the numbers are the same up to the order of the float additions. A rank without
blocks in a step still runs a forward and backward (FSDP's collectives are inside them) on a
one-anchor batch whose loss weights are zero: its gradients are exactly zero.

The same checkpoints: the full model and optimizer state are gathered on rank 0
(`get_model_state_dict` / `get_optimizer_state_dict` with `full_state_dict`) and written in
the format of an unsharded rank (training_state.py): optimizer state keyed by the parameter's
position, in `model.parameters()` order, not by name. Loading gives each rank the full state
and `set_model_state_dict` / `set_optimizer_state_dict` keep its own shards of it; a checkpoint
of either mode resumes in the other.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)

log = logging.getLogger(__name__)

_GATHER = StateDictOptions(full_state_dict=True, cpu_offload=True)  # full tensors, on rank 0's host
_SCATTER = StateDictOptions(full_state_dict=True)                   # a full state in, local shards kept


def shard_model(model: torch.nn.Module, device: torch.device) -> None:
    """fully_shard each decoder layer, then the root (fc, norms), over all ranks of the
    default group, with gradients summed (divide factor 1), not averaged."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    # A plain SUM reduce-scatter in every sharded module (each has its own setting): divide
    # factor 1, and no PREMUL_SUM op (gloo has none), so the post-division by 1 is skipped too.
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    log.info("drafter sharded with FSDP2 over %d ranks", dist.get_world_size())


def _trainable_names(model: torch.nn.Module) -> list[str]:
    """Parameter names in the optimizer's order (the trainer builds it from model.parameters())."""
    return [name for name, p in model.named_parameters() if p.requires_grad]


def full_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict] | None:
    """Collective: (model state, optimizer state) in the unsharded format, on rank 0 (host
    tensors); None on the other ranks."""
    model_state = get_model_state_dict(model, options=_GATHER)
    optim = get_optimizer_state_dict(model, optimizer, options=_GATHER)
    if dist.get_rank() != 0:
        return None
    index = {name: i for i, name in enumerate(_trainable_names(model))}
    state = {index[name]: entries for name, entries in optim["state"].items()}
    groups = [dict(group, params=[index[name] for name in group["params"]]) for group in optim["param_groups"]]
    return model_state, {"state": state, "param_groups": groups}


def load_full_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, model_state: dict,
                    optimizer_state: dict) -> None:
    """Every rank, with the full state read from a checkpoint: keeps its own shards of it."""
    names = _trainable_names(model)
    optim = {"state": {names[i]: entries for i, entries in optimizer_state["state"].items()},
             "param_groups": [dict(group, params=[names[i] for i in group["params"]])
                              for group in optimizer_state["param_groups"]]}
    set_model_state_dict(model, model_state, options=_SCATTER)
    set_optimizer_state_dict(model, optimizer, optim, options=_SCATTER)


def load_full_model(model: torch.nn.Module, model_state: dict) -> None:
    """Every rank, with a full model state (a warm start): keeps its own shards of it."""
    set_model_state_dict(model, model_state, options=_SCATTER)


def local_numel(param: torch.Tensor) -> int:
    """Elements this rank holds of `param` (its shard, for a sharded parameter)."""
    return param.to_local().numel() if hasattr(param, "to_local") else param.numel()


def total_norm(norm: torch.Tensor) -> torch.Tensor:
    """`clip_grad_norm_`'s result as a plain device tensor (over sharded gradients it is a
    DTensor). Not read on the host: the step's figures are read after the next step is queued."""
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm
