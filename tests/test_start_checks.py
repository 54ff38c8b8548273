"""What `up` refuses before any child starts: a run directory that cannot be one, devices the
machine lacks, a finished run directory rerun with another plan."""

import io
import os

import numpy as np
import pytest

from dflash_ipc.config.load import load_config
from dflash_ipc.data.dataset import DatasetWriter, TokenDataset
from dflash_ipc.dispatch.ledger import Ledger
from dflash_ipc.dispatch.ledger_file import save_ledger
from dflash_ipc.errors import ConfigError, DataError
from dflash_ipc.target.resolve import check_run_dir


def test_a_run_directory_that_is_a_file_or_under_one_is_refused(tmp_path):
    (tmp_path / "afile").write_text("")
    with pytest.raises(ConfigError, match="afile exists and is not a directory"):
        check_run_dir(str(tmp_path / "afile"))
    with pytest.raises(ConfigError, match="cannot be made: .*afile is not a directory"):
        check_run_dir(str(tmp_path / "afile" / "run"))
    check_run_dir(str(tmp_path / "new" / "run"))  # can be made


def test_a_missing_gpu_stops_up_before_any_child_or_file(tmp_path):
    """`cuda:9` on a machine without it is a config error before the first child: no restart
    of a child could ever cure it (it used to be retried 3 times, 70 s)."""
    from dflash_ipc.supervise.supervisor import Supervisor
    cfg = load_config(None, [f"run.run_dir={tmp_path / 'run'}", "target.num_workers=1", "drafter.num_workers=1",
                             "target.devices=[cuda:8]", "drafter.devices=[cuda:9]"])
    supervisor = Supervisor(cfg, status_out=io.StringIO())
    with pytest.raises(ConfigError, match="cuda:8, cuda:9 do not exist"):
        supervisor.start()
    assert supervisor.children == {} and not (tmp_path / "run").exists()


def test_rerunning_a_finished_run_directory_with_another_plan_is_refused(tmp_path):
    """A finished run directory rerun with other data, budget or seed is refused (it exited 0
    with 'holds a finished job'); with the same plan it is recognised as finished."""
    from dflash_ipc.dispatch.proc import finished_before as _finished_before
    from dflash_ipc.dispatch.proc import plan_job
    rng = np.random.default_rng(0)
    with DatasetWriter(str(tmp_path / "data"), tokenizer_fingerprint="sha256:test") as writer:
        for length in rng.integers(8, 60, size=12):
            writer.add(np.arange(length), np.ones(length, bool))
        writer.close()
    flags = [f"run.run_dir={tmp_path / 'run'}", f"data.path={tmp_path / 'data'}", "data.bucket_boundaries=[64]",
             "data.token_budget=128"]
    cfg = load_config(None, flags)
    os.makedirs(cfg.run.run_dir)
    assert not _finished_before(cfg)  # no ledger yet
    ledger = Ledger()
    for batches in plan_job(cfg, TokenDataset(cfg.data.path).lengths):
        ledger.add_epoch(batches)
    save_ledger(ledger, cfg.files.ledger)
    assert not _finished_before(cfg)  # the same plan, not finished
    for change in ("run.seed=7", "data.token_budget=256", "data.num_epochs=2"):
        with pytest.raises(DataError, match="use a new run.run_dir"):
            _finished_before(load_config(None, flags + [change]))



def _prepared(tmp_path):
    rng = np.random.default_rng(0)
    with DatasetWriter(str(tmp_path / "data"), tokenizer_fingerprint="sha256:test") as writer:
        for length in rng.integers(8, 60, size=12):
            writer.add(np.arange(length), np.ones(length, bool))
        writer.close()
    return [f"run.run_dir={tmp_path / 'run'}", f"data.path={tmp_path / 'data'}", "data.bucket_boundaries=[64]",
            "data.token_budget=128"]


