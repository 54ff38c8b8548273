"""decode/prefill_sdpa.py: which SDPA kernels a prefill may run (the flags are global, so the
context is checked on any machine; the prefill's numbers are the GPU benchmark's business)."""

import torch

from dflash_ipc.decode.prefill_sdpa import PREFILL_SDPA_ENV, prefill_backends, without_cudnn
from decode_switch_helpers import check_switch_setting


def test_the_setting(monkeypatch):
    check_switch_setting(monkeypatch, PREFILL_SDPA_ENV, without_cudnn)
    assert without_cudnn("cuda:0")  # unset: cuDNN kept out on CUDA


def test_a_cuda_prefill_runs_without_cudnn_and_the_flags_come_back(monkeypatch):
    monkeypatch.delenv(PREFILL_SDPA_ENV, raising=False)
    before = torch.backends.cuda.cudnn_sdp_enabled()
    with prefill_backends("cuda:0"):
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.mem_efficient_sdp_enabled() and torch.backends.cuda.math_sdp_enabled()
    assert torch.backends.cuda.cudnn_sdp_enabled() == before
    monkeypatch.setenv(PREFILL_SDPA_ENV, "off")
    with prefill_backends("cuda:0"):
        assert torch.backends.cuda.cudnn_sdp_enabled() == before  # off: torch's own choice
    with prefill_backends("cpu"):
        assert torch.backends.cuda.cudnn_sdp_enabled() == before


def test_the_prefill_runs_its_forward_inside_the_context(tmp_path, monkeypatch):
    """BatchedTarget.prefill enters prefill_backends around its forward (decode steps do not)."""
    import numpy as np

    from dflash_ipc.bench.assets import build_random_target
    from dflash_ipc.decode import target as target_module
    from dflash_ipc.decode.target import BatchedTarget

    build_random_target(str(tmp_path / "t"), shape="tiny", dtype="float32", num_layers=1, seed=3)
    target = BatchedTarget(str(tmp_path / "t"), device="cpu", dtype="float32")
    target.reset(2, 32)
    seen = []

    def cuda_backends(device):  # the CUDA context, whatever the device
        seen.append(str(device))
        return prefill_backends("cuda:0")

    monkeypatch.delenv(PREFILL_SDPA_ENV, raising=False)
    monkeypatch.setattr(target_module, "prefill_backends", cuda_backends)
    flags = []
    monkeypatch.setattr(target, "_forward", lambda *a, **k: flags.append(torch.backends.cuda.cudnn_sdp_enabled())
                        or (torch.zeros(1, 1, 8), None))
    target.prefill([0], [np.arange(5, 12)])
    assert seen == ["cpu"] and flags == [False]
