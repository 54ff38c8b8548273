"""The embedded default's assets, built on first use and cached: a tiny target and a synthetic
chat dataset of its own greedy replies (`target.path: builtin:...`, `data.path: builtin:...`).

    cfg = resolve_job(materialize(load_config(None, [])))   # what `up` runs on the default config
"""

from __future__ import annotations

import copy
import os

from dflash_ipc.config.schema import BUILTIN_SYNTHETIC_DATA, BUILTIN_TINY_TARGET, JobConfig

BUILTIN_HELD_OUT_PROMPTS = 16
"""builtin:synthetic: prompts drawn like the samples but kept out of the dataset, for the
acceptance length that `up` prints at the end of the embedded default."""


def cache_dir() -> str:
    """Where built-in assets are built once and reused (DFLASH_IPC_CACHE overrides)."""
    return os.environ.get("DFLASH_IPC_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "dflash-ipc")


def materialize(cfg: JobConfig) -> JobConfig:
    """A copy of `cfg` whose built-in target and data are real directories (built here the
    first time); `cfg` itself when it names none."""
    if BUILTIN_TINY_TARGET != cfg.target.path and BUILTIN_SYNTHETIC_DATA != cfg.data.path:
        return cfg
    cfg = copy.deepcopy(cfg)
    if cfg.target.path == BUILTIN_TINY_TARGET:
        from dflash_ipc.builtin.tiny import build_tiny_target, tiny_target_key
        # Keyed by what the build depends on: a cache made by other code is never reused.
        cfg.target.path = build_tiny_target(os.path.join(cache_dir(), f"tiny-target-{tiny_target_key()}"))
    else:  # the synthetic data of another target reads its tokenizer: a Hub id or a missing path is resolved first
        from dflash_ipc.hf.hub import resolve_model
        cfg.target.path = resolve_model(cfg.target.path, what="target.path")
    if cfg.data.path == BUILTIN_SYNTHETIC_DATA:
        from dflash_ipc.builtin.synthetic import build_synthetic_dataset, synthetic_cache_key, synthetic_params
        b = cfg.builtin
        kw = dict(num_samples=b.samples, min_len=b.min_len, max_len=b.max_len, seed=cfg.run.seed,
                  num_words=b.words, num_held_out=BUILTIN_HELD_OUT_PROMPTS)
        # Keyed by everything the data depends on (the target's bytes included), so a stale
        # cache is never reused and a changed target or generator gets its own directory.
        name = f"synthetic-{synthetic_cache_key(synthetic_params(os.path.abspath(cfg.target.path), **kw))}"
        cfg.data.path = build_synthetic_dataset(os.path.abspath(cfg.target.path), os.path.join(cache_dir(), name), **kw)
    return cfg
