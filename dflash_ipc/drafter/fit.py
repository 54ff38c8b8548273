"""Whether the drafter's heaviest step fits its device: checked when a drafter starts, on GPUs.

Forward and backward of the heaviest step the data can give (its longest samples, in take
order until the step's anchors are full), plus what that probe does not hold yet: the AdamW
state (two float32 copies of the weights) and the queue at the data's mean length
(`drafter_queue_bytes`); a warning when the queue's worst case would not fit. A ConfigError at
start names the settings to change. On CPU nothing is probed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from dflash_ipc.config.device_memory import USABLE, device_capacity, gib
from dflash_ipc.drafter.precision import discard_step
from dflash_ipc.errors import ConfigError

log = logging.getLogger(__name__)


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
    collectives and its optimizer step; the gradients are dropped, the weights unchanged. With
    `validation.every_steps`, as a validation step (its acceptance scoring holds a chunk of
    logits while the forward's activations are alive: the heavier step)."""
    try:
        batch, features, mask, _ = trainer._build(chosen)
        if trainer.cfg.validation.every_steps:
            trainer.loss_sum(batch, features, mask, acceptance=True)[0].backward()
        else:
            trainer.loss_sum(batch, features, mask).backward()
    finally:
        trainer.model.zero_grad(set_to_none=True)
        discard_step()  # fp8 delayed: the probe's made-up inputs set no scale


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
                          "objective.anchors_per_step, the largest bucket (data.bucket_boundaries) or the LM-head "
                          f"chunk (drafter.lm_head_chunk_gib: {trainer.ce_chunk_rows} rows now)") from None
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
                          "drafter.fifo_sequences, objective.anchors_per_step, the largest bucket or "
                          f"drafter.lm_head_chunk_gib ({trainer.ce_chunk_rows} rows per LM-head chunk now)")
    if peak + adam + queue.worst > usable:
        log.warning("drafter on %s: %s; a queue of the data's %d longest sequences would hold %s and not fit: "
                    "lower drafter.fifo_sequences if the drafter runs out of memory", dev, parts,
                    min(cfg.drafter.fifo_sequences, len(dataset)), gib(queue.worst))
    log.info("drafter on %s: fits, %s of %s usable: %s", dev, gib(need), gib(usable), parts)
