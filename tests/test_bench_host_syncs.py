"""bench/host_syncs.py: where work makes the host wait for the GPU: the sync debug mode's
warnings (its once-a-process notice left out) and the Python-level waits that mode misses."""

import os
import threading
import warnings

import pytest
import torch

from dflash_ipc.bench import host_syncs as hs


def test_sync_sites_count_sync_warnings_only():
    # CUDA's sync debug mode warns once per process that it is a prototype, from
    # set_sync_debug_mode's own line: that notice is no synchronising call
    def caught(message, filename, lineno):
        return warnings.WarningMessage(UserWarning(message), UserWarning, filename, lineno)

    notice = ("Synchronization debug mode is a prototype feature and does not yet detect all "
              "synchronizing operations")
    sites = hs.sync_sites([caught(notice, "/x/torch/cuda/__init__.py", 1270),
                           caught(hs.SYNC_WARNING, "/x/launched_step.py", 80),
                           caught(hs.SYNC_WARNING, "/x/launched_step.py", 80),
                           caught(hs.SYNC_WARNING, "/x/objective.py", 12),
                           caught("an unrelated warning", "/x/objective.py", 13)])
    assert {os.path.basename(k): v for k, v in sites.items()} == {"launched_step.py:80": 2, "objective.py:12": 1}


KEPT = torch.cuda.synchronize  # a copy taken when a module loads, as dynamo's device interface keeps one


def _wait_each():
    torch.cuda.synchronize(-1)
    KEPT(-1)
    torch.cuda.Event.synchronize(object())


def test_waits_the_sync_debug_mode_misses_are_counted_at_their_callers(monkeypatch):
    """torch.cuda.synchronize (called by name or through a copy kept earlier) and an event's
    synchronize, which c10 does not report to the sync debug mode, counted by the line that
    called them, in this thread only; the originals still run and are back in place afterwards."""
    ran = []
    monkeypatch.setattr(torch.cuda, "_lazy_init", lambda: None)  # no GPU here: the binding is a stand-in
    monkeypatch.setattr(torch._C, "_cuda_synchronize", lambda: ran.append("device"), raising=False)
    monkeypatch.setattr(torch.cuda.Event, "synchronize", lambda self: ran.append("event"))
    originals = [getattr(owner, attr) for owner, attr, _ in hs.WAITS]
    found = {}
    with hs.counted_waits(found):
        _wait_each()
        other = threading.Thread(target=torch.cuda.Event.synchronize, args=(object(),))
        other.start()
        other.join()
    assert ran == ["device", "device", "event", "event"]
    where = {k.split(os.sep)[-1]: v for k, v in found.items()}
    first = _wait_each.__code__.co_firstlineno
    assert where == {f"test_bench_host_syncs.py:{first + 1} (torch.cuda.synchronize)": 1,
                     f"test_bench_host_syncs.py:{first + 2} (torch.cuda.synchronize)": 1,
                     f"test_bench_host_syncs.py:{first + 3} (Event.synchronize)": 1}
    assert [getattr(owner, attr) for owner, attr, _ in hs.WAITS] == originals
    torch.cuda.synchronize(-1)
    assert len(found) == 3 and ran[-1] == "device"  # nothing counted once outside


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_both_kinds_of_wait_are_found():
    x = torch.ones(4, device="cuda")

    def work():
        float(x.sum())  # a copy to the host: the sync debug mode's
        torch.cuda.synchronize()  # a device-wide wait: counted_waits'
        event = torch.cuda.Event()
        event.record()
        event.synchronize()  # an event's: counted_waits'

    torch.cuda.set_sync_debug_mode("error")  # the caller's mode comes back after the count
    try:
        found = hs.host_syncs(work)
        assert torch.cuda.get_sync_debug_mode() == 2
    finally:
        torch.cuda.set_sync_debug_mode("default")
    named = sorted(k.rsplit(" ", 1)[-1] for k in found if k.endswith(")"))
    assert named == ["(Event.synchronize)", "(torch.cuda.synchronize)"], found
    assert all("test_bench_host_syncs.py" in k for k in found), found  # each at the line that waited
