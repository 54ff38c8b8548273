"""Data parallel: one process per device, pulling batches; a slow device takes fewer."""

import json
import os

import pytest
import torch

from dflash_ipc.data.tiny import TINY_VOCAB_WORDS
from dflash_ipc.errors import ConfigError
from dflash_ipc.regenerate.hf import HFBackend
from dflash_ipc.regenerate.options import GenerationOptions

from regen_helpers import run_hf

W = TINY_VOCAB_WORDS


def run(target, inp, out, devices, **kw):
    return run_hf(target, inp, out, GenerationOptions(max_new_tokens=8), devices=devices, max_batch_size=2, **kw)


@pytest.mark.timeout(240)
def test_two_device_processes_pull_work_and_match_one_device(tiny_cache, tmp_path):
    target = os.path.join(tiny_cache, "tiny-target")
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"messages": [{"role": "user", "content": " ".join(W[i:i + 1 + i % 9])}]}) + "\n"
                           for i in range(24)))
    one = run(target, str(inp), str(tmp_path / "one.jsonl"), "cpu")
    two = run(target, str(inp), str(tmp_path / "two.jsonl"), "cpu,cpu", _throttle_s={1: 0.3})
    assert one.complete and two.complete
    assert (tmp_path / "two.jsonl").read_bytes() == (tmp_path / "one.jsonl").read_bytes()
    fast, slow = two.batches_per_device["cpu#0"], two.batches_per_device["cpu#1"]
    assert fast + slow == sum(one.batches_per_device.values())
    assert slow >= 1 and fast > 2 * slow  # pulled, not split into fixed halves


def test_devices_are_checked(tiny_cache):
    target = os.path.join(tiny_cache, "tiny-target")
    absent = f"cuda:{torch.cuda.device_count()}"  # one past the last GPU of this machine (if any)
    for devices, match in (("gpu0", "allowed: cpu or cuda:N"), ("", "at least one device"),
                           (absent, absent)):
        with pytest.raises(ConfigError, match=match):
            HFBackend(target, GenerationOptions(), devices=devices)
