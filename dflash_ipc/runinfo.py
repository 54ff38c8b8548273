"""The run directory's layout and the resolution of a config into the job every process runs.

`resolve_job` runs once, in the supervisor (or a standalone stage): it builds the embedded
default's assets on first use, fills what derives from the target (captured layer ids, mask
token id) and checks that data and target agree. The result is written to
`<run_dir>/config.yaml`; every worker reads that file, so all processes run one job.
"""

from __future__ import annotations

import copy
import hashlib
import logging
import os

from dflash_ipc.config import BUILTIN_SYNTHETIC_DATA, BUILTIN_TINY_TARGET, JobConfig
from dflash_ipc.errors import ConfigError, DataError

log = logging.getLogger(__name__)

BUILTIN_HELD_OUT_PROMPTS = 16
"""builtin:synthetic: prompts drawn like the samples but kept out of the dataset, for the
acceptance length that `up` prints at the end of the embedded default."""


def cache_dir() -> str:
    """Where built-in assets are built once and reused (DFLASH_IPC_CACHE overrides)."""
    return os.environ.get("DFLASH_IPC_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "dflash-ipc")


def run_tag(cfg: JobConfig) -> str:
    """Short stable id of the run directory; prefixes this run's shared-memory segments."""
    return hashlib.sha1(os.path.abspath(cfg.run.run_dir).encode()).hexdigest()[:10]


def shm_prefix(cfg: JobConfig) -> str:
    # Per node: nodes sharing a run directory (and, in tests, a machine) own their segments.
    node = f"-n{cfg.run.node_rank}" if cfg.run.num_nodes > 1 else ""
    return f"dflash-{run_tag(cfg)}{node}"


def pool_name(cfg: JobConfig, target_rank: int) -> str:
    return f"{shm_prefix(cfg)}-t{target_rank}"


def segments_prefix(cfg: JobConfig) -> str:
    """What every shared-memory segment of this run's node starts with, and no other's:
    the sweep prefix. `shm_prefix` alone is not one: node 1's `...-n1` also starts node 10's
    names."""
    return f"{shm_prefix(cfg)}-t"


def resolved_config_path(run_dir: str, node_rank: int = 0) -> str:
    """The config this node's processes run with (node 0's is the job's: status, health)."""
    return node_file(run_dir, "config.yaml", node_rank)


def checkpoints_dir(cfg: JobConfig) -> str:
    return os.path.join(cfg.run.run_dir, "checkpoints")


def logs_dir(cfg: JobConfig) -> str:
    return os.path.join(cfg.run.run_dir, "logs")


def processes_path(cfg: JobConfig) -> str:
    """The supervisor's record of every process it runs (read by `dflash-ipc health`)."""
    return node_file(cfg.run.run_dir, "processes.json", cfg.run.node_rank)


def node_file(run_dir: str, name: str, node_rank: int) -> str:
    """`run_dir/name` for node 0, `run_dir/<stem>-node<K><ext>` for node K: the per-node
    files of a run directory the nodes share."""
    if node_rank == 0:
        return os.path.join(run_dir, name)
    stem, ext = os.path.splitext(name)
    return os.path.join(run_dir, f"{stem}-node{node_rank}{ext}")


def resolve_job(cfg: JobConfig) -> JobConfig:
    """A copy of `cfg` with built-in assets built and derived fields filled and checked."""
    from dflash_ipc.data.dataset import TokenDataset
    from dflash_ipc.drafter.model import default_target_layer_ids
    from dflash_ipc.target.capture import load_target_config

    cfg = copy.deepcopy(cfg)
    if cfg.target.path == BUILTIN_TINY_TARGET:
        from dflash_ipc.data.tiny import build_tiny_target, tiny_target_key
        # Keyed by what the build depends on: a cache made by other code is never reused.
        cfg.target.path = build_tiny_target(os.path.join(cache_dir(), f"tiny-target-{tiny_target_key()}"))
    cfg.target.path = os.path.abspath(cfg.target.path)
    target_config = load_target_config(cfg.target.path)
    num_layers = target_config.num_hidden_layers
    if cfg.drafter.target_layer_ids is None:
        cfg.drafter.target_layer_ids = default_target_layer_ids(num_layers, cfg.drafter.num_layers)
    bad = [i for i in cfg.drafter.target_layer_ids if i >= num_layers]
    if bad:
        raise ConfigError(f"drafter.target_layer_ids: {bad} not in the target's layers 0..{num_layers - 1}")
    if cfg.drafter.mask_token_id is None:
        cfg.drafter.mask_token_id = _tokenizer_mask_id(cfg.target.path)
    if not 0 <= cfg.drafter.mask_token_id < target_config.vocab_size:
        raise ConfigError(f"drafter.mask_token_id: {cfg.drafter.mask_token_id} outside the target's "
                          f"vocabulary [0, {target_config.vocab_size})")
    if cfg.data.path == BUILTIN_SYNTHETIC_DATA:
        from dflash_ipc.data.synthetic import build_synthetic_dataset, synthetic_cache_key, synthetic_params
        d = cfg.data
        kw = dict(num_samples=d.synthetic_samples, min_len=d.synthetic_min_len, max_len=d.synthetic_max_len,
                  seed=cfg.run.seed, num_words=d.synthetic_words, num_held_out=BUILTIN_HELD_OUT_PROMPTS)
        # Keyed by everything the data depends on (the target's bytes included), so a stale
        # cache is never reused and a changed target or generator gets its own directory.
        name = f"synthetic-{synthetic_cache_key(synthetic_params(cfg.target.path, **kw))}"
        cfg.data.path = build_synthetic_dataset(cfg.target.path, os.path.join(cache_dir(), name), **kw)
    cfg.data.path = os.path.abspath(cfg.data.path)
    dataset = TokenDataset(cfg.data.path)
    dataset.check_tokenizer(cfg.target.path)
    longest = int(dataset.lengths.max()) if len(dataset) else 0
    if longest > cfg.data.max_length:
        raise DataError(f"{cfg.data.path}: longest sample has {longest} tokens, above the largest "
                        f"bucket boundary data.bucket_boundaries[-1]={cfg.data.max_length}; raise it or "
                        f"prepare the data with --max-length {cfg.data.max_length}")
    cfg.run.run_dir = os.path.abspath(cfg.run.run_dir)
    return cfg


def _tokenizer_mask_id(target_path: str) -> int:
    from transformers import AutoTokenizer
    try:
        tokenizer = AutoTokenizer.from_pretrained(target_path)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"drafter.mask_token_id is not set and no tokenizer loads from {target_path} "
                          f"({exc}); set drafter.mask_token_id") from None
    if tokenizer.mask_token_id is None:
        raise ConfigError(f"drafter.mask_token_id is not set and the tokenizer in {target_path} has no "
                          f"mask token; set drafter.mask_token_id to a token id the drafter may use as mask")
    return int(tokenizer.mask_token_id)


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
