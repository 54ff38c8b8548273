"""A regenerate process killed by pid mid-file, then rerun: the same file as one uninterrupted run."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from dflash_ipc.builtin.tiny import TINY_VOCAB_WORDS
from dflash_ipc.regenerate.options import GenerationOptions

from regen_helpers import run_hf

W = TINY_VOCAB_WORDS
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def rows(n):
    out = []
    for i in range(n):
        prompt = " ".join(W[(11 * i + k) % 1000] for k in range(2 + i % 17))
        out.append({"messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": "x"},
                                 {"role": "user", "content": W[i % 1000]}]})
    return out


@pytest.mark.timeout(180)
def test_resume_after_a_kill_mid_file_equals_an_uninterrupted_run(tiny_cache, tmp_path):
    target = os.path.join(tiny_cache, "tiny-target")
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows(60)))
    options = GenerationOptions(max_new_tokens=16)
    ref = run_hf(target, str(inp), str(tmp_path / "ref.jsonl"), options)
    assert ref.complete and ref.num_written == 60
    out = tmp_path / "out.jsonl"
    cmd = [sys.executable, "-m", "dflash_ipc.cli", "regenerate", "--model", target, "--input", str(inp),
           "--out", str(out), "--devices", "cpu", "--max-new-tokens", "16", "--window", "4"]
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            if out.exists() and out.read_bytes().count(b"\n") >= 6:
                break
            time.sleep(0.05)
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        os.kill(proc.pid, signal.SIGKILL)  # by pid, mid-file
        proc.wait(10)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)
        proc.stderr.close()
    killed = out.read_bytes()
    assert 6 <= killed.count(b"\n") < 60
    if killed.endswith(b"\n"):  # the kill fell between rows; tear the last one as a kill mid-write would
        with open(out, "ab") as f:
            f.write(killed.splitlines(keepends=True)[0][:40])
    state = json.loads((tmp_path / "out.state.json").read_text())
    assert state["complete"] is False
    again = run_hf(target, str(inp), str(out), options, token_budget=512)  # other batches, same settings
    assert again.complete and again.num_skipped == killed.count(b"\n") and again.num_written == 60 - again.num_skipped
    assert out.read_bytes() == (tmp_path / "ref.jsonl").read_bytes()  # same rows, once each, in order, no torn line
    indices = [json.loads(line)["index"] for line in out.read_text().splitlines()]
    assert indices == list(range(60))
