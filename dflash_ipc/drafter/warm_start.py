"""`drafter.init_from`: a fresh job's drafter starts from an exported drafter's weights.

The export is a DFlash inference directory (`config.json` + `model.safetensors`: ours from
`dflash-ipc export`, or a published z-lab one). Only the weights are taken: the optimizer,
schedule and step start fresh. The export must be the drafter this job would build, so
that its weights mean the same thing here: the same captured target layers, block size and
mask token (what the drafter reads and predicts), the same widths and depth (the tensor
shapes). Every difference is named in one error, the export's value and the job's side by
side. A job that resumes from a checkpoint ignores `init_from` (drafter/loop.py): the
checkpoint already holds weights trained further.
"""

from __future__ import annotations

import logging
import os

import torch

from dflash_ipc.config.schema import JobConfig
from dflash_ipc.drafter.inference_format import CONFIG_FILE, load_inference_checkpoint
from dflash_ipc.drafter.model import DFlashConfig
from dflash_ipc.errors import ConfigError, DataError
from dflash_ipc.hf.hub import is_hub_id, resolve_model
from dflash_ipc.run.checkpoints import CheckpointStore
from dflash_ipc.run.json_files import read_json_object

log = logging.getLogger(__name__)

# (name in the export's config.json, DFlashConfig field): what must agree with the job.
CHECKED_FIELDS: tuple[tuple[str, str], ...] = (
    ("dflash_config.target_layer_ids", "target_layer_ids"),
    ("block_size", "block_size"),
    ("dflash_config.mask_token_id", "mask_token_id"),
    ("hidden_size", "hidden_size"),
    ("num_hidden_layers", "num_hidden_layers"),
    ("num_target_layers", "num_target_layers"),
    ("intermediate_size", "intermediate_size"),
    ("num_attention_heads", "num_attention_heads"),
    ("num_key_value_heads", "num_key_value_heads"),
    ("head_dim", "head_dim"),
    ("layer_types", "layer_types"),
    ("sliding_window", "sliding_window"),
)
# The job's key a user changes to match, where the job's value comes from the config.
JOB_KEYS = {"target_layer_ids": "model.target_layer_ids", "block_size": "model.block_size",
            "mask_token_id": "model.mask_token_id", "num_hidden_layers": "model.num_layers",
            "layer_types": "model.layer_types", "sliding_window": "model.sliding_window"}


def export_config(path: str) -> DFlashConfig:
    """The DFlashConfig of the export at `path` (DataError when it is not one)."""
    cfg_path = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(cfg_path):
        raise DataError(f"drafter.init_from: {cfg_path} is missing (not a drafter export directory: "
                        f"`dflash-ipc export` writes config.json + model.safetensors)")
    return DFlashConfig.from_hf_dict(read_json_object(cfg_path, "drafter config"), source=cfg_path)


def mismatches(export: DFlashConfig, job: DFlashConfig) -> list[str]:
    """Each checked field on which the export and the job differ, as 'name: export X, job Y'."""
    out = []
    for name, field in CHECKED_FIELDS:
        if field == "layer_types" and export.num_hidden_layers != job.num_hidden_layers:
            continue  # one type per layer: the layer count's own mismatch says it
        theirs, ours = getattr(export, field), getattr(job, field)
        if theirs != ours:
            key = f" ({JOB_KEYS[field]})" if field in JOB_KEYS else " (from target.path)"
            out.append(f"{name}: export {theirs}, job {ours}{key}")
    return out


def check_fits(path: str, job: DFlashConfig) -> None:
    """ConfigError naming every difference between the export at `path` and the job's drafter."""
    diff = mismatches(export_config(path), job)
    if diff:
        raise ConfigError(f"drafter.init_from: {path} is not a drafter of this job's shape: " + "; ".join(diff)
                          + ". Set the job's keys to the export's values, or train without drafter.init_from")


def read_init_weights(path: str, job: DFlashConfig) -> dict[str, torch.Tensor]:
    """The export's weights (float32, on the host), after `check_fits`; `path` may be a Hub id."""
    path = resolve_model(path, what="drafter.init_from")
    check_fits(path, job)
    model = load_inference_checkpoint(path, dtype=torch.float32)  # names, shapes, dtypes checked
    return {name: t.detach() for name, t in model.state_dict().items()}


def resolve_init_from(cfg: JobConfig, target_config) -> None:
    """At start (cli `resolved`, every stage): `drafter.init_from` as an absolute path (a Hub id:
    its snapshot in the cache), checked against the job's drafter before any child starts.
    Skipped when the run directory holds checkpoints: a resume ignores it."""
    if CheckpointStore(cfg.files.checkpoints).steps_on_disk():
        log.info("drafter.init_from=%s: %s holds checkpoints, the job resumes from them (init_from ignored)",
                 cfg.drafter.init_from, cfg.files.checkpoints)
        return
    name = cfg.drafter.init_from
    if not is_hub_id(name) and not os.path.isdir(name):  # said here with what makes one, before resolve_model
        raise ConfigError(f"drafter.init_from: {os.path.abspath(name)} is not a directory (an exported drafter: "
                          f"`dflash-ipc export CHECKPOINT DIR` writes one; or a Hub id ORG/NAME)")
    path = os.path.abspath(resolve_model(name, what="drafter.init_from"))
    cfg.drafter.init_from = path
    check_fits(path, DFlashConfig.from_target_config(
        target_config, num_draft_layers=cfg.model.num_layers, block_size=cfg.model.block_size,
        mask_token_id=cfg.model.mask_token_id, target_layer_ids=cfg.model.target_layer_ids,
        layer_types=cfg.model.layer_types, sliding_window=cfg.model.sliding_window))