def test_a_finished_ledger_whose_last_checkpoint_is_not_on_disk_is_refused(tmp_path):
    """A ledger of a finished run of the same plan restored beside checkpoints that stop
    earlier: not "finished" (exit 0, nothing trained), one error naming the missing step."""
    from dflash_ipc.dispatch.ledger import TrainedCopy
    from dflash_ipc.dispatch.proc import finished_before, plan_job
    from dflash_ipc.run.checkpoints import MANIFEST, CheckpointStore
    cfg = load_config(None, _prepared(tmp_path))
    os.makedirs(cfg.run.run_dir)
    ledger = Ledger()
    for batches in plan_job(cfg, TokenDataset(cfg.data.path).lengths):
        ledger.add_epoch(batches)
    ledger.open_pool("t0", 1)
    for i, batch in enumerate(list(ledger.pending_batches())):
        work = ledger.lease(batch.batch_id, "t0")
        ledger.produced(batch.batch_id, "t0", work.slot)
        attempt = ledger.assign(batch.batch_id, "d0")
        ledger.consumed(batch.batch_id, "d0", attempt)
        ledger.commit(10 if i == 0 else 31, [TrainedCopy(batch.batch_id, "d0", attempt, batch.sample_ids)])
    assert ledger.all_committed() and ledger.last_committed_step() == 31
    save_ledger(ledger, cfg.files.ledger)
    store = CheckpointStore(cfg.files.checkpoints)
    os.makedirs(store.path(10))
    open(os.path.join(store.path(10), MANIFEST), "w").close()
    with pytest.raises(DataError, match=r"ledger.npz: says every batch is committed, the last at checkpoint step "
                                        r"31, but .*step_00000031 is not on disk"):
        finished_before(cfg)
    os.makedirs(store.path(31))
    open(os.path.join(store.path(31), MANIFEST), "w").close()
    assert finished_before(cfg)


@pytest.mark.parametrize("text, needle", [
    ("garbage\n", "holds 'garbage', not a drafter generation"),
    ("9" * 5000, "holds 5000 bytes, not a drafter generation"),
    (f"{2 ** 70}\n", f"holds {2 ** 70}, past 2\\^62"),
    ("-7\n", "holds '-7', not a drafter generation"),
])
def test_a_damaged_drafter_generation_file_is_one_error_at_the_start(tmp_path, text, needle):
    from dflash_ipc.dispatch.proc import next_generation
    cfg = load_config(None, _prepared(tmp_path))
    os.makedirs(cfg.run.run_dir)
    with open(cfg.files.drafter_generation, "w") as f:
        f.write(text)
    with pytest.raises(DataError, match=needle) as info:
        next_generation(cfg)
    assert str(info.value).startswith(cfg.files.drafter_generation) and "remove it" in str(info.value)
    with open(cfg.files.drafter_generation, "w") as f:
        f.write("4\n")
    assert next_generation(cfg) == 5


def test_a_token_id_past_the_targets_vocabulary_stops_the_job_at_its_start(tmp_path, tiny_cache):
    """One id of 2^30 in tokens.bin: refused when the job is resolved, not when its batch comes."""
    from transformers import AutoTokenizer

    from dflash_ipc.config.load import config_from_dict
    from dflash_ipc.data.dataset import tokenizer_fingerprint
    from dflash_ipc.target.resolve import resolve_job
    target = os.path.join(tiny_cache, "tiny-target")
    fingerprint = tokenizer_fingerprint(AutoTokenizer.from_pretrained(target))
    for name, bad in (("ok", None), ("bad", 2 ** 30)):
        with DatasetWriter(str(tmp_path / name), tokenizer_fingerprint=fingerprint) as writer:
            for i in range(6):
                ids = np.arange(10, 40) + i
                if bad is not None and i == 4:
                    ids[5] = bad
                writer.add(ids, np.ones(len(ids), bool))
            writer.close()
    cfg = {"run": {"run_dir": str(tmp_path / "run")}, "target": {"path": target},
           "data": {"bucket_boundaries": [64], "token_budget": 128},
           "model": {"mask_token_id": 5, "num_layers": 1}}
    resolve_job(config_from_dict({**cfg, "data": {**cfg["data"], "path": str(tmp_path / "ok")}}))
    with pytest.raises(DataError, match=r"tokens.bin: token 125 \(of sample 4\) is id 1073741824, outside the "
                                        r"vocabulary of the target .*tiny-target \[0, "):
        resolve_job(config_from_dict({**cfg, "data": {**cfg["data"], "path": str(tmp_path / "bad")}}))

def test_a_run_directory_in_use_is_refused_until_the_last_process_of_its_job_exits(tmp_path):
    """The lock is held by the supervisor and inherited by its children: a rerun while a killed
    supervisor's children still unwind is refused, and allowed once they are gone."""
    import subprocess
    import sys

    from dflash_ipc.run.lock import RunLock
    first = RunLock(str(tmp_path))
    first.acquire()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], pass_fds=(first.fd,))
    try:
        first.release()  # the supervisor is gone; its child is not
        with pytest.raises(ConfigError, match=rf"run.run_dir: {tmp_path} is in use .*supervisor was pid {os.getpid()}"):
            RunLock(str(tmp_path)).acquire()
    finally:
        child.kill()
        child.wait(10)
    again = RunLock(str(tmp_path))
    again.acquire()  # the job's last process exited: free
    node1 = RunLock(str(tmp_path), node_rank=1)
    node1.acquire()  # node 1 of a shared run directory has its own lock
    assert node1.path.endswith(".lock-node1")
    again.release()
    node1.release()


