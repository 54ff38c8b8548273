"""Whether the configured lengths fit the device: checked when a worker starts, on GPUs.

A 32K-token bucket changes what a worker holds: the target's slot pool and its forward pass
grow with `data.token_budget` and the longest bucket (eager attention with its square), the
drafter's step with the context of its longest sequences, its queue with `fifo_sequences`
times their length. Found out an hour into a job, that is an out-of-memory crash; here it is a
ConfigError at start that names the settings to change:

- target: the slot pool's exact size against the memory left after the model, then one
  forward pass of the heaviest batch the planner can make (`heaviest_target_batch`: the
  largest bucket, as many sequences as the budget allows) into a slot;
- drafter: forward and backward of the heaviest step the data can give (its longest samples,
  in take order until the step's anchors are full), plus what that probe does not hold yet:
  the AdamW state (two float32 copies of the weights) and the queue at the data's mean length
  (`drafter_queue_bytes`); a warning when the queue's worst case would not fit.

On CPU nothing is probed (there is no device memory to ask, and no out-of-memory to catch).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from dflash_ipc.errors import ConfigError

log = logging.getLogger(__name__)

GIB = 1024**3
USABLE = 0.95  # of a device's capacity: the allocator's fragmentation and the CUDA context


def gib(nbytes: float) -> str:
    return f"{nbytes / GIB:.1f} GiB"


def device_capacity(device: torch.device) -> int:
    """Bytes this process can hold on `device`: free memory plus what its allocator holds."""
    free, _ = torch.cuda.mem_get_info(device)
    return int(free + torch.cuda.memory_reserved(device))


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


@dataclass(frozen=True)
class QueueBytes:
    """Features a drafter's queue holds: at the data's mean length, and at its worst."""

    typical: int
    worst: int


def drafter_queue_bytes(lengths: np.ndarray, cfg, feature_bytes: int) -> QueueBytes:
    """The queue holds up to `drafter.fifo_sequences` sequences, plus up to `drafter.prefetch`
    batches arriving (each at most `data.token_budget` tokens); `feature_bytes` per token."""
    n = min(cfg.drafter.fifo_sequences, len(lengths))
    arriving = cfg.drafter.prefetch * cfg.data.token_budget
    longest = np.sort(np.asarray(lengths, dtype=np.int64))[::-1][:n]
    return QueueBytes(typical=int((n * float(np.mean(lengths)) + arriving) * feature_bytes),
                      worst=int((int(longest.sum()) + arriving) * feature_bytes))


def heaviest_step_samples(dataset, cfg) -> list[tuple[int, int]]:
    """(sample id, anchors) of the step with the most context: the longest samples, taken as
    the trainer takes them until `objective.anchors_per_step` anchors are full."""
    from dflash_ipc.drafter.trainer import eligible_anchor_count
    budget, out = cfg.objective.anchors_per_step, []
    for i in np.argsort(-dataset.lengths, kind="stable"):
        anchors = eligible_anchor_count(dataset.sample(int(i))[1], cfg.objective.max_anchors_per_seq)
        if anchors:
            out.append((int(i), min(anchors, budget)))
            budget -= out[-1][1]
        if budget <= 0:
            break
    return out


def heaviest_step(trainer, dataset, cfg, feature_dtype: torch.dtype) -> tuple[list, str]:
    """The heaviest step's (Sequence, anchors) pairs, random features on the trainer's device,
    and a description of it for messages."""
    from dflash_ipc.drafter.trainer import Sequence
    config = trainer.model.config
    width = config.num_context_features * config.hidden_size
    gen = torch.Generator(device=trainer.device).manual_seed(0)
    chosen = []
    for sample_id, anchors in heaviest_step_samples(dataset, cfg):
        ids, mask = dataset.sample(sample_id)
        features = torch.randn(len(ids), width, device=trainer.device, dtype=feature_dtype, generator=gen)
        chosen.append((Sequence(batch_id=-1, epoch=0, sample_id=sample_id, features=features,
                                input_ids=torch.from_numpy(ids.astype("int64")),
                                loss_mask=torch.from_numpy(mask.astype(bool)), num_anchors=anchors), anchors))
    if not chosen:
        return [], "no sample has an anchor"
    lengths = [len(s.input_ids) for s, _ in chosen]
    return chosen, (f"{len(chosen)} sequences of {min(lengths)}..{max(lengths)} tokens, "
                    f"{sum(a for _, a in chosen)} anchors")


def forward_backward(trainer, chosen) -> None:
    """The step's forward and backward as `DrafterTrainer.step` runs them, without its
    collectives and its optimizer step; the gradients are dropped, the weights unchanged."""
    try:
        batch, features, mask, _ = trainer._build(chosen)
        trainer.loss_sum(batch, features, mask).backward()
    finally:
        trainer.model.zero_grad(set_to_none=True)


def probe_drafter_step(trainer, dataset, cfg, feature_dtype: torch.dtype) -> None:
    """Forward and backward of the heaviest step, then the memory it leaves out; ConfigError
    when the sum cannot fit."""
    dev = trainer.device
    if dev.type != "cuda":
        return
    chosen, what = heaviest_step(trainer, dataset, cfg, feature_dtype)
    if not chosen:
        return
    width_bytes = chosen[0][0].features.shape[1] * feature_dtype.itemsize
    torch.cuda.reset_peak_memory_stats(dev)
    try:
        forward_backward(trainer, chosen)
        torch.cuda.synchronize(dev)
    except torch.OutOfMemoryError:
        raise ConfigError(f"drafter on {dev}: the heaviest step of the data ({what}) runs out of memory; lower "
                          "objective.anchors_per_step or the largest bucket (data.bucket_boundaries)") from None
    finally:
        del chosen
    _check_drafter_total(trainer, dataset, cfg, what, width_bytes)


def _check_drafter_total(trainer, dataset, cfg, what: str, feature_bytes: int) -> None:
    from dflash_ipc.drafter.sharding import local_numel
    dev = trainer.device
    peak = torch.cuda.max_memory_allocated(dev)
    # this rank's share: 1/N of each parameter under drafter.sharding=fsdp
    adam = 2 * sum(local_numel(p) * 4 for p in trainer.model.parameters() if p.requires_grad)
    queue = drafter_queue_bytes(dataset.lengths, cfg, feature_bytes)
    usable = USABLE * device_capacity(dev)
    need = peak + adam + queue.typical
    parts = (f"step peak {gib(peak)} ({what}), AdamW state {gib(adam)}, queue {gib(queue.typical)} "
             f"(drafter.fifo_sequences={cfg.drafter.fifo_sequences} at the data's mean length "
             f"{float(np.mean(dataset.lengths)):,.0f} tokens)")
    if need > usable:
        raise ConfigError(f"drafter on {dev}: needs {gib(need)} but {gib(usable)} are usable: {parts}; lower "
                          "drafter.fifo_sequences, objective.anchors_per_step or the largest bucket")
    if peak + adam + queue.worst > usable:
        log.warning("drafter on %s: %s; a queue of the data's %d longest sequences would hold %s and not fit: "
                    "lower drafter.fifo_sequences if the drafter runs out of memory", dev, parts,
                    min(cfg.drafter.fifo_sequences, len(dataset)), gib(queue.worst))
    log.info("drafter on %s: fits, %s of %s usable: %s", dev, gib(need), gib(usable), parts)

