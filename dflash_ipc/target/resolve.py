"""The resolution of a config into the job every process runs.

`resolve_job` runs once, in the supervisor (or a standalone stage), after the embedded
default's assets are built (`builtin.assets.materialize`): it fills what derives from the
target (captured layer ids, mask token id: target/defaults.py) and checks that data and
target agree. The result is written
to the run directory's `config.yaml`; every worker reads that file, so all processes run one
job.
"""

from __future__ import annotations

import copy
import logging
import os

from dflash_ipc.config.schema import BUILTIN_SYNTHETIC_DATA, BUILTIN_TINY_TARGET, JobConfig
from dflash_ipc.errors import ConfigError, DataError
from dflash_ipc.hf.hub import resolve_model

log = logging.getLogger(__name__)

def resolve_job(cfg: JobConfig) -> JobConfig:
    """A copy of `cfg` with built-in assets built and derived fields filled and checked."""
    from dflash_ipc.data.dataset import TokenDataset
    from dflash_ipc.hf.target_config import load_target_config
    from dflash_ipc.hf.text_stack import text_config
    from dflash_ipc.target.defaults import fill_layer_ids, fill_mask_token_id, warn_beyond_positions
    from dflash_ipc.target.tensor_parallel import check_tensor_parallel

    for key, path in (("target.path", cfg.target.path), ("data.path", cfg.data.path)):
        if path in (BUILTIN_TINY_TARGET, BUILTIN_SYNTHETIC_DATA):
            raise ConfigError(f"{key}: {path} names an embedded asset, which builtin.assets.materialize "
                              "builds before the job is resolved")
    cfg = copy.deepcopy(cfg)
    cfg.target.path = os.path.abspath(resolve_model(cfg.target.path, what="target.path"))
    target_config = load_target_config(cfg.target.path)
    check_tensor_parallel(cfg.target, target_config, cfg.target.path)  # target.gpus_per_worker > 1
    fill_layer_ids(cfg.model, target_config)
    cfg.data.path = os.path.abspath(cfg.data.path)
    dataset = TokenDataset(cfg.data.path)
    dataset.check_tokenizer(cfg.target.path)
    dataset.check_token_ids(int(text_config(target_config).vocab_size), source=f"the target {cfg.target.path}")
    fill_mask_token_id(cfg.model, target_config, cfg.target.path, dataset)
    warn_beyond_positions(cfg.data.max_length, target_config)
    longest = int(dataset.lengths.max()) if len(dataset) else 0
    if longest > cfg.data.max_length:
        raise DataError(f"{cfg.data.path}: longest sample has {longest} tokens, above the largest "
                        f"bucket boundary data.bucket_boundaries[-1]={cfg.data.max_length}; raise it or "
                        f"prepare the data with --max-length {cfg.data.max_length}")
    cfg.run.run_dir = os.path.abspath(cfg.run.run_dir)
    check_run_dir(cfg.run.run_dir)
    return cfg


def check_run_dir(run_dir: str) -> None:
    """The run directory is a directory (or can become one) that this user may write."""
    if os.path.exists(run_dir) and not os.path.isdir(run_dir):
        raise ConfigError(f"run.run_dir: {run_dir} exists and is not a directory")
    parent = run_dir
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise ConfigError(f"run.run_dir: {run_dir} cannot be made: {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"run.run_dir: {parent} is not writable by this user")
