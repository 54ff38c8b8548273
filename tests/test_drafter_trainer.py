"""The drafter trainer: exact resume from a checkpoint, and N ranks == 1 rank.

Both are what a week-long multi-GPU run relies on: a restarted run must continue the loss
trajectory it left, and the drafter group must take the step one rank would take on the
union of their blocks (loss normalised by the all-reduced weight sum, gradients summed).
"""

import functools
import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dflash_ipc.config.schema import JobConfig
from dflash_ipc.config.load import config_from_dict
from dflash_ipc.drafter.model import DFlashConfig
from dflash_ipc.hf.target_head import FrozenTargetHead
from dflash_ipc.run.checkpoints import CheckpointStore
from dflash_ipc.drafter.trainer import DrafterTrainer, Sequence

torch.set_num_threads(1)
HIDDEN, VOCAB, LAYERS_CAPTURED = 32, 96, 2


def model_config() -> DFlashConfig:
    return DFlashConfig(hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=8, vocab_size=VOCAB, block_size=4, mask_token_id=VOCAB - 1,
                        target_layer_ids=[0, 1], num_target_layers=2)


def head() -> FrozenTargetHead:
    g = torch.Generator().manual_seed(123)
    return FrozenTargetHead(torch.randn(VOCAB, HIDDEN, generator=g) * 0.5, torch.randn(VOCAB, HIDDEN, generator=g) * 0.5)


