"""Checkpoints are data: checksummed, verified, never executed; damage falls back, uncommitted
checkpoints are set aside."""

import json
import os
import pickle

import pytest
import torch

from dflash_ipc.config.load import config_from_dict
from dflash_ipc.run.checkpoints import (LATEST, MANIFEST, STATE_JSON, STATE_TENSORS, CheckpointStore,
                                                 sha256_of, verify_dir, write_json_file)
from dflash_ipc.drafter.inference_format import export_training_checkpoint, load_inference_checkpoint
from dflash_ipc.drafter.model import DFlashConfig
from dflash_ipc.hf.target_head import FrozenTargetHead
from dflash_ipc.drafter.trainer import DrafterTrainer
from dflash_ipc.errors import DamagedCheckpointError, DataError

VOCAB, HIDDEN = 64, 32


def _trainer(seed=0):
    # AdamW and one schedule: the crafted cases below edit that state's fields (betas, one lr_lambda)
    cfg = config_from_dict({"drafter": {"dtype": "float32", "attention": "dense"}, "run": {"seed": seed},
                            "model": {"num_layers": 1, "target_layer_ids": [0, 1]}, "optimizer": {"name": "adamw"}})
    config = DFlashConfig(hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                          num_key_value_heads=1, head_dim=16, vocab_size=VOCAB, target_layer_ids=[0, 1],
                          num_target_layers=4, mask_token_id=VOCAB - 1, block_size=4)
    g = torch.Generator().manual_seed(1)
    head = FrozenTargetHead(torch.randn(VOCAB, HIDDEN, generator=g), torch.randn(VOCAB, HIDDEN, generator=g))
    return DrafterTrainer(cfg, config, head, device="cpu", total_steps=10)


@pytest.fixture
def store(tmp_path):
    store = CheckpointStore(str(tmp_path / "checkpoints"))
    trainer = _trainer()
    for step in (10, 20, 30):
        trainer.step_count = step
        trainer.save_checkpoint(store, extra={"step": step})
    return store


