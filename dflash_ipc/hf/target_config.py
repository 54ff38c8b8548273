"""A target checkpoint's HF config, read without running any of its code, and checks against it."""

from __future__ import annotations

import os

from transformers import AutoConfig

from dflash_ipc.errors import ConfigError


def load_target_config(path: str):
    """The target's HF config; a clear error when `path` is not a model directory that the
    installed transformers can read (custom code is never run: no trust_remote_code)."""
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ConfigError(f"target.path: {path} is not a model directory (no config.json there)")
    try:
        return AutoConfig.from_pretrained(path)
    except (ValueError, KeyError) as exc:
        import transformers
        raise ConfigError(f"target.path: {path}/config.json is not a configuration transformers "
                          f"{transformers.__version__} can read ({str(exc).splitlines()[0]}); "
                          "architectures that need trust_remote_code are not supported") from None


def check_layer_ids(layer_ids: list[int], num_layers: int, key: str = "model.target_layer_ids") -> None:
    """ConfigError unless every id names a layer of a `num_layers`-layer text stack."""
    if not layer_ids or min(layer_ids) < 0 or max(layer_ids) >= num_layers:
        raise ConfigError(f"{key}: {list(layer_ids)} reach beyond the target's {num_layers} layers "
                          f"(allowed: 0..{num_layers - 1})")
