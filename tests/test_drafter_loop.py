"""The drafter loop stepped in one process: a fake link, a group of one, fake slot readers,
the real trainer and queue on a tiny model."""

import collections
import os
import math

import numpy as np
import pytest
import torch

from dflash_ipc.wire import protocol as p
from dflash_ipc.config.load import config_from_dict
from dflash_ipc.run.checkpoints import STATE_TENSORS, CheckpointStore
from dflash_ipc.drafter.group import SoloGroup
from dflash_ipc.drafter.loop import DrafterLoop, StopRequested
from dflash_ipc.drafter.model import DFlashConfig
from dflash_ipc.drafter.sequence_queue import SequenceQueue
from dflash_ipc.hf.target_head import FrozenTargetHead
from dflash_ipc.drafter.trainer import DrafterTrainer
from dflash_ipc.errors import ProducerGoneError

VOCAB, HIDDEN, LAYERS = 64, 32, 2
LENGTHS = [20, 24, 18, 30, 22, 26, 19, 28]


class FakeDataset:
    """Samples of LENGTHS tokens, the loss on the second half of each."""

    def __init__(self):
        g = np.random.default_rng(0)
        self.lengths = np.array(LENGTHS)
        self.rows = [(g.integers(0, VOCAB - 1, n), np.r_[np.zeros(n // 2), np.ones(n - n // 2)].astype(np.uint8))
                     for n in LENGTHS]

    def sample(self, i):
        return self.rows[i]


class FakeLink:
    def __init__(self):
        self.inbox: collections.deque = collections.deque()
        self.sent: list = []
        self.metrics: dict = {}
        self.replies = {p.Resumed: lambda m: p.Resumed(step=m.step), p.Committed: lambda m: p.CommitDone(step=m.step)}

    def send(self, msg):
        self.sent.append(msg)
        if type(msg) in self.replies:
            self.inbox.append(self.replies[type(msg)](msg))

    def recv(self, timeout_s):
        return self.inbox.popleft() if self.inbox else None

    def beat(self, force=False):  # periodic beats are the real link's; a forced one is recorded
        if force:
            self.send(p.Heartbeat(metrics=dict(self.metrics)))

    def of(self, kind):
        return [m for m in self.sent if isinstance(m, kind)]


class FakeReaders:
    def __init__(self):
        self.gone: set[str] = set()
        self.dropped: list[str] = []
        self.gone_message = "producer target/0 (pid 1) is gone"

    def get(self, pool):
        return self

    def read(self, slot, num_tokens):
        if self.pool_of_read in self.gone:
            raise ProducerGoneError(self.gone_message)
        self.last_copy_s = 0.0
        return torch.randn(num_tokens, HIDDEN * LAYERS)

    def drop(self, pool_id):
        self.dropped.append(pool_id)


def build(tmp_path, after_step=None, **sections):
    cfg = config_from_dict({"drafter": {"dtype": "float32", "attention": "dense", "fifo_sequences": 4, "prefetch": 2},
                            "model": {"num_layers": 1, "target_layer_ids": [0, 1], "block_size": 4},
                            "objective": {"anchors_per_step": 12, "max_anchors_per_seq": 6},
                            "checkpoint": {"every_steps": 2}, **sections})
    config = DFlashConfig(hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                          num_key_value_heads=1, head_dim=16, vocab_size=VOCAB, target_layer_ids=[0, 1],
                          num_target_layers=4, mask_token_id=VOCAB - 1, block_size=4)
    g = torch.Generator().manual_seed(1)
    head = FrozenTargetHead(torch.randn(VOCAB, HIDDEN, generator=g), torch.randn(VOCAB, HIDDEN, generator=g))
    trainer = DrafterTrainer(cfg, config, head, device="cpu", total_steps=20)
    link, readers = FakeLink(), FakeReaders()
    loop = DrafterLoop(cfg, 0, trainer=trainer, queue=SequenceQueue(FakeDataset(), max_anchors_per_seq=6),
                       readers=readers, link=link, group=SoloGroup(), store=CheckpointStore(str(tmp_path / "ck")),
                       after_step=after_step)
    return loop, link, readers


def assign(batch_id, samples, attempt, pool="p0"):
    return p.Assign(batch_id=batch_id, epoch=0, target=0, pool={"pool_id": pool}, slot=0, sample_ids=samples,
                    num_tokens=sum(LENGTHS[s] for s in samples), attempt=attempt)


def registered(resume_step=-1, committed=()):
    return p.Registered(role="drafter", rank=0, num_batches=4, resume_step=resume_step,
                        committed_steps=list(committed))


def test_a_fresh_rank_asks_copies_steps_and_commits_sample_by_sample(tmp_path):
    loop, link, readers = build(tmp_path)
    readers.pool_of_read = "p0"
    assert loop.resume(registered()) == -1 and link.of(p.Resumed) == [p.Resumed(step=-1)]
    link.inbox.clear()
    assert loop.pass_once()  # nothing yet: the group waits, the rank asks for its credit
    assert link.of(p.WantHidden) == [p.WantHidden(credits=2)] and loop.trainer.step_count == 0
    link.inbox.extend([assign(0, [0, 1, 2], 1), assign(1, [3, 4, 5, 6, 7], 2)])
    steps = 0
    while loop.trainer.step_count < 2:
        assert loop.pass_once()
        steps += 1
    assert [m.batch_id for m in link.of(p.Consumed)] == [0, 1]
    (commit,) = link.of(p.Committed)
    # 12 anchors a step, 6 per sequence: two steps trained samples 0-3; batch 1 is split.
    assert commit.step == 2 and commit.batch_ids == [0, 1] and commit.ranks == [0, 0]
    assert commit.attempts == [1, 2] and commit.samples == [[0, 1, 2], [3]]
    loop.intake(0.0)  # the CommitDone: latest.json names the committed checkpoint
    assert loop.store.latest() == loop.store.path(2)
    # The rest of batch 1 is queued, not committed: a restart from step 2 gets it again.
    assert [(s.batch_id, s.attempt, s.sample_id) for s in loop.queue.fifo] == [(1, 2, s) for s in (4, 5, 6, 7)]
    assert loop.trainer.resume(loop.store, 2) == {"resumed_from": -1}  # the commit is the ledger's, not here
    assert link.metrics["trained_tokens"] == sum(LENGTHS[:4])


def test_a_copy_whose_producer_died_is_reported_lost_and_asked_for_again(tmp_path):
    loop, link, readers = build(tmp_path)
    readers.pool_of_read = "dead"
    readers.gone.add("dead")
    loop.resume(registered())
    loop.outstanding = 2
    link.inbox.append(assign(3, [0], 7, pool="dead"))
    loop.pass_once()
    assert link.of(p.Lost)[0].batch_id == 3 and link.of(p.Lost)[0].attempt == 7
    assert not link.of(p.Consumed) and readers.dropped == ["dead"] and len(loop.queue) == 0
    assert link.of(p.WantHidden) == [p.WantHidden(credits=1)]  # the spent credit is asked again


def test_a_lost_with_a_long_non_ascii_reason_still_fits_the_wire(tmp_path):
    loop, link, readers = build(tmp_path)
    readers.pool_of_read = "dead"
    readers.gone.add("dead")
    readers.gone_message = "/数据/路径/" * 200  # 500 characters cut at 500 would be ~1,500 bytes
    loop.resume(registered())
    loop.outstanding = 2
    link.inbox.append(assign(3, [0], 7, pool="dead"))
    loop.pass_once()
    (lost,) = link.of(p.Lost)
    assert p.decode(p.encode(lost)) == lost and lost.reason.startswith("/数据/路径/")


def test_resume_falls_back_to_the_newest_intact_committed_checkpoint(tmp_path):
    loop, link, readers = build(tmp_path)
    for step in (4, 8, 12):
        loop.trainer.step_count = step
        loop.trainer.save_checkpoint(loop.store, extra={})
    with open(os.path.join(loop.store.path(8), STATE_TENSORS), "r+b") as f:
        f.seek(100)
        f.write(b"\x00\x01\x02")
    fresh, _, _ = build(tmp_path)
    # The ledger's last commit is step 8 (12 was written, never committed); 8 is damaged.
    assert fresh.resume(registered(resume_step=8, committed=[4, 8])) == 4
    assert fresh.trainer.step_count == 4 and fresh.link.of(p.Resumed) == [p.Resumed(step=4)]
    assert fresh.store.steps_on_disk() == [4, 8] and len(fresh.store.uncommitted()) == 1
    assert fresh.store.latest() == fresh.store.path(4)


def test_a_stop_checkpoints_what_was_trained_and_leaves_once_committed(tmp_path):
    loop, link, readers = build(tmp_path, checkpoint={"every_steps": 100})
    readers.pool_of_read = "p0"
    loop.resume(registered())
    link.inbox.append(assign(0, [0, 1, 2, 3], 1))
    while loop.trainer.step_count < 1:
        loop.pass_once()
    loop.stop_reason = "SIGTERM"
    with pytest.raises(StopRequested) as info:
        loop.pass_once()
    assert info.value.code == 143
    (commit,) = link.of(p.Committed)
    assert commit.step == 1 and commit.samples == [[0, 1]]
    assert loop.store.latest() == loop.store.path(1)


def test_the_end_of_data_drains_the_queue_then_waits_for_shutdown(tmp_path):
    loop, link, readers = build(tmp_path, checkpoint={"every_steps": 100})
    readers.pool_of_read = "p0"
    loop.resume(registered())
    link.inbox.extend([assign(0, [0, 5], 1), p.EndOfData()])
    while loop.pass_once():
        pass
    assert loop.trainer.step_count == 1 and len(loop.queue) == 0  # one short last step
    link.inbox.append(p.Shutdown(reason="job finished"))
    loop.finish()
    (commit,) = link.of(p.Committed)
    assert commit.samples == [[0, 5]] and loop.shutdown
    # The last step's metrics went out before the commit that ends the job (final_status.json).
    beats = [i for i, m in enumerate(link.sent) if isinstance(m, p.Heartbeat)]
    assert beats and beats[-1] < link.sent.index(commit)
    assert link.sent[beats[-1]].metrics["step"] == 1.0


class PeerGroup(SoloGroup):
    """This rank and one peer that never has a full step (its node ran out of hidden states)."""
    world = 2

    def agree(self, flags):
        return [f + peer for f, peer in zip(flags, [0.0, 0.0, 0.0, 0.0])]


def test_a_full_rank_waits_for_a_short_peer_then_steps_without_hoarding(tmp_path):
    loop, link, readers = build(tmp_path, drafter={"dtype": "float32", "attention": "dense", "fifo_sequences": 2,
                                                   "prefetch": 1, "max_group_wait_s": 0.3})
    loop.group = PeerGroup()
    readers.pool_of_read = "p0"
    loop.resume(registered())
    link.inbox.append(assign(0, [0, 1, 2, 3], 1))
    loop.pass_once()
    assert loop.full and loop.trainer.step_count == 0 and loop.waiting_since is not None
    asked = len(link.of(p.WantHidden))
    deadline = __import__("time").monotonic() + 10
    while loop.trainer.step_count == 0:
        assert __import__("time").monotonic() < deadline
        loop.pass_once()
    assert len(link.of(p.WantHidden)) == asked  # full and at its cap: it never asked for more meanwhile
    assert loop.waiting_since is None


def test_a_loss_that_stops_being_finite_is_not_reported_as_its_last_finite_value(tmp_path):
    """The heartbeat carries finite values only: a diverged loss is dropped from it (the status
    shows no loss, not the last healthy one), and the step log writes it as null (strict JSON)."""
    import json
    loop, link, readers = build(tmp_path)
    readers.pool_of_read = "p0"
    loop.step_log = open(tmp_path / "steps.jsonl", "w")
    real_launch = loop.trainer.launch

    class Diverged:
        def __init__(self, launched):
            self.launched = launched

        def result(self):
            return {**self.launched.result(), "loss": float("inf")}

    def diverging(chosen, **options):
        launched = real_launch(chosen, **options)
        return Diverged(launched) if loop.trainer.step_count >= 2 else launched

    loop.trainer.launch = diverging
    loop.resume(registered())
    link.inbox.extend([assign(0, [0, 1, 2], 1), assign(1, [3, 4, 5, 6, 7], 2)])
    while loop.trainer.step_count < 1:
        assert loop.pass_once()
    assert math.isfinite(link.metrics["loss"])
    while loop.trainer.step_count < 2:
        assert loop.pass_once()
    assert "loss" not in link.metrics and link.metrics["trained_tokens"] > 0
    loop.step_log.close()
    rows = [json.loads(line, parse_constant=lambda c: pytest.fail(f"{c} in the step log"))
            for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
    assert [r["loss"] is None for r in rows] == [False, True]


def test_the_after_step_hook_runs_once_after_each_step_inside_its_timeline_interval(tmp_path):
    """Where the fault tests slow a step down (drafter/faults.py): after the optimizer step, before
    the step's interval closes, so the beacon and the timeline show a long step, not a hang."""
    calls = []
    loop, link, readers = build(tmp_path, after_step=lambda: calls.append(loop.trainer.step_count))
    recorded = []
    loop.timeline = type("Timeline", (), {"record": lambda self, state, t0, t1, **kw: recorded.append(
        (state, len(calls)))})()
    readers.pool_of_read = "p0"
    loop.resume(registered())
    link.inbox.extend([assign(0, [0, 1, 2], 1), assign(1, [3, 4, 5, 6, 7], 2)])
    while loop.trainer.step_count < 2:
        assert loop.pass_once()
    assert calls == [1, 2] and [n for state, n in recorded if state == "step"] == [1, 2]


def test_keep_last_deletes_older_checkpoints_once_their_successor_is_committed(tmp_path):
    loop, link, readers = build(tmp_path, checkpoint={"every_steps": 1, "keep_last": 1})
    readers.pool_of_read = "p0"
    loop.resume(registered())
    link.inbox.clear()
    link.inbox.extend([assign(0, [0, 1, 2], 1), assign(1, [3, 4, 5, 6, 7], 2)])
    while loop.trainer.step_count < 3:
        assert loop.pass_once()
    loop.intake(0.0)  # the last CommitDone
    assert [m.step for m in link.of(p.Committed)] == [1, 2, 3]
    assert loop.store.steps_on_disk() == [3] and loop.store.latest() == loop.store.path(3)


def _export(tmp_path, name="export", **changes):
    """An exported drafter of the shape `build` makes (or changed), its weights seeded apart."""
    import dataclasses
    from dflash_ipc.drafter.inference_format import save_inference_checkpoint
    from dflash_ipc.drafter.model import DFlashDraftModel
    loop, _, _ = build(tmp_path / f"{name}-run")
    torch.manual_seed(99)
    model = DFlashDraftModel(dataclasses.replace(loop.trainer.model.config, **changes))
    save_inference_checkpoint(model, str(tmp_path / name), dtype=torch.float32)
    return str(tmp_path / name), model.state_dict()


def test_init_from_loads_an_export_at_step_0_with_a_fresh_optimizer(tmp_path):
    path, weights = _export(tmp_path)
    loop, link, _ = build(tmp_path, drafter={"dtype": "float32", "attention": "dense", "init_from": path})
    assert loop.resume(registered()) == -1
    state = loop.trainer.model.state_dict()
    assert all(torch.equal(state[n], weights[n]) for n in weights)
    assert loop.trainer.step_count == 0 and not loop.trainer.optimizer.state


def test_init_from_of_another_shape_is_one_error_naming_each_difference(tmp_path):
    from dflash_ipc.errors import ConfigError
    path, _ = _export(tmp_path, block_size=8, target_layer_ids=[1, 2])
    loop, _, _ = build(tmp_path, drafter={"dtype": "float32", "attention": "dense", "init_from": path})
    with pytest.raises(ConfigError) as err:
        loop.resume(registered())
    message = str(err.value)
    assert "dflash_config.target_layer_ids: export [1, 2], job [0, 1] (model.target_layer_ids)" in message
    assert "block_size: export 8, job 4 (model.block_size)" in message and message.count("; ") == 1


def test_init_from_a_sliding_window_export_into_a_full_attention_job_is_refused(tmp_path):
    """The attention layout is part of the shape: a drafter trained with a window does not load
    silently into a job whose layers see every key."""
    from dflash_ipc.errors import ConfigError
    path, _ = _export(tmp_path, layer_types=["sliding_attention"], sliding_window=64)
    loop, _, _ = build(tmp_path, drafter={"dtype": "float32", "attention": "dense", "init_from": path})
    with pytest.raises(ConfigError) as err:
        loop.resume(registered())
    message = str(err.value)
    assert "layer_types: export ['sliding_attention'], job ['full_attention'] (model.layer_types)" in message
    assert "sliding_window: export 64, job None (model.sliding_window)" in message


def test_a_resumed_job_ignores_init_from_the_checkpoint_wins(tmp_path, caplog):
    path, weights = _export(tmp_path)
    first, _, _ = build(tmp_path)
    first.trainer.step_count = 2
    first.trainer.save_checkpoint(first.store, extra={})
    saved = {n: t.clone() for n, t in first.trainer.model.state_dict().items()}
    loop, _, _ = build(tmp_path, drafter={"dtype": "float32", "attention": "dense", "init_from": path})
    with caplog.at_level("INFO", logger="dflash_ipc.drafter.loop"):
        assert loop.resume(registered(resume_step=2, committed=[2])) == 2
    assert all(torch.equal(t, saved[n]) for n, t in loop.trainer.model.state_dict().items())
    assert f"drafter.init_from={path} ignored: the job resumes from its checkpoint of step 2" in caplog.text


def test_validation_scores_the_weights_before_a_step_and_retention_keeps_the_best(tmp_path, monkeypatch, caplog):
    """validation.every_steps=1: each step's record carries the proxy of the weights before it;
    with keep_last=1 the best checkpoint by it stays next to the newest."""
    import json

    from dflash_ipc.drafter import launched_step
    loop, link, readers = build(tmp_path, checkpoint={"every_steps": 1, "keep_last": 1},
                                validation={"every_steps": 1})
    step_log = tmp_path / "steps.jsonl"
    loop.step_log = open(step_log, "w")
    readers.pool_of_read = "p0"
    real = launched_step.acceptance_summary
    scores = iter([1.5, 3.0, 2.0, 1.0])  # the weights of steps 0, 1, 2, 3: step 1 is the best
    monkeypatch.setattr(launched_step, "acceptance_summary",
                        lambda totals: {**real(totals), "acceptance_length": next(scores)})
    loop.resume(registered())
    link.inbox.clear()
    link.inbox.extend([assign(0, [0, 1, 2], 1), assign(1, [3, 4, 5, 6, 7], 2)])
    with caplog.at_level("INFO", logger="dflash_ipc.drafter.loop"):
        while loop.trainer.step_count < 3:
            assert loop.pass_once()
        loop.intake(0.0)
    records = [json.loads(line) for line in open(step_log)]
    assert [(r["step"], r["validated_step"], r["acceptance_length"]) for r in records] == [(1, 0, 1.5), (2, 1, 3.0),
                                                                                            (3, 2, 2.0)]
    assert records[0]["acceptance_blocks"] > 0 and len(records[0]["acceptance_at"]) == 3
    assert loop.best == (1, 3.0) and loop.store.steps_on_disk() == [1, 3]
    assert "validation at step 1: expected acceptance length 3.000" in caplog.text
    # The best survives a resume: it is in the checkpoint's training state.
    fresh, _, _ = build(tmp_path, checkpoint={"every_steps": 1, "keep_last": 1}, validation={"every_steps": 1})
    assert fresh.resume(registered(resume_step=3, committed=[1, 2, 3])) == 3 and fresh.best == (1, 3.0)


def test_held_out_validation_decodes_each_validated_checkpoint_and_keeps_the_best_by_tau(tmp_path, caplog):
    """validation.prompts > 0: rank 0 hands each checkpoint on the validation period to the
    validator; tau (not the proxy) picks the best checkpoint, and each result is a step record."""
    import json

    decoded, taus = [], iter([1.2, 2.5, 1.9])
    def validator(step_dir):
        decoded.append(os.path.basename(step_dir))
        return {"tau": next(taus), "prompts": 4, "tokens": 64, "seconds": 0.1}
    loop, link, readers = build(tmp_path, checkpoint={"every_steps": 1, "keep_last": 1},
                                validation={"every_steps": 1, "prompts": 4})
    loop.validator = validator
    step_log = tmp_path / "steps.jsonl"
    loop.step_log = open(step_log, "w")
    readers.pool_of_read = "p0"
    loop.resume(registered())
    link.inbox.clear()
    link.inbox.extend([assign(0, [0, 1, 2], 1), assign(1, [3, 4, 5, 6, 7], 2)])
    with caplog.at_level("INFO", logger="dflash_ipc.drafter.loop"):
        while loop.trainer.step_count < 3:
            assert loop.pass_once()
        loop.intake(0.0)
    assert decoded == ["step_00000001", "step_00000002", "step_00000003"]
    assert loop.best == (2, 2.5) and loop.store.steps_on_disk() == [2, 3]
    held = [r for r in map(json.loads, open(step_log)) if "held_out_tau" in r]
    assert [(r["step"], r["validated_step"], r["held_out_tau"]) for r in held] == \
        [(1, 1, 1.2), (2, 2, 2.5), (3, 3, 1.9)]
    assert link.metrics["held_out_tau"] == 1.9
    assert "validation at checkpoint 2: tau 2.500 on 4 held-out prompts" in caplog.text
    from dflash_ipc.obs.step_log import step_scalars
    assert step_scalars(held[1]) == [(2, held[1]["time"], {"validation/held_out_tau": 2.5})]
    # Checkpoint 2 was written before it was decoded (its file records the best before it, 1):
    # a resume from it learns of the best from the file beside the checkpoints.
    fresh, _, _ = build(tmp_path, checkpoint={"every_steps": 1, "keep_last": 1},
                        validation={"every_steps": 1, "prompts": 4})
    fresh.validator = validator
    assert fresh.resume(registered(resume_step=2, committed=[2])) == 2 and fresh.best == (2, 2.5)
    (tmp_path / "ck" / "best_decoded.json").write_text('{"best": {"step": 3, "acceptance_length": 9.0}}')
    fresh, _, _ = build(tmp_path, checkpoint={"every_steps": 1, "keep_last": 1},
                        validation={"every_steps": 1, "prompts": 4})
    fresh.validator = validator  # a best after the resumed step (rolled back) is not taken
    assert fresh.resume(registered(resume_step=2, committed=[2])) == 2 and fresh.best == (1, 1.2)


def test_held_out_validation_needs_a_validation_period():
    from dflash_ipc.errors import ConfigError
    with pytest.raises(ConfigError, match="validation.prompts: 8 held-out prompts need validation.every_steps"):
        config_from_dict({"validation": {"prompts": 8}})


def test_a_validation_step_trains_exactly_as_any_other_step(tmp_path):
    def run(**sections):
        loop, link, readers = build(tmp_path / str(len(sections)), **sections)
        readers.pool_of_read = "p0"
        loop.resume(registered())
        link.inbox.extend([assign(0, [0, 1, 2], 1), assign(1, [3, 4, 5, 6, 7], 2)])
        while loop.trainer.step_count < 2:
            assert loop.pass_once()
        return loop.trainer.model.state_dict(), link.metrics
    plain, _ = run()
    validated, metrics = run(validation={"every_steps": 1})
    assert metrics["acceptance_blocks"] > 0 and metrics["validated_step"] == 1
    assert all(torch.equal(plain[n], validated[n]) for n in plain)


def test_a_pipelined_loop_publishes_each_step_after_the_next_is_queued_and_all_before_a_checkpoint(tmp_path):
    """Pipelined (the CUDA default), step N's figures are published once step N+1 is launched,
    and every launched step's before a checkpoint commits: the same records, one step later."""
    import json
    logs = {}
    for pipelined in (False, True):
        loop, link, readers = build(tmp_path / str(pipelined), checkpoint={"every_steps": 3})
        loop.pipelined = pipelined
        readers.pool_of_read = "p0"
        path = tmp_path / f"steps-{pipelined}.jsonl"
        loop.step_log = open(path, "w")
        loop.resume(registered())
        link.inbox.extend([assign(0, [0, 1, 2], 1), assign(1, [3, 4, 5, 6, 7], 2)])
        published = []
        while loop.trainer.step_count < 3:
            assert loop.pass_once()
            published.append((loop.trainer.step_count, link.metrics.get("step")))
        loop.step_log.close()
        logs[pipelined] = [json.loads(line) for line in open(path)]
        if pipelined:
            launched = [(s, m) for s, m in published if s < 3 and s > 0]
            assert all(m == (s - 1 or None) for s, m in launched), published  # one step behind
            (commit,) = link.of(p.Committed)
            assert commit.step == 3 and link.metrics["step"] == 3.0 and loop.pending is None
    keys = ("step", "loss", "anchors", "tokens", "lr", "grad_norm")
    assert [tuple(r[k] for k in keys) for r in logs[True]] == [tuple(r[k] for k in keys) for r in logs[False]]
    assert [r["step"] for r in logs[True]] == [1, 2, 3]


def test_a_step_that_fails_to_launch_still_publishes_the_step_before_it(tmp_path):
    import json
    loop, link, readers = build(tmp_path, checkpoint={"every_steps": 100})
    loop.pipelined = True
    readers.pool_of_read = "p0"
    path = tmp_path / "steps.jsonl"
    loop.step_log = open(path, "w")
    loop.resume(registered())
    link.inbox.extend([assign(0, [0, 1, 2], 1), assign(1, [3, 4, 5, 6, 7], 2)])
    while loop.trainer.step_count < 1:
        assert loop.pass_once()
    assert loop.pending is not None and path.read_text() == ""

    def out_of_memory(chosen, **options):
        raise torch.OutOfMemoryError("CUDA out of memory")

    loop.trainer.launch = out_of_memory
    with pytest.raises(torch.OutOfMemoryError):
        while True:
            loop.pass_once()
    loop.step_log.close()
    assert [json.loads(line)["step"] for line in open(path)] == [1] and loop.pending is None
