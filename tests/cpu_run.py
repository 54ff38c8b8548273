"""One small real job on CPU and what a user does after it, shared by the tests of what a run
leaves behind (report, trackers, model card, --with-code export): `dflash-ipc up` (2 targets,
1 drafter, 1 epoch, TensorBoard and W&B in offline mode), then `dflash-ipc eval --save-to`.

Built once per test session by the `cpu_run` fixture (conftest.py): the job is most of the
cost, and every test reads the same run directory without changing it.
"""

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from supervised_job import SMALL_JOB, SupervisedJob

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT_S = 240
EVAL_PROMPTS = 4
EVAL_NEW_TOKENS = 24
# SMALL_JOB with one epoch and 2 + 1 workers; the target given by path skips the closing eval.
JOB = [*SMALL_JOB, "data.num_epochs=1", "target.num_workers=2", "drafter.num_workers=1",
       "metrics.sinks=[tensorboard,wandb]", "metrics.wandb_mode=offline", "metrics.wandb_project=cpu-run",
       "metrics.wandb_tags=[test,cpu]"]


@dataclasses.dataclass
class CpuRun:
    run_dir: str
    target_dir: str
    data_dir: str
    output: str          # what `dflash-ipc up` printed
    eval_json: list      # what `dflash-ipc eval --json --save-to` printed


def wandb_env(root) -> dict:
    """W&B in offline mode, every file of it under `root` (no network, nothing in $HOME)."""
    return {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DIR": str(root),
            "WANDB_CACHE_DIR": str(root / "cache"), "WANDB_CONFIG_DIR": str(root / "config"),
            "WANDB_DATA_DIR": str(root / "data")}


def run_cpu_job(tmp_path, tiny_cache) -> CpuRun:
    run_dir = tmp_path / "run"
    target_dir = os.path.join(tiny_cache, "tiny-target")
    env = wandb_env(tmp_path / "wandb-home")
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # SupervisedJob passes this process' environment on
    try:
        job = SupervisedJob(run_dir, tmp_path / "up.log", tiny_cache, [*JOB, f"target.path={target_dir}"])
        try:
            code = job.wait(TIMEOUT_S, during=job.processes)
        finally:
            job.kill_all()
    finally:
        for key, value in saved.items():
            os.environ.pop(key) if value is None else os.environ.__setitem__(key, value)
    output = job.output()
    if code != 0:
        pytest.fail(f"dflash-ipc up exited {code}:\n{output[-4000:]}")
    from dflash_ipc.config.load import load_config
    data_dir = load_config(str(run_dir / "config.yaml")).data.path  # the synthetic data the job built
    argv = [sys.executable, "-m", "dflash_ipc.cli", "eval", "--target", target_dir, "--drafter",
            str(run_dir / "checkpoints"), "--data", data_dir, "--num-prompts", str(EVAL_PROMPTS),
            "--max-new-tokens", str(EVAL_NEW_TOKENS), "--json", "--save-to", str(run_dir)]
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, DFLASH_IPC_CACHE=str(tiny_cache)))
    if done.returncode != 0:
        pytest.fail(f"dflash-ipc eval exited {done.returncode}:\n{done.stderr[-4000:]}")
    return CpuRun(run_dir=str(run_dir), target_dir=target_dir, data_dir=data_dir, output=output,
                  eval_json=json.loads(done.stdout))

