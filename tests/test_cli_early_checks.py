"""Mistakes a command answers before its heavy imports: a config typo, an existing output
directory, a missing model directory (in a fresh interpreter: torch is never imported); `up` on
a run directory in use says nothing of starting; `up` without --config says what it runs."""

import json
import os
import subprocess
import sys

import pytest
from click.testing import CliRunner

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Runs one command in-process in a fresh interpreter; prints its exit code, output and whether
# torch (or transformers) was imported by the time the error came back.
_PROBE = """
import json, sys
from click.testing import CliRunner
from dflash_ipc.cli import main
result = CliRunner().invoke(main, json.loads(sys.argv[1]))
print(json.dumps({"code": result.exit_code, "error": str(result.exception), "output": result.output,
                  "heavy": sorted(m for m in ("torch", "transformers") if m in sys.modules)}))
"""


def _probe(args: list[str], cwd) -> dict:
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(args)], cwd=cwd, env=env, capture_output=True,
                         text=True, timeout=60, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_config_typo_is_answered_without_importing_torch(tmp_path):
    result = _probe(["up", "-o", "optimizer.lrr=1"], tmp_path)
    assert "unknown key optimizer.lrr (did you mean optimizer.lr?)" in result["error"]
    assert result["heavy"] == []


def test_prepare_refuses_an_existing_output_and_a_missing_model_without_importing_torch(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "in.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("someone's file")
    existing = _probe(["prepare", "--model", "model", "--input", "in.jsonl", "--out", "out"], tmp_path)
    assert "out: already exists; --overwrite" in existing["error"] and existing["heavy"] == []
    missing = _probe(["prepare", "--model", "no-model", "--input", "in.jsonl", "--out", "new"], tmp_path)
    assert "no-model: no such model directory" in missing["error"] and missing["heavy"] == []
    regen = _probe(["regenerate", "--model", "no-model", "--input", "in.jsonl", "--out", "x.jsonl"], tmp_path)
    assert "no-model: no such model directory" in regen["error"] and regen["heavy"] == []


def test_export_refuses_a_directory_that_is_not_an_earlier_export_without_importing_torch(tmp_path):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "thesis.tex").write_text("years of work")
    result = _probe(["export", "ckpt", "home"], tmp_path)
    assert "home: exists and is not an earlier export (it holds thesis.tex)" in result["error"]
    assert result["heavy"] == [] and (tmp_path / "home" / "thesis.tex").exists()


def test_up_on_a_run_directory_in_use_is_refused_before_it_logs_a_start(tmp_path, monkeypatch):
    from dflash_ipc.cli import job, main
    from dflash_ipc.run.lock import RunLock
    started: list[str] = []
    monkeypatch.setattr(job, "resolved", lambda cfg: cfg)  # the tiny assets are not needed to be refused
    monkeypatch.setattr(job.log, "info", lambda msg, *args: started.append(msg % args))
    run_dir = str(tmp_path / "run")
    os.makedirs(run_dir)
    held = RunLock(run_dir)
    held.acquire()
    try:
        result = CliRunner().invoke(main, ["up", "--config", os.path.join(REPO, "configs", "default.yaml"),
                                           "-o", f"run.run_dir={run_dir}", "-o", "target.num_workers=1",
                                           "-o", "drafter.num_workers=1"])
    finally:
        held.release()
    assert "is in use by another job" in str(result.exception)
    assert started == [] and "no --config" not in result.output


def test_up_without_a_config_says_it_runs_the_embedded_default(tmp_path, monkeypatch):
    from dflash_ipc.cli import job, main
    from dflash_ipc.run.lock import RunLock
    monkeypatch.setattr(job, "resolved", lambda cfg: cfg)
    run_dir = str(tmp_path / "run")
    os.makedirs(run_dir)
    held = RunLock(run_dir)  # refused right after the line: nothing runs
    held.acquire()
    try:
        result = CliRunner().invoke(main, ["up", "-o", f"run.run_dir={run_dir}"])
    finally:
        held.release()
    first = result.output.splitlines()[0]
    assert first == job.EMBEDDED_DEFAULT_LINE and "configs/default.yaml" in first and "CPU" in first
    assert "is in use by another job" in str(result.exception)


def test_up_on_a_run_directory_in_use_is_refused_before_the_target_is_resolved(tmp_path):
    # In a fresh interpreter, with nothing patched: resolving the target imports torch and logs
    # the derived layers (seconds), and a target that does not exist would be the error instead.
    from dflash_ipc.run.lock import RunLock
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    held = RunLock(str(run_dir))  # held by this process: the probe is another job
    held.acquire()
    try:
        result = _probe(["up", "--config", os.path.join(REPO, "configs", "default.yaml"), "-o",
                         f"run.run_dir={run_dir}", "-o", f"target.path={tmp_path / 'no-target'}"], tmp_path)
    finally:
        held.release()
    assert "is in use by another job" in result["error"]
    assert result["heavy"] == []


def test_up_with_a_missing_target_names_it_and_leaves_no_run_directory(tmp_path):
    # the embedded default's synthetic data with another target: read through resolve_model too
    run_dir = tmp_path / "run"
    result = _probe(["up", "--config", os.path.join(REPO, "configs", "default.yaml"), "-o",
                     f"run.run_dir={run_dir}", "-o", f"target.path={tmp_path / 'no-target'}"], tmp_path)
    assert f"target.path: {tmp_path / 'no-target'}: no such model directory" in result["error"]
    assert not run_dir.exists()


def test_regenerate_with_other_options_than_its_output_is_refused_before_the_model_loads(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "in.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    (tmp_path / "out.jsonl").write_text('{"index": 0, "messages": []}\n')
    settings = {"backend": "hf", "dtype": "auto", "input": str(tmp_path / "in.jsonl"), "max_new_tokens": 48,
                "max_turns": None, "model_dir": str(tmp_path / "model"), "reasoning": "keep", "seed": 0,
                "split": None, "stop_ids": [0], "temperature": 0.0, "template_kwargs": {}, "top_k": 0, "top_p": 1.0}
    (tmp_path / "out.state.json").write_text(json.dumps({"format": 1, "complete": True, "settings": settings}))
    result = _probe(["regenerate", "--model", "model", "--input", "in.jsonl", "--out", "out.jsonl",
                     "--max-new-tokens", "99"], tmp_path)
    assert "out.jsonl: made with other settings (file, now): {'max_new_tokens': (48, 99)}" in result["error"]
    assert result["heavy"] == []
