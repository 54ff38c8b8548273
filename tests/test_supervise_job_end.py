"""The end of a job that exited 0: its checkpoint and the eval/report/export lines with its paths."""

import os

from click.testing import CliRunner

from dflash_ipc.config.load import load_config
from dflash_ipc.run.checkpoints import CheckpointStore
from dflash_ipc.supervise.job_end import next_steps

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cfg(tmp_path):
    return load_config(os.path.join(REPO, "configs", "default.yaml"),
                       [f"run.run_dir={tmp_path / 'my run'}", f"target.path={tmp_path / 'target'}",
                        f"data.path={tmp_path / 'data'}"])


def _commit(cfg, step: int) -> str:
    store = CheckpointStore(cfg.files.checkpoints)
    os.makedirs(store.root, exist_ok=True)
    path = store.write(step, lambda d: open(os.path.join(d, "config.json"), "w").close())
    store.mark_latest(step)
    return path


def test_the_end_of_a_job_names_its_checkpoint_and_the_next_commands(tmp_path):
    cfg = _cfg(tmp_path)
    assert next_steps(cfg) == [f"no committed checkpoint in {cfg.files.checkpoints}"]
    _commit(cfg, 3)
    step = _commit(cfg, 7)
    run = f"'{tmp_path}/my run'"  # quoted: the lines paste into a shell as they are
    ckpt = f"'{step}'"
    assert next_steps(cfg) == [
        f"checkpoint: {step}",
        "next:",
        f"  dflash-ipc eval --target {tmp_path}/target --drafter {ckpt} --data {tmp_path}/data --save-to {run}",
        f"  dflash-ipc report {run}",
        f"  dflash-ipc export {ckpt} '{tmp_path}/my run/export'",
    ]


def test_up_prints_them_when_the_job_ends_with_code_0(tmp_path, monkeypatch):
    from dflash_ipc.cli import job, main
    from dflash_ipc.supervise import supervisor as supervisor_mod
    cfg = _cfg(tmp_path)
    step = _commit(cfg, 5)

    class Finished:
        def __init__(self, cfg, run_lock=None):
            self.run_lock = run_lock

        def claim(self):
            pass

        def run(self):
            return 0

    monkeypatch.setattr(job, "resolved", lambda c: c)
    monkeypatch.setattr(supervisor_mod, "Supervisor", Finished)
    result = CliRunner().invoke(main, ["up", "--config", os.path.join(REPO, "configs", "default.yaml"),
                                       "-o", f"run.run_dir={cfg.run.run_dir}", "-o", f"target.path={tmp_path}/target",
                                       "-o", f"data.path={tmp_path}/data"])
    assert result.exit_code == 0, result.output
    assert f"checkpoint: {step}\nnext:\n  dflash-ipc eval --target" in result.output


def test_up_stopped_by_ctrl_c_names_its_checkpoint_and_how_to_resume(tmp_path, monkeypatch):
    from dflash_ipc.cli import job, main
    from dflash_ipc.supervise import supervisor as supervisor_mod
    cfg = _cfg(tmp_path)
    step = _commit(cfg, 11)

    class Stopped:
        def __init__(self, cfg, run_lock=None):
            self.run_lock = run_lock

        def run(self):
            return 130

    monkeypatch.setattr(job, "resolved", lambda c: c)
    monkeypatch.setattr(supervisor_mod, "Supervisor", Stopped)
    result = CliRunner().invoke(main, ["up", "--config", os.path.join(REPO, "configs", "default.yaml"),
                                       "-o", f"run.run_dir={cfg.run.run_dir}", "-o", f"target.path={tmp_path}/target",
                                       "-o", f"data.path={tmp_path}/data"])
    assert result.exit_code == 130
    assert result.output.splitlines()[-2:] == [
        f"stopped; checkpoint: {step}",
        f"resume: rerun the same command (run.run_dir='{tmp_path}/my run' continues from its newest checkpoint)"]
