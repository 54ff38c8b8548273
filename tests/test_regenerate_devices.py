"""Data parallel: one process per device, pulling batches; a slow device takes fewer."""

import json
import os
import queue

import pytest
import torch

from dflash_ipc.builtin.tiny import TINY_VOCAB_WORDS
from dflash_ipc.errors import ConfigError, DataError
from dflash_ipc.regenerate import devices as regen_devices
from dflash_ipc.regenerate.generator import Generator, GeneratorSettings
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
    # generate's batches (2 prompts): enough of them for the pull to show; the pool does not
    # depend on the decoder (the engine's batches are 4 x its rows, so there would be few).
    one = run(target, str(inp), str(tmp_path / "one.jsonl"), "cpu", decoder="generate")
    two = run(target, str(inp), str(tmp_path / "two.jsonl"), "cpu,cpu", _throttle_s={1: 0.3}, decoder="generate")
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


class _FailingGenerator(Generator):
    """A device's Generator (its failure rule, run_batch, the real one) whose every batch fails,
    as a CUDA error would."""
    usable = True

    def __init__(self, settings, device):
        self.device = device

    def generate(self, prompts, max_new_tokens, keys=None):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    def device_usable(self) -> bool:
        return self.usable


class _NoWatch:
    def __init__(self, *args, **kwargs):
        pass

    def start(self):
        pass


def _step_device(monkeypatch, usable: bool, num_batches: int) -> tuple[list, queue.Queue]:
    """Runs one device process's loop here, on plain queues: what it answered, and its tasks."""
    from dflash_ipc.run import child_env as children
    monkeypatch.setattr(_FailingGenerator, "usable", usable)
    monkeypatch.setattr(regen_devices, "Generator", _FailingGenerator)
    monkeypatch.setattr(children, "ParentWatch", _NoWatch)
    monkeypatch.setattr(regen_devices.signal, "signal", lambda *args: None)  # pytest keeps its Ctrl-C
    tasks, results = queue.Queue(), queue.Queue()
    for i in range(num_batches):
        tasks.put((i, [(i, 0, 0)], [[5, 6, 7]], [4]))  # batch id, keys, prompts, max new tokens
    tasks.put(None)
    regen_devices._device_main(GeneratorSettings("unused"), "cuda:7", "cuda:7", tasks, results, 0.0, os.getppid())
    answers = []
    while not results.empty():
        answers.append(results.get_nowait())
    return answers, tasks


def test_a_device_process_drops_the_unactionable_import_lines(monkeypatch):
    # Spawned, it has none of the parent's filters: torchao's lines at the model's load would
    # print once per device.
    import logging
    from dflash_ipc.run import quiet
    monkeypatch.setattr(logging.getLogger("torchao"), "filters", [])
    _step_device(monkeypatch, usable=True, num_batches=0)
    record = logging.LogRecord("torchao", logging.WARNING, __file__, 1, "Failed to load x.so: Could not load this "
                               "library", None, None)
    assert not logging.getLogger("torchao").filter(record)
    assert any(isinstance(f, quiet._DropUnactionable) for f in logging.getLogger("torchao").filters)


def test_a_batch_that_breaks_its_device_stops_that_process_and_fails_the_run(monkeypatch):
    # A broken CUDA context fails every later batch in moments: a process that went on would
    # pull, and reject, most of the remaining rows.
    answers, tasks = _step_device(monkeypatch, usable=False, num_batches=3)
    assert [a[0] for a in answers] == ["ready", "broken"] and tasks.qsize() == 3  # took no other batch
    pool = object.__new__(regen_devices.DevicePool)  # the parent's side of the queue only
    pool._results, pool._procs, pool._out = queue.Queue(), {}, {}
    pool._results.put(answers[1])
    with pytest.raises(DataError, match=r"failed on cuda:7 and left the device unusable \(RuntimeError: CUDA "
                                        r"error: an illegal memory access.*rerun to resume"):
        pool.get(5.0)


def test_a_batch_that_fails_on_a_device_that_still_works_only_rejects_its_rows(monkeypatch):
    answers, tasks = _step_device(monkeypatch, usable=True, num_batches=2)
    assert [a[0] for a in answers] == ["ready", "done", "done"] and tasks.empty()
    assert all(a[3] is None and "illegal memory access" in a[5] for a in answers[1:])
