"""A target over K devices: transformers' own tensor parallelism, and the checks before it.

With `target.gpus_per_worker: K > 1` one target worker is K processes, ranks 0..K-1 of a
torch.distributed group of their own (`worker_group.py`). Each loads the target with
`from_pretrained(..., distributed_config=DistributedConfig(tp_size=K))`: the model's own
tensor-parallel plan (its config class's `base_model_tp_plan`) splits attention heads and
MLP columns across the ranks while the weights load, so each process reads and holds 1/K of
every layer, and each layer's output is all-reduced: the residual stream, which is what the
capture keeps, is whole on every rank. With `target.expert_parallel` a MoE target's experts are
placed whole on the ranks instead (`ep_size=K`, the config's `base_model_ep_plan`; at inference
transformers runs each rank's experts on the shared batch and sums their outputs). Nothing
here shards a weight by hand.

    check_tensor_parallel(cfg.target, target_config, cfg.target.path)   # at start: ConfigError
    with bound_device(device):
        model = AutoModel.from_pretrained(path, **load_kwargs(k, expert_parallel))

transformers binds a tensor-parallel process to `cuda:$LOCAL_RANK` (it assumes torchrun's
layout), so `bound_device` sets LOCAL_RANK to this process's own GPU index for the load: a
worker's GPUs need not start at cuda:0. transformers (5.x) loads with a device map here and
refuses to without the `accelerate` package, which the check asks for by name.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import os
from typing import Any

from dflash_ipc.errors import ConfigError
from dflash_ipc.hf.text_stack import text_config

LOCAL_RANK_ENV = "LOCAL_RANK"


def tp_plan_of(config: Any) -> dict:
    """The tensor-parallel plan transformers has for this target's text stack ({}: none)."""
    return dict(getattr(text_config(config), "base_model_tp_plan", None) or {})


def ep_plan_of(config: Any) -> dict:
    """The expert-parallel plan transformers has for this target's text stack ({}: none)."""
    return dict(getattr(text_config(config), "base_model_ep_plan", None) or {})


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_tensor_parallel(target_cfg, config: Any, path: str) -> None:
    """ConfigError unless `target.gpus_per_worker` K can split this target: transformers has
    a TP plan for it (EP plan with `target.expert_parallel`), K divides its attention heads,
    KV heads (and experts), and accelerate is installed. K = 1: nothing to check."""
    k = target_cfg.gpus_per_worker
    if k == 1:
        return
    import transformers
    text = text_config(config)
    name = f"{path} ({getattr(text, 'model_type', '?')}, {type(text).__name__})"
    if not tp_plan_of(config):
        raise ConfigError(f"target.gpus_per_worker={k}: {name} has no tensor-parallel plan in transformers "
                          f"{transformers.__version__} (its config has no base_model_tp_plan), so it cannot be split "
                          "across GPUs; use target.gpus_per_worker: 1")
    heads = {key: getattr(text, key, None) for key in ("num_attention_heads", "num_key_value_heads")}
    counts = [int(v) for v in heads.values() if isinstance(v, int) and v > 0]
    if target_cfg.expert_parallel:
        if not ep_plan_of(config):
            raise ConfigError(f"target.expert_parallel: {name} has no expert-parallel plan in transformers "
                              f"{transformers.__version__} (no base_model_ep_plan); set it to false")
        experts = getattr(text, "num_experts", None) or getattr(text, "num_local_experts", None)
        heads["experts"] = experts
        counts += [int(experts)] if experts else []
    if counts and any(c % k for c in counts):
        allowed = [d for d in _divisors(math.gcd(*counts)) if d > 1]
        raise ConfigError(f"target.gpus_per_worker={k}: {name} has {', '.join(f'{v} {key}' for key, v in heads.items() if v)}, "
                          f"which {k} ranks cannot split evenly; allowed: {', '.join(map(str, allowed)) or 'none'}")
    if importlib.util.find_spec("accelerate") is None:
        raise ConfigError(f"target.gpus_per_worker={k}: transformers {transformers.__version__} loads a tensor-parallel "
                          "model only with the accelerate package installed: pip install 'dflash-ipc[tp]' "
                          "(or pip install accelerate)")


def load_kwargs(k: int, expert_parallel: bool = False) -> dict:
    """`from_pretrained` arguments for rank-local loading over the K ranks of the current
    (default) process group: {} for K = 1."""
    if k == 1:
        return {}
    from transformers.distributed import DistributedConfig
    return {"distributed_config": DistributedConfig(tp_size=k, ep_size=k if expert_parallel else None)}


@contextlib.contextmanager
def bound_device(device: str):
    """LOCAL_RANK = this process's GPU index while transformers loads (it binds cuda:LOCAL_RANK)."""
    if not device.startswith("cuda:"):
        yield
        return
    before = os.environ.get(LOCAL_RANK_ENV)
    os.environ[LOCAL_RANK_ENV] = device.split(":")[1]
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(LOCAL_RANK_ENV, None)
        else:
            os.environ[LOCAL_RANK_ENV] = before
