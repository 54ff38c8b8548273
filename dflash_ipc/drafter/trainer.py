"""One drafter rank's training state and step: model, optimizer, schedule, checkpoints.

Steps are collective: every rank of the drafter group calls `step()` the same number of
times (a rank without data contributes zero gradients). The loss is normalised by the
weight sum of ALL ranks (all-reduced before the backward) and gradients are summed, so N
ranks take exactly the step one rank would take on the union of their blocks.

A step takes a fixed budget of anchors (`anchors_per_step`), whatever the shape of the
target batches the sequences arrived in, so step cost does not depend on bucketing.

`drafter.sharding: fsdp` shards the model and optimizer state over the ranks with FSDP2 and
takes the same step (drafter/sharding.py): its reduce-scatter sums the gradients instead of
the bucketed all-reduce, and checkpoints are gathered on rank 0 in the same format.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from dflash_ipc.config.schema import JobConfig, ObjectiveConfig
from dflash_ipc.drafter.acceptance_proxy import block_acceptance_totals
from dflash_ipc.drafter import ce_kernel
from dflash_ipc.drafter.attention import FLEX_TILE, build_layer_masks
from dflash_ipc.run.checkpoints import CheckpointStore
from dflash_ipc.drafter.inference_format import write_inference_files
from dflash_ipc.drafter.launched_step import LaunchedStep, StepClock, launch_started
from dflash_ipc.drafter.compiled_forward import DrafterForward, falls_back
from dflash_ipc.drafter.step_shape import pad_blocks, pad_layout, pad_rows
from dflash_ipc.drafter.model import DFlashConfig, DFlashDraftModel
from dflash_ipc.drafter.sharding import full_state, load_full_model, load_full_state, shard_model, total_norm
from dflash_ipc.drafter.objective import (TrainingBatch, anchor_generator, build_training_batch,
                                          default_chunk_budget, lm_head_chunk_rows, sample_anchors, weighted_ce_sum)
from dflash_ipc.drafter.optimizers import build_optimizer
from dflash_ipc.drafter.precision import apply_precision, next_step
from dflash_ipc.drafter.schedule import schedule_lambda
from dflash_ipc.hf.target_head import FrozenTargetHead
from dflash_ipc.drafter.training_state import read_training_state, write_training_state
from dflash_ipc.drafter.warm_start import read_init_weights
from dflash_ipc.config.dtypes import TORCH_DTYPES
from dflash_ipc.errors import DamagedCheckpointError

log = logging.getLogger(__name__)

GRAD_BUCKET_BYTES = 256 * 1024 * 1024  # gradient all-reduce in buckets: bounded extra memory


@dataclass
class Sequence:
    """One sample waiting in a drafter's queue, its features already in local memory."""
    batch_id: int
    epoch: int
    sample_id: int
    features: torch.Tensor   # [L, F] on the drafter's device
    input_ids: torch.Tensor  # [L] long
    loss_mask: torch.Tensor  # [L] bool
    num_anchors: int         # anchors it can give: min(max_anchors_per_seq, eligible positions)
    attempt: int = 0         # the Assign attempt of the copy it came in


def eligible_anchor_count(loss_mask: np.ndarray, max_anchors: int) -> int:
    """Positions p with loss at p and p+1, capped: what one sequence contributes to a step."""
    mask = np.asarray(loss_mask, dtype=bool)
    return int(min(max_anchors, np.count_nonzero(mask[:-1] & mask[1:])))


def estimate_total_steps(dataset, cfg: ObjectiveConfig, *, num_epochs: int, world_size: int) -> int:
    """Optimizer steps of the job, for the cosine schedule (anchors / global step budget)."""
    total = sum(eligible_anchor_count(dataset.sample(i)[1], cfg.max_anchors_per_seq)
                for i in range(len(dataset)))
    return max(1, math.ceil(total * num_epochs / (cfg.anchors_per_step * world_size)))


