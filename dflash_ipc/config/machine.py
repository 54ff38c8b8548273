"""This machine's devices against the ones a job names: a GPU the config lists must exist.

Checked by the supervisor before any child starts (`check_job_devices`: a missing GPU is a
configuration error no restart can cure) and again by each worker for its own device
(`require_device`), so the supervisor itself never initialises CUDA.
"""

from __future__ import annotations

from dflash_ipc.config.schema import JobConfig, gpu_index
from dflash_ipc.errors import ConfigError


def check_node_fits(cfg: JobConfig, device_count: int) -> None:
    """ConfigError when this node's workers need GPUs it does not have, naming which GPUs the
    target workers (of gpus_per_worker processes each) and the drafters are placed on."""
    k = cfg.target.gpus_per_worker
    target = {d for r in cfg.local_ranks("target") for d in cfg.target.devices_of(r) if d.startswith("cuda")}
    drafter = {cfg.drafter.device_of(r) for r in cfg.local_ranks("drafter")} - {"cpu"}
    missing = sorted((d for d in target | drafter if gpu_index(d) >= device_count), key=gpu_index)
    if missing:
        have = f"cuda:0..cuda:{device_count - 1}" if device_count else "none"

        def on(gpus: set[str]) -> str:
            return f"{len(gpus)} GPU{'s' if len(gpus) != 1 else ''} ({', '.join(sorted(gpus, key=gpu_index))})"

        def count(n: int, what: str) -> str:
            return f"{n} {what}{'s' if n != 1 else ''}"

        per_worker = f" of target.gpus_per_worker={k} processes" if k > 1 else ""
        raise ConfigError(f"target.devices/drafter.devices: this node's job needs {len(target | drafter)} GPUs "
                          f"({count(len(cfg.local_ranks('target')), 'target worker')}{per_worker} on {on(target)}, "
                          f"{count(len(cfg.local_ranks('drafter')), 'drafter')} on {on(drafter)}"
                          f"{', shared' if target & drafter else ''}) but "
                          f"this machine has {device_count} ({have}): {', '.join(missing)} do not exist")


def check_job_devices(cfg: JobConfig) -> None:
    """Every device this node's workers use exists (before any child starts: a missing GPU
    is a configuration error, and no restart can cure it)."""
    if any(d.startswith("cuda") for d in cfg.target.devices + cfg.drafter.devices):
        import torch
        check_node_fits(cfg, torch.cuda.device_count() if torch.cuda.is_available() else 0)
    for key, section in (("target.devices", cfg.target), ("drafter.devices", cfg.drafter)):
        for device in sorted(set(section.devices)):
            require_device(device, key)


def check_device(device: str, key: str) -> None:
    """ConfigError unless `device` is `cpu` or `cuda:N` of a GPU this machine has."""
    if device != "cpu" and not (device.startswith("cuda:") and device[5:].isdigit()):
        raise ConfigError(f"{key}: {device!r}; allowed: cpu or cuda:N")
    require_device(device, key)


def require_device(device: str, key: str) -> None:
    """ConfigError when `device` names a GPU this machine does not have (checked in the worker
    that uses it, so the supervisor itself never initialises CUDA)."""
    if not device.startswith("cuda"):
        return
    import torch
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    index = int(device.split(":")[1])
    if index >= count:
        raise ConfigError(f"{key}: {device} does not exist on this machine ({count} CUDA devices: "
                          f"allowed cuda:0..cuda:{count - 1})" if count else
                          f"{key}: {device} asked for, but this machine has no CUDA device")