def sequences(n: int, seed: int = 0) -> list[Sequence]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = int(torch.randint(12, 40, (1,), generator=g))
        mask = torch.ones(length, dtype=torch.bool)
        mask[: length // 3] = False
        eligible = int((mask[:-1] & mask[1:]).sum())
        out.append(Sequence(batch_id=i // 2, epoch=0, sample_id=i,
                            features=torch.randn(length, HIDDEN * LAYERS_CAPTURED, generator=g),
                            input_ids=torch.randint(0, VOCAB - 1, (length,), generator=g),
                            loss_mask=mask, num_anchors=min(6, eligible)))
    return out


def trainer_cfg(recipe: dict | None = None) -> JobConfig:
    tree = {"drafter": {"num_workers": 1, "dtype": "float32", "attention": "dense"},
            "objective": {"anchors_per_step": 12, "max_anchors_per_seq": 6},
            "optimizer": {"lr": 3e-3}, "schedule": {"warmup_ratio": 0.2}}
    for section, values in (recipe or {}).items():
        tree[section] = {**tree.get(section, {}), **values}
    return config_from_dict(tree)


def _new_trainer(recipe: dict | None = None) -> DrafterTrainer:
    return DrafterTrainer(trainer_cfg(recipe), model_config(), head(), device="cpu", total_steps=8)


# Today's recipe, and every other part of the state a checkpoint must carry: Muon's momentum
# next to AdamW's moments (one state dict over two optimizers), WSD, D-PACE's running estimate.
RESUME_RECIPES = {"adamw-cosine": None,
                  "muon-wsd-dpace": {"optimizer": {"name": "muon"}, "schedule": {"name": "wsd", "decay_ratio": 0.5},
                                     "objective": {"weighting": "dpace"}}}


@pytest.mark.parametrize("recipe", list(RESUME_RECIPES))
def test_stop_and_resume_continues_the_same_loss_trajectory(tmp_path, recipe):
    seqs = sequences(24)
    batches = [seqs[i:i + 3] for i in range(0, 24, 3)]  # 8 steps of 3 sequences
    plan = [[(s, s.num_anchors) for s in b] for b in batches]
    new_trainer = functools.partial(_new_trainer, RESUME_RECIPES[recipe])

    straight = new_trainer()
    losses = [straight.step(chosen)["loss"] for chosen in plan]

    first = new_trainer()
    resumed_losses = [first.step(chosen)["loss"] for chosen in plan[:3]]
    store = CheckpointStore(str(tmp_path))
    first.save_checkpoint(store, extra={"committed": [[0, 0, 1, [4, 5]]]})
    del first
    second = new_trainer()  # a fresh process would start exactly like this
    extra = second.resume(store, 3)
    assert second.step_count == 3 and extra == {"committed": [[0, 0, 1, [4, 5]]]}
    resumed_losses += [second.step(chosen)["loss"] for chosen in plan[3:]]
    assert resumed_losses == losses  # bit-identical in float32 on CPU
    assert losses[-1] < losses[0]
    for a, b in zip(straight.model.parameters(), second.model.parameters()):
        assert torch.equal(a, b)


def _rank_main(rank: int, world: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        trainer = _new_trainer()
        seqs = sequences(18)
        for step in range(2):
            mine = seqs[step * 9:(step + 1) * 9][rank::world]  # this rank's share of the step
            if rank == world - 1 and step == 1:
                mine = []  # a rank without data still joins the step
            trainer.step([(s, s.num_anchors) for s in mine])
        torch.save({k: v.detach() for k, v in trainer.model.state_dict().items()},
                   os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_three_ranks_take_the_step_one_rank_takes(tmp_path):
    world = 3
    mp.start_processes(_rank_main, args=(world, str(tmp_path / "init"), str(tmp_path)), nprocs=world,
                       join=True, start_method="spawn")
    single = _new_trainer()
    seqs = sequences(18)
    for step in range(2):
        union = [s for rank in range(world) for s in seqs[step * 9:(step + 1) * 9][rank::world]
                 if not (rank == world - 1 and step == 1)]
        single.step([(s, s.num_anchors) for s in union])
    reference = single.model.state_dict()
    for rank in range(world):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        for name, value in reference.items():
            # Within a tenth of one step's update (lr 3e-3): Muon's orthogonalization of a
            # near-singular gradient turns the reduce order's last bits into up to 1.2e-4 on a
            # wide matrix, depending on the CPU's kernels; a wrong share moves whole updates.
            torch.testing.assert_close(got[name], value, rtol=1e-5, atol=0.1 * trainer_cfg().optimizer.lr,
                                       msg=lambda m, rank=rank, name=name: f"rank {rank} {name}: {m}")


def test_steps_launched_before_any_is_read_report_what_steps_read_one_by_one_report():
    """launch() leaves the figures on the device; reading them after later steps were queued
    gives each step's own figures, and a step with no blocks leaves the weights alone."""
    seqs = sequences(9, seed=3)
    plan = [[(s, s.num_anchors) for s in seqs[i:i + 3]] for i in range(0, 9, 3)] + [[]]
    one_by_one = _new_trainer()
    read_at_once = [one_by_one.step(chosen) for chosen in plan]
    pipelined = _new_trainer()
    launched = [pipelined.launch(chosen) for chosen in plan]
    results = [step.result() for step in launched]
    keys = ("step", "loss", "anchors", "tokens", "lr", "grad_norm")

    def figures(r):  # NaN (the loss of the step without blocks) compared as None
        return [None if r[k] != r[k] else r[k] for k in keys]
    assert [figures(r) for r in results] == [figures(r) for r in read_at_once]
    assert results[-1]["anchors"] == 0 and results[-1]["grad_norm"] == 0.0
    for a, b in zip(one_by_one.model.parameters(), pipelined.model.parameters()):
        assert torch.equal(a, b)
    assert all(r["step_s"] >= 0 for r in results) and results[0]["grad_norm"] > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_launched_steps_time_on_a_gpu_is_its_device_span():
    """step_s on CUDA runs between events: what the host does after a launch (here a sleep, as a
    pipelined loop waits for hidden states) is not the step's time."""
    seqs = sequences(9, seed=3)
    trainer = DrafterTrainer(trainer_cfg(), model_config(), head(), device="cuda:0", total_steps=8)
    trainer.step([(s, s.num_anchors) for s in seqs[:3]])  # warm-up: cuBLAS, the allocator
    launched = trainer.launch([(s, s.num_anchors) for s in seqs[3:6]])
    time.sleep(0.5)
    after = trainer.launch([(s, s.num_anchors) for s in seqs[6:]])
    first, second = launched.result(), after.result()
    assert 0 < first["step_s"] < 0.4 and 0 < second["step_s"] < 0.4, (first["step_s"], second["step_s"])