def take_anchors(fifo: collections.deque, budget: int) -> list[tuple[Sequence, int]]:
    """Pops sequences until `budget` anchors are chosen; returns (sequence, anchors) pairs.
    The last sequence gets only what remains of the budget; no sequence is split."""
    chosen = []
    while fifo and budget > 0:
        seq = fifo.popleft()
        anchors = min(seq.num_anchors, budget)
        chosen.append((seq, anchors))
        budget -= anchors
    return chosen


class DrafterTrainer:
    def __init__(self, cfg: JobConfig, model_config: DFlashConfig, head: FrozenTargetHead, *,
                 device: str, total_steps: int, group=None) -> None:
        self.cfg = cfg
        self.device = torch.device(device)
        ce_kernel.enabled()  # a bad $DFLASH_CE_KERNEL fails here, not at the first GPU step's CE
        self.seed = seed = cfg.run.seed
        self.group = group
        self.world_size = dist.get_world_size(group) if dist.is_initialized() else 1
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0
        torch.manual_seed(seed)  # identical initial weights on every rank
        self.model = DFlashDraftModel(model_config).to(self.device)
        # FSDP needs a group to shard over: a world of one has nothing to shard
        self.head = head
        # float8 layers first, then FSDP over them (torchao's order: fully_shard wraps the
        # converted modules and shards their parameters like any other)
        self.fp8_head = apply_precision(cfg.drafter, self.model, head, self.device,
                                       weighting=cfg.objective.weighting)  # None in bf16
        self.sharded = cfg.drafter.sharding == "fsdp" and self.world_size > 1
        if self.sharded:
            shard_model(self.model, self.device)
        self._gathered: tuple[dict, dict] | None = None  # full_state for the next checkpoint (rank 0)
        self.compute_dtype = TORCH_DTYPES[cfg.drafter.dtype]
        self.backend = cfg.drafter.attention if cfg.drafter.attention != "auto" else (
            "flex" if self.device.type == "cuda" else "dense")
        self.drafter_forward = DrafterForward(self.model, cfg.drafter.compile, self.device,
                                              row_multiple=16 if cfg.drafter.precision == "fp8" else 1)
        budget = cfg.drafter.lm_head_chunk_gib * (1 << 30) or default_chunk_budget(self.device)
        self.ce_chunk_rows = lm_head_chunk_rows(head.vocab_size, budget)  # rows per LM-head chunk
        self.optimizer = build_optimizer(self.model, cfg.optimizer, self.device)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, schedule_lambda(cfg.schedule, total_steps))
        self.total_steps = total_steps
        self.step_count = 0
        self._clock = StepClock()

    # --- choosing a step's sequences ------------------------------------------------------

    def take(self, fifo: collections.deque) -> list[tuple[Sequence, int]]:
        """A step's sequences from `fifo` (see `take_anchors`)."""
        return take_anchors(fifo, self.cfg.objective.anchors_per_step)

    # --- the step ---------------------------------------------------------------------------

    def _all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            dist.all_reduce(tensor, group=self.group)
        return tensor

    def step(self, chosen: list[tuple[Sequence, int]], *, validate: bool = False) -> dict:
        """One collective optimizer step over this rank's chosen sequences (may be empty), and
        its figures: ``launch(chosen, validate=validate).result()``."""
        return self.launch(chosen, validate=validate).result()

    def launch(self, chosen: list[tuple[Sequence, int]], *, validate: bool = False) -> LaunchedStep:
        """One collective optimizer step, queued on the device: the host reads nothing back on
        a rank with blocks, so it may build the next step while this one runs; the figures come
        with ``result()`` (drafter/launched_step.py). `validate` (the same on every rank: a
        collective): also the acceptance proxy of the weights before this step, on the step's
        blocks of all ranks (drafter/acceptance_proxy.py)."""
        started, start_event = time.perf_counter(), launch_started(self.device)
        next_step()  # fp8: row counts promoted in the last step run static graphs from this one
        batch, features, mask, mask_s = self._build(chosen)
        has_blocks = batch is not None
        num_anchors = batch.num_anchors if has_blocks else 0
        # The weight sum stays on the device: reading it would stall the host until the mask
        # and features are built, with no forward queued.
        local = batch.weights.sum().double() if has_blocks else torch.zeros((), dtype=torch.float64,
                                                                               device=self.device)
        if not has_blocks and self.sharded:  # FSDP's collectives are in the forward and backward
            batch, features, mask, _ = self._idle_batch()
        weight_sum = self._all_reduce(local.reshape(1))[0]  # [] float64, all ranks
        loss_sum = torch.zeros((), device=self.device)
        acceptance = torch.zeros(self.model.config.block_size + 1, dtype=torch.float64, device=self.device)
        if batch is not None:
            loss_sum, totals = self._loss_and_backward(batch, features, mask, weight_sum, acceptance=validate)
            if totals is not None:
                acceptance = totals
        grad_norm = self._reduce_and_clip()
        if self._takes_update(has_blocks, weight_sum):
            self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step_count += 1
        num_tokens = sum(s.features.shape[0] for s, _ in chosen)

        def scalar(value) -> torch.Tensor:  # a fill on the device: no host-to-device copy
            return torch.full((), float(value), dtype=torch.float64, device=self.device)

        counts = self._all_reduce(torch.stack([loss_sum.detach().double(), scalar(num_anchors), scalar(num_tokens)]))
        norm = grad_norm.detach().double().reshape(())
        figures = [counts, weight_sum.reshape(1), norm.reshape(1)]
        if validate:
            figures.append(self._all_reduce(acceptance))
        return LaunchedStep(torch.cat(figures), step=self.step_count, lr=self.scheduler.get_last_lr()[0],
                            mask_s=mask_s, started=started, validate=validate, clock=self._clock,
                            start_event=start_event)

    def _takes_update(self, has_blocks: bool, weight_sum: torch.Tensor) -> bool:
        """Whether this step updates the weights: some rank had blocks. A rank's own blocks say
        so without a device read (every anchor has a weighted label: sample_anchors only picks
        p with loss at p+1, block position 1); a rank without any reads the all-reduced sum."""
        if has_blocks:
            return True
        return self.world_size > 1 and float(weight_sum) > 0

    def _loss_and_backward(self, batch, features: torch.Tensor, mask, weight_sum: torch.Tensor, *,
                           acceptance: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the loss sum, the acceptance totals when `acceptance`, else None), the loss's gradient
        accumulated. A compile that fails (the forward's is caught in DrafterForward; a backward
        compiled lazily fails here) turns compiling off, and the step is recomputed eagerly from
        zero gradients: never a wrong step."""
        def forward_backward() -> tuple[torch.Tensor, torch.Tensor | None]:
            loss_sum, totals = (self.loss_sum(batch, features, mask, acceptance=True) if acceptance
                                else (self.loss_sum(batch, features, mask), None))
            # The clamp only guards hand-made batches with all weights 0: loss and gradient 0.
            (loss_sum / weight_sum.float().clamp_min(torch.finfo(torch.float32).tiny)).backward()
            return loss_sum, totals

        self.drafter_forward.step_begin()
        try:
            return forward_backward()
        except Exception as exc:  # noqa: BLE001 - narrowed by falls_back, else re-raised
            if not (self.drafter_forward.enabled and falls_back(exc)):
                raise
            self.drafter_forward.disable(exc)
            self.optimizer.zero_grad(set_to_none=True)
            return forward_backward()

    def _batch(self, chosen) -> TrainingBatch:
        """The step's blocks as they are (on the host): no padding rows, no filler blocks."""
        anchors, lengths = [], []
        for seq, count in chosen:
            gen = anchor_generator(self.seed, seq.epoch, seq.sample_id)
            anchors.append(sample_anchors(seq.loss_mask, count, gen))
            lengths.append(seq.features.shape[0])
        cu = torch.zeros(len(chosen) + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(torch.tensor(lengths), 0)
        input_ids = torch.cat([s.input_ids for s, _ in chosen])
        loss_mask = torch.cat([s.loss_mask for s, _ in chosen])
        return build_training_batch(input_ids, loss_mask, cu, anchors, block_size=self.model.config.block_size,
                                    mask_token_id=self.model.config.mask_token_id, gamma=self.cfg.objective.gamma,
                                    weighting=self.cfg.objective.weighting)

    def _build(self, chosen):
        """(the step's batch on the device, its context features, its masks, the mask's build
        seconds), padded as the step runs (step_shape.py); all None (0.0) without an anchor."""
        if not any(n for _, n in chosen):
            return None, None, None, 0.0
        batch = self._batch(chosen)
        # The context may get keys that no query sees and the blocks zero-weight fillers
        # (step_shape.py): whole FlexAttention tiles, and under drafter.compile the job's
        # largest step so far (CUDA graphs) or 16-row multiples (fp8)
        num_ctx, num_queries = self.drafter_forward.step_rows(
            batch.layout.num_ctx, batch.layout.num_queries, tile=FLEX_TILE if self.backend == "flex" else 1,
            block_size=self.model.config.block_size)
        batch = pad_blocks(batch, num_queries, self.model.config.mask_token_id).to(self.device)
        mask_started = time.perf_counter()
        config = self.model.config
        mask = build_layer_masks(pad_layout(batch.layout, num_ctx), self.backend, config.layer_types,
                                 config.sliding_window, memory=self.drafter_forward.mask_memory)
        mask_s = time.perf_counter() - mask_started
        features = pad_rows(torch.cat([s.features for s, _ in chosen]), num_ctx)  # [T (padded), F]
        return batch, features, mask, mask_s

    def _idle_batch(self):
        """One anchor on a zero sequence, with loss weight 0: a forward and backward that add
        exactly nothing to the gradients (a rank without blocks under FSDP)."""
        config = self.model.config
        seq = Sequence(batch_id=-1, epoch=0, sample_id=0, num_anchors=1,
                       features=torch.zeros(2, config.num_context_features * config.hidden_size, device=self.device),
                       input_ids=torch.zeros(2, dtype=torch.long), loss_mask=torch.ones(2, dtype=torch.bool))
        batch, features, mask, mask_s = self._build([(seq, 1)])
        return dataclasses.replace(batch, weights=torch.zeros_like(batch.weights)), features, mask, mask_s

    def loss_sum(self, batch, features: torch.Tensor, mask, *, acceptance: bool = False):
        """The batch's weighted cross-entropy sum under the drafter's autocast: the step's
        forward, which the start-up memory probe (drafter/fit.py) runs too. `acceptance`:
        (loss sum, the batch's acceptance totals), scored on the same hidden states."""
        with torch.autocast(self.device.type, dtype=self.compute_dtype, enabled=self.compute_dtype != torch.float32):
            hidden = self._forward(batch, features, mask)
            objective = self.cfg.objective
            dpace = (objective.dpace_alpha, self.model.config.block_size) if objective.weighting == "dpace" else None
            loss = weighted_ce_sum(hidden, self.head, batch.labels, batch.weights, chunk_size=self.ce_chunk_rows,
                                   fp8_head=self.fp8_head, dpace=dpace, rows=batch.loss_rows)
        if not acceptance:
            return loss
        return loss, block_acceptance_totals(hidden.detach(), self.head.lm_head_weight, batch.labels, batch.weights,
                                             self.model.config.block_size)

    def _forward(self, batch, features: torch.Tensor, mask) -> torch.Tensor:
        # features may carry padding context rows (_build): their positions are 0
        ctx_positions = pad_rows(batch.layout.ctx_pos.to(self.device, torch.long), features.shape[0])
        block_embeds = self.head.embed(batch.block_ids)
        return self.drafter_forward(features, ctx_positions, block_embeds, batch.block_positions, mask)

    def _reduce_and_clip(self) -> torch.Tensor:
        """Sums gradients over ranks (bucketed, in place), then clips the global norm; returns
        the norm before clipping (a device scalar, not read here)."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        if self.sharded:  # FSDP's reduce-scatter summed them in the backward; every rank ran one
            return total_norm(torch.nn.utils.clip_grad_norm_(params, self.cfg.optimizer.grad_clip))
        for p in params:
            if p.grad is None:  # a rank without blocks this step still joins the all-reduce
                p.grad = torch.zeros_like(p)
        if self.world_size > 1:
            bucket, size = [], 0
            for p in params:
                bucket.append(p.grad)
                size += p.grad.numel() * p.grad.element_size()
                if size >= GRAD_BUCKET_BYTES:
                    self._all_reduce_bucket(bucket)
                    bucket, size = [], 0
            if bucket:
                self._all_reduce_bucket(bucket)
        return torch.nn.utils.clip_grad_norm_(params, self.cfg.optimizer.grad_clip)

    def _all_reduce_bucket(self, grads: list[torch.Tensor]) -> None:
        flat = torch._utils._flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=self.group)
        for grad, reduced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
            grad.copy_(reduced)

    # --- checkpoints ------------------------------------------------------------------------

    def prepare_checkpoint(self) -> None:
        """Every rank, before rank 0's `save_checkpoint`: under FSDP gathers the full model and
        optimizer state on rank 0 (a collective); nothing to do unsharded."""
        if self.sharded:
            self._gathered = full_state(self.model, self.optimizer)

    def save_checkpoint(self, store: CheckpointStore, extra: dict) -> str:
        """Rank 0 only: checkpoint `step_<N>/` of the current step (inference export, training
        state, manifest), written to a temp dir and renamed into place."""
        if self.sharded and self._gathered is None:
            raise RuntimeError("drafter.sharding=fsdp: prepare_checkpoint() on every rank comes first")
        model_state, optimizer_state = self._gathered or (None, None)
        self._gathered = None

        def write(directory: str) -> None:
            write_inference_files(self.model, directory, state=model_state)
            write_training_state(directory, model=self.model, optimizer=self.optimizer, scheduler=self.scheduler,
                                 step=self.step_count, total_steps=self.total_steps, extra=extra,
                                 model_state=model_state, optimizer_state=optimizer_state)
        return store.write(self.step_count, write)

    def warm_start(self, path: str) -> None:
        """Step 0 of a fresh job: the weights of the exported drafter at `path` (checked
        against this job's drafter, drafter/warm_start.py); the optimizer state stays empty."""
        if self.step_count != 0:
            raise RuntimeError(f"warm_start at step {self.step_count}: only a fresh job starts from drafter.init_from")
        state = read_init_weights(path, self.model.config)
        if self.sharded:
            load_full_model(self.model, state)
        else:
            self.model.load_state_dict(state)
        log.info("drafter weights from %s (drafter.init_from), optimizer fresh", path)

    def resume(self, store: CheckpointStore, step: int) -> dict:
        """Loads checkpoint `step` (verified against its manifest); returns its `extra`."""
        directory = store.path(step)
        store.verify(step)
        model_state, optimizer_state, rng, meta = read_training_state(
            directory, model=self.model, optimizer=self.optimizer, device=self.device, scheduler=self.scheduler)
        if meta.get("step") != step:
            raise DamagedCheckpointError(f"{directory}: holds step {meta.get('step')}, not {step}")
        if self.sharded:  # each rank keeps its shards of the full state
            load_full_state(self.model, self.optimizer, model_state, optimizer_state)
        else:
            self.model.load_state_dict(model_state)
            self.optimizer.load_state_dict(optimizer_state)
        self.scheduler.load_state_dict(meta["scheduler"])
        self.step_count = step
        torch.set_rng_state(rng)
        log.info("resumed from %s (step %d)", directory, step)
        return meta.get("extra", {})