def test_up_refuses_a_run_directory_another_job_holds_and_leaves_that_job_alone(tmp_path):
    """Refused by the lock before anything of the run directory is touched: the running job's
    socket, segments and tracker files stay as they are."""
    from dflash_ipc.run.lock import RunLock
    from dflash_ipc.supervise.supervisor import Supervisor
    from dflash_ipc.transport.backends import create_pool
    from dflash_ipc.transport.slots import SlotLayout
    cfg = load_config(None, [f"run.run_dir={tmp_path}", "target.num_workers=1", "drafter.num_workers=1"])
    held = RunLock(cfg.run.run_dir)
    held.acquire()
    socket_file = cfg.dispatcher_address[len("ipc://"):]
    open(socket_file, "w").close()  # the running job's dispatcher socket
    pool = create_pool(SlotLayout(1, 1, 1, "float32"), "cpu", name=cfg.files.pool_name(0))  # and a pool of it
    try:
        supervisor = Supervisor(cfg, status_out=io.StringIO())
        with pytest.raises(ConfigError, match="is in use by another job"):
            supervisor.run()
        assert supervisor.children == {} and not os.path.exists(cfg.files.config)
        assert os.path.exists(socket_file) and os.path.exists(os.path.join("/dev/shm", pool.descriptor()["segment"]))
        assert not os.path.exists(cfg.files.tensorboard)
    finally:
        pool.close()
        held.release()


def test_init_from_of_another_shape_stops_up_before_any_child(tmp_path):
    """`up`'s check of drafter.init_from against the job's drafter: one error at
    start, naming the difference; a run directory with checkpoints (a resume) skips it."""
    import torch

    from dflash_ipc.drafter.inference_format import save_inference_checkpoint
    from dflash_ipc.drafter.model import DFlashConfig, DFlashDraftModel
    from dflash_ipc.drafter.warm_start import resolve_init_from
    target = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4, "num_attention_heads": 2,
              "num_key_value_heads": 1, "head_dim": 16, "vocab_size": 64}
    job = DFlashConfig.from_target_config(target, num_draft_layers=1, block_size=4, mask_token_id=63,
                                          target_layer_ids=[0, 1])
    save_inference_checkpoint(DFlashDraftModel(job), str(tmp_path / "same"), dtype=torch.float32)
    save_inference_checkpoint(DFlashDraftModel(DFlashConfig.from_target_config(
        target, num_draft_layers=2, block_size=4, mask_token_id=63, target_layer_ids=[0, 1])),
        str(tmp_path / "deeper"), dtype=torch.float32)

    def cfg(init_from):
        return load_config(None, [f"run.run_dir={tmp_path / 'run'}", f"drafter.init_from={init_from}",
                                  "model.num_layers=1", "model.block_size=4", "model.mask_token_id=63",
                                  "model.target_layer_ids=[0,1]"])
    ok = cfg(tmp_path / "same")
    resolve_init_from(ok, target)
    assert ok.drafter.init_from == str(tmp_path / "same")
    with pytest.raises(ConfigError, match=r"is not a drafter of this job's shape: num_hidden_layers: export 2, "
                                          r"job 1 \(model.num_layers\)\. Set"):
        resolve_init_from(cfg(tmp_path / "deeper"), target)
    with pytest.raises(ConfigError, match="drafter.init_from: .*missing is not a directory"):
        resolve_init_from(cfg(tmp_path / "missing"), target)
    os.makedirs(tmp_path / "run" / "checkpoints" / "step_00000002")
    resumed = cfg(tmp_path / "deeper")
    resolve_init_from(resumed, target)  # the resume wins: nothing checked


def test_a_node_without_the_jobs_secret_polls_untrusted(tmp_path, caplog):
    """The status poller of a node that lacks `keys/job_secret` goes untrusted, with one warning
    (the except clause named an error that was not imported: a NameError)."""
    from dflash_ipc.supervise.supervisor import Supervisor
    cfg = load_config(None, [f"run.run_dir={tmp_path}"])
    with caplog.at_level("WARNING"):
        assert Supervisor(cfg, status_out=io.StringIO())._observer_secret() is None
    assert "status polls go untrusted" in caplog.text and "secret is missing" in caplog.text
