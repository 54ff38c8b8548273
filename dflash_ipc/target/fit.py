"""Whether the configured lengths fit a target's device: checked when a target starts, on GPUs.

A 32K-token bucket changes what a target holds: its slot pool and its forward pass grow with
`data.token_budget` and the longest bucket (eager attention with its square). Found out an
hour into a job, that is an out-of-memory crash; here it is a ConfigError at start that names
the settings to change: the slot pool's exact size against the memory left after the model,
then one forward pass of the heaviest batch the planner can make (`heaviest_target_batch`: the
largest bucket, as many sequences as the budget allows) into a slot. On CPU nothing is probed.
"""

from __future__ import annotations

import logging
import torch

from dflash_ipc.config.device_memory import USABLE, device_capacity, gib
from dflash_ipc.errors import ConfigError

log = logging.getLogger(__name__)


def heaviest_target_batch(data_cfg, longest: int | None = None) -> tuple[int, int]:
    """(sequences, padded length) of the planned batch with the largest activations: the
    longest sample (at most the largest bucket), padded, with as many sequences as
    `token_budget` and `max_batch_size` allow (attention memory grows with batch x length^2
    at a fixed token count)."""
    pad = data_cfg.pad_multiple
    length = data_cfg.max_length if longest is None else min(longest, data_cfg.max_length)
    padded = -(-length // pad) * pad
    return max(1, min(data_cfg.max_batch_size, data_cfg.token_budget // padded)), padded


def check_pool_fits(layout, device: str) -> None:
    """ConfigError when the slot pool cannot be allocated next to the loaded model."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return
    capacity = device_capacity(dev)
    held = torch.cuda.memory_allocated(dev)
    if layout.pool_bytes > USABLE * capacity - held:
        raise ConfigError(
            f"target on {device}: the slot pool needs {gib(layout.pool_bytes)} (target.num_slots={layout.num_slots} x "
            f"data.token_budget={layout.max_tokens} tokens x {layout.feature_dim} features x {layout.itemsize} bytes) "
            f"but only {gib(USABLE * capacity - held)} are left next to the model ({gib(held)}); lower "
            "target.num_slots or data.token_budget")


def probe_target_batch(capture, pool, data_cfg, device: str, longest: int | None = None) -> None:
    """Runs the heaviest batch (`longest`: the data's longest sample) once into slot 0
    (nothing is published; `pool` None: the forward alone); ConfigError on out-of-memory."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return
    batch, padded = heaviest_target_batch(data_cfg, longest)
    # One token everywhere: in a MoE every token then routes to the same experts, the worst
    # case of its per-expert buffers.
    ids = torch.zeros(batch, padded, dtype=torch.long, device=capture.device)
    lengths = torch.full((batch,), padded, dtype=torch.long, device=capture.device)
    lengths[-1] = padded - 1  # a padded row: the attention mask is built as in real batches
    torch.cuda.reset_peak_memory_stats(dev)
    try:
        # pool None: a follower rank of a tensor-parallel worker, whose forward writes nothing
        capture.forward_into(ids, lengths, pool.write_view(0, int(lengths.sum())) if pool is not None else None)
        torch.cuda.synchronize(dev)
    except torch.OutOfMemoryError:
        raise ConfigError(
            f"target on {device}: a batch of {batch} x {padded} tokens (the longest sample, at most the largest "
            f"bucket data.bucket_boundaries[-1]={data_cfg.max_length}; data.token_budget={data_cfg.token_budget}) runs out "
            f"of memory next to the model and the slot pool ({gib(torch.cuda.memory_allocated(dev))} held, "
            f"{capture.attn_implementation} attention); lower data.token_budget (one long sequence per batch: "
            f"token_budget = the largest bucket) or target.num_slots") from None
    log.info("target on %s: heaviest batch %d x %d tokens fits, peak %s of %s", device, batch, padded,
             gib(torch.cuda.max_memory_allocated(dev)), gib(device_capacity(dev)))