def test_a_checkpoint_is_complete_and_verifies(store):
    step_dir = store.path(20)
    assert sorted(os.listdir(step_dir)) == ["config.json", MANIFEST, "model.safetensors", STATE_JSON, STATE_TENSORS]
    manifest = verify_dir(step_dir)
    assert manifest["step"] == 20 and set(manifest["files"]) == set(os.listdir(step_dir)) - {MANIFEST}
    resumed = _trainer(seed=5)
    assert resumed.resume(store, 20) == {"step": 20} and resumed.step_count == 20


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete", "manifest"])
def test_a_damaged_checkpoint_is_one_line_naming_the_file_and_resume_falls_back(store, damage):
    path = os.path.join(store.path(30), STATE_TENSORS)
    data = bytearray(open(path, "rb").read())
    if damage == "flip":
        data[len(data) // 2] ^= 0x01
        open(path, "wb").write(bytes(data))
    elif damage == "truncate":
        open(path, "wb").write(bytes(data[:-100]))
    elif damage == "delete":
        os.unlink(path)
    else:
        path = os.path.join(store.path(30), MANIFEST)
        open(path, "w").write("{not json")
    with pytest.raises(DamagedCheckpointError) as info:
        _trainer().resume(store, 30)
    assert path in str(info.value) and "\n" not in str(info.value)
    assert store.newest_intact([10, 20, 30]) == 20
    assert store.newest_intact([30]) == -1


def test_nothing_in_a_checkpoint_directory_is_ever_executed(store, tmp_path):
    """A pickle planted where the previous format kept its training state (or anywhere) is
    never loaded: resume and export read only safetensors and JSON."""
    marker = tmp_path / "owned"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    for name in ("training_state.pt", "extra.pkl"):
        with open(os.path.join(store.path(30), name), "wb") as f:
            pickle.dump(Payload(), f)
    _trainer().resume(store, 30)
    store.mark_latest(30)
    export_training_checkpoint(store.root, str(tmp_path / "export"))
    assert not marker.exists()
    assert load_inference_checkpoint(str(tmp_path / "export")).config.hidden_size == HIDDEN


def test_export_reads_the_checksums_of_a_checkpoint_once(store, tmp_path, monkeypatch):
    """`dflash-ipc export` verifies the step directory once (its training state may be many GB)."""
    from click.testing import CliRunner

    from dflash_ipc.cli import main
    from dflash_ipc.drafter import inference_format as export_module
    calls = []
    real = export_module.verify_dir
    monkeypatch.setattr(export_module, "verify_dir", lambda d: calls.append(d) or real(d))
    store.mark_latest(30)
    result = CliRunner().invoke(main, ["export", store.root, str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    assert calls == [store.path(30)]


def test_hostile_json_is_refused_cleanly(store):
    state = os.path.join(store.path(20), STATE_JSON)
    open(state, "w").write("[" * 100_000 + "]" * 100_000)
    with pytest.raises(DamagedCheckpointError):  # the manifest no longer matches
        _trainer().resume(store, 20)
    latest = os.path.join(store.root, LATEST)
    for record in ({"step": 1, "path": "../../etc"}, {"step": 1}, ["x"]):
        open(latest, "w").write(json.dumps(record))
        with pytest.raises(DamagedCheckpointError, match="latest.json"):
            store.latest()


def _remanifest(step_dir):
    """Rewrites the manifest over the files as they are: a crafted checkpoint, not a damaged one."""
    from dflash_ipc.run.checkpoints import sha256_of, write_json_file
    files = {n: {"bytes": os.path.getsize(os.path.join(step_dir, n)), "sha256": sha256_of(os.path.join(step_dir, n))}
             for n in sorted(os.listdir(step_dir)) if n != MANIFEST}
    write_json_file(os.path.join(step_dir, MANIFEST), {"format": 1, "step": 20, "files": files})


@pytest.mark.parametrize("craft", ["tensor name", "tensor index", "plain index", "plain entry"])
def test_a_crafted_optimizer_state_that_verifies_is_still_one_clear_error(store, craft):
    from safetensors.torch import load_file, save_file
    step_dir = store.path(20)
    tensors_path, meta_path = os.path.join(step_dir, STATE_TENSORS), os.path.join(step_dir, STATE_JSON)
    if craft.startswith("tensor"):
        tensors = load_file(tensors_path)
        tensors["optimizer.x.exp_avg" if craft == "tensor name" else "optimizer.9999.exp_avg"] = torch.zeros(2)
        save_file(tensors, tensors_path, metadata={"format": "1"})
    else:
        meta = json.load(open(meta_path))
        meta["optimizer_plain_state"] = {"zero": {"a": 1}} if craft == "plain index" else {"0": [1, 2]}
        json.dump(meta, open(meta_path, "w"))
    _remanifest(step_dir)
    with pytest.raises(DamagedCheckpointError) as info:
        _trainer().resume(store, 20)
    assert step_dir in str(info.value) and "\n" not in str(info.value)


def test_checkpoints_newer_than_the_last_commit_are_set_aside_and_never_resumed(store):
    store.mark_latest(30)
    moved = store.quarantine_after(10)
    assert [os.path.basename(m).split("-")[0] for m in moved] == ["step_00000020", "step_00000030"]
    assert store.steps_on_disk() == [10] and store.uncommitted() == sorted(moved)
    # latest.json still names step 30 until the group resumes: read, it is a clear error,
    # never the set-aside checkpoint
    with pytest.raises(DamagedCheckpointError, match=r"names step_00000030, which is not in .* \(set aside"):
        store.latest()
    store.mark_latest(10)  # what rank 0 writes once the dispatcher confirms the resume
    assert store.latest() == store.path(10)
    assert store.quarantine_after(None) and store.steps_on_disk() == []
    store.mark_latest(None)  # a resume from no checkpoint
    assert store.latest() is None


def test_what_a_writer_killed_mid_write_left_is_cleared_and_a_cut_swap_undone(store, tmp_path):
    """`write` goes through step_N.tmp-<pid> (and step_N.old-<pid> when it replaces a step):
    a rank 0 killed there leaves a checkpoint's worth of files under a name nothing reads."""
    import shutil
    import subprocess
    import sys

    from dflash_ipc.dispatch.ledger_file import remove_partial_saves
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(30)  # its pid: a writer that no longer runs
    root = store.root
    shutil.copytree(store.path(10), os.path.join(root, f"step_00000040.tmp-{gone.pid}"))  # cut mid-write
    os.replace(store.path(20), os.path.join(root, f"step_00000020.old-{gone.pid}"))  # cut between the renames
    shutil.copytree(store.path(30), os.path.join(root, f"step_00000030.old-{gone.pid}"))  # cut after the second
    shutil.copytree(store.path(10), os.path.join(root, f"step_00000050.tmp-{os.getpid()}"))  # a live writer's
    touched = store.remove_partial_writes()
    assert sorted(os.path.basename(p) for p in touched) == [f"step_00000020.old-{gone.pid}",
                                                            f"step_00000030.old-{gone.pid}",
                                                            f"step_00000040.tmp-{gone.pid}"]
    assert sorted(os.listdir(root)) == ["step_00000010", "step_00000020", "step_00000030",
                                        f"step_00000050.tmp-{os.getpid()}"]
    assert verify_dir(store.path(20))["step"] == 20  # the swapped-out checkpoint is back, whole
    # The dispatcher's ledger: a save cut short leaves its temp file next to the ledger.
    (tmp_path / "ledger.npz").write_bytes(b"kept")
    (tmp_path / ".ledger-k2j3.tmp").write_bytes(b"partial")
    assert remove_partial_saves(str(tmp_path / "ledger.npz")) == 1
    assert (tmp_path / "ledger.npz").read_bytes() == b"kept" and not (tmp_path / ".ledger-k2j3.tmp").exists()


def test_export_refuses_a_damaged_checkpoint(store, tmp_path):
    store.mark_latest(30)
    with open(os.path.join(store.path(30), "model.safetensors"), "r+b") as f:
        f.seek(200)
        f.write(b"\xff\xff")
    with pytest.raises(DataError, match="checksum"):
        export_training_checkpoint(store.root, str(tmp_path / "x"))


def _rewrite_manifest(step_dir: str, drop: str | None = None) -> None:
    """A manifest that matches the files as they are now: what a crafter would write."""
    files = {n: {"bytes": os.path.getsize(os.path.join(step_dir, n)), "sha256": sha256_of(os.path.join(step_dir, n))}
             for n in sorted(os.listdir(step_dir)) if n not in (MANIFEST, drop)}
    write_json_file(os.path.join(step_dir, MANIFEST), {"format": 1, "step": 30, "files": files})


def _edit_json(step_dir, change):
    path = os.path.join(step_dir, STATE_JSON)
    meta = json.load(open(path))
    change(meta)
    open(path, "w").write(json.dumps(meta))


def _edit_tensors(step_dir, change):
    from safetensors.torch import load_file, save_file
    path = os.path.join(step_dir, STATE_TENSORS)
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path, metadata={"format": "1"})


def _model_tensors_to_int(t):
    t.update({k: v.to(torch.int64) for k, v in list(t.items()) if k.startswith("model.")})


CRAFTED = [
    (lambda d: _edit_json(d, lambda m: m["scheduler"].update(get_lr=5)), STATE_JSON, "scheduler: unknown key 'get_lr'"),
    (lambda d: _edit_json(d, lambda m: m["scheduler"].update(lr_lambdas=[{"__dict__": 1}])), STATE_JSON,
     r"scheduler.lr_lambdas\[0\]: expected NoneType"),
    (lambda d: _edit_json(d, lambda m: m.pop("scheduler")), STATE_JSON, "field scheduler must be an object"),
    (lambda d: _edit_json(d, lambda m: m["param_groups"][0].update(lr="fast")), STATE_JSON,
     r"param_groups\[0\].lr: expected a finite float >= 0, got 'fast'"),
    (lambda d: _edit_json(d, lambda m: m["param_groups"][0].update(weight_decay=-1.0)), STATE_JSON, ">= 0"),
    (lambda d: _edit_json(d, lambda m: m["param_groups"][0].update(betas=[0.9])), STATE_JSON, "expected a list of 2"),
    (lambda d: _edit_json(d, lambda m: m.update(step="30")), STATE_JSON, "field step must be an integer"),
    (lambda d: _edit_json(d, lambda m: m.update(extra=[])), STATE_JSON, "field extra must be an object"),
    (lambda d: _edit_json(d, lambda m: m.update(optimizer_plain_state={"0": {"eval": "x"}})), STATE_JSON,
     "optimizer_plain_state.0: unknown key 'eval'"),
    (lambda d: _edit_tensors(d, lambda t: t.update({"optimizer.x.exp_avg": torch.zeros(1)})), STATE_TENSORS,
     "names no optimizer state"),
    (lambda d: _edit_tensors(d, lambda t: t.update({"optimizer.1": torch.zeros(1)})), STATE_TENSORS, "names no optimizer state"),
    (lambda d: _edit_tensors(d, lambda t: t.update({"optimizer.0.step": torch.zeros(5)})), STATE_TENSORS,
     r"optimizer.0.step is torch.float32 \(5,\), the optimizer keeps a float \(\)"),
    (lambda d: _edit_tensors(d, _model_tensors_to_int), STATE_TENSORS, "is torch.int64"),
    (lambda d: _edit_tensors(d, lambda t: t.update({"rng.torch": torch.zeros(3, dtype=torch.uint8)})), STATE_TENSORS,
     "rng.torch missing or not a torch.uint8"),
    (lambda d: None, MANIFEST, f"does not list {STATE_TENSORS}"),
]


@pytest.mark.parametrize("craft, file, needle", CRAFTED)
def test_a_crafted_checkpoint_with_a_matching_manifest_is_refused_before_anything_is_loaded(store, craft, file,
                                                                                            needle):
    """A downloaded checkpoint's manifest proves nothing about who wrote it: every value of the
    training state is checked against what this drafter would write, so a crafted file can
    neither crash resume with a traceback nor set attributes on the live scheduler."""
    step_dir = store.path(30)
    craft(step_dir)
    _rewrite_manifest(step_dir, drop=STATE_TENSORS if file == MANIFEST else None)
    trainer = _trainer(seed=4)
    before = dict(vars(trainer.scheduler))
    with pytest.raises(DamagedCheckpointError, match=needle) as info:
        trainer.resume(store, 30)
    assert os.path.join(step_dir, file) in str(info.value) and "\n" not in str(info.value)
    assert set(vars(trainer.scheduler)) == set(before) and trainer.step_count == 0


def test_evaluating_a_damaged_checkpoint_step_is_refused(store):
    from dflash_ipc.eval.speculative import load_drafter
    assert load_drafter(store.path(20), device="cpu", dtype=torch.float32)[1] == store.path(20)
    with open(os.path.join(store.path(20), "model.safetensors"), "r+b") as f:
        f.seek(os.path.getsize(f.name) - 3)
        f.write(b"\x00\x01\x02")
    with pytest.raises(DamagedCheckpointError, match="model.safetensors: checksum differs"):
        load_drafter(store.path(20), device="cpu", dtype=torch.float32)


def test_the_supervisors_start_sets_aside_what_the_ledger_never_committed(store, tmp_path):
    """A supervisor killed between a checkpoint and its commit: the next start (before any
    child) moves the checkpoints newer than the ledger's last commit aside."""
    from dflash_ipc.config.load import load_config
    from dflash_ipc.dispatch.buckets import PlannedBatch
    from dflash_ipc.dispatch.ledger import Ledger, TrainedCopy
    from dflash_ipc.dispatch.ledger_file import save_ledger
    from dflash_ipc.supervise.supervisor import quarantine_uncommitted_checkpoints
    run_dir = os.path.dirname(store.root)
    cfg = load_config(None, [f"run.run_dir={run_dir}"])
    assert quarantine_uncommitted_checkpoints(cfg) == []  # no ledger yet: nothing is judged
    led = Ledger()
    led.add_epoch([PlannedBatch(batch_id=0, epoch=0, bucket=0, sample_ids=(0, 1), lengths=(4, 4), padded_len=8)])
    led.open_pool(0, 1)
    led.produced(0, 0, led.lease(0, 0).slot)
    attempt = led.assign(0, 0)
    led.consumed(0, 0, attempt)
    led.commit(20, [TrainedCopy(0, 0, attempt, (0,))])
    save_ledger(led, cfg.files.ledger)
    moved = quarantine_uncommitted_checkpoints(cfg)
    assert [os.path.basename(m).split("-")[0] for m in moved] == ["step_00000030"]
    assert store.steps_on_disk() == [10, 20] and store.uncommitted() == moved


def _step_dirs(root, steps):
    store = CheckpointStore(str(root))
    for step in steps:
        os.makedirs(store.path(step))
    return store


def test_keep_last_deletes_only_checkpoints_no_resume_needs(tmp_path):
    store = _step_dirs(tmp_path / "ck", (10, 20, 30, 40, 50, 60))
    store.mark_latest(20)  # latest.json not yet moved on: its step stays
    assert store.retain(40, keep_last=0) == [] and store.retain(40, keep_last=None) == []
    # 40 is the last commit; 50 and 60 are written, their commits not answered; 10 is the best.
    assert store.retain(40, keep_last=1, best_step=10) == [30]
    assert store.steps_on_disk() == [10, 20, 40, 50, 60]
    store.mark_latest(40)
    assert store.retain(40, keep_last=2) == [10] and store.steps_on_disk() == [20, 40, 50, 60]
    # Retention never moves latest.json: the step it names stays until it is marked past it.
    assert store.retain(60, keep_last=1) == [20, 50] and store.steps_on_disk() == [40, 60]
    store.mark_latest(60)
    assert store.retain(60, keep_last=1) == [40] and store.steps_on_disk() == [60]


def test_a_deletion_cut_short_is_cleared_never_restored(tmp_path):
    import subprocess
    import sys
    store = _step_dirs(tmp_path / "ck", (10, 20))
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(30)
    os.replace(store.path(10), os.path.join(store.root, f"step_00000010.deleted-{gone.pid}"))
    assert len(store.remove_partial_writes()) == 1
    assert sorted(os.listdir(store.root)) == ["step_00000020"]


@pytest.mark.timeout(20)
@pytest.mark.parametrize("kind", ["dev-zero", "fifo", "outside"])
def test_a_manifest_listing_a_file_that_is_not_a_regular_file_inside_is_refused_not_read(store, tmp_path, kind):
    """A crafted manifest lists an extra file that is a symlink to /dev/zero (its checksum would
    read forever), a FIFO (its open would block forever) or a symlink out of the checkpoint."""
    step_dir = store.path(30)
    extra = os.path.join(step_dir, "extra.bin")
    if kind == "dev-zero":
        os.symlink("/dev/zero", extra)
    elif kind == "fifo":
        os.mkfifo(extra)
    else:
        (tmp_path / "secret").write_bytes(b"x")
        os.symlink(tmp_path / "secret", extra)
    manifest = json.loads(open(os.path.join(step_dir, MANIFEST)).read())
    manifest["files"]["extra.bin"] = {"bytes": 0 if kind != "outside" else 1, "sha256": "0" * 64}
    write_json_file(os.path.join(step_dir, MANIFEST), manifest)
    needle = {"dev-zero": "is a character device", "fifo": "is a FIFO", "outside": "is a symlink to .*, outside"}[kind]
    with pytest.raises(DamagedCheckpointError, match=f"extra.bin: a checkpoint file {needle}"):
        verify_dir(step_dir)
    store.mark_latest(30)
    with pytest.raises(DataError, match=needle):
        export_training_checkpoint(store.root, str(tmp_path / "x"))
    assert store.newest_intact([10, 20, 30]) == 20  # resume falls back to an intact one
    with pytest.raises(DamagedCheckpointError, match=needle):
        _trainer(seed=5).resume(store, 30)
