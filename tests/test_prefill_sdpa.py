"""decode/prefill_sdpa.py: which SDPA kernels a prefill may run (the flags are global, so the
context is checked on any machine; the prefill's numbers are the GPU benchmark's business)."""

import torch

from dflash_ipc.decode.prefill_sdpa import PREFILL_SDPA_ENV, prefill_backends, without_cudnn
from decode_switch_helpers import check_switch_setting


def test_the_setting(monkeypatch):
    check_switch_setting(monkeypatch, PREFILL_SDPA_ENV, without_cudnn)
    assert without_cudnn("cuda:0")  # unset: cuDNN kept out on CUDA


def test_a_cuda_prefill_runs_without_cudnn_and_the_flags_come_back(monkeypatch):
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
