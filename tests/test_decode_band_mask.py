"""decode/band_mask.py: a forward's band mask in one launch.

On CPU: ragged_attention.band_mask's rule (lo None = 0, a sliding window's lower edge) against
masks written out by hand; the switch. On CUDA (marked gpu): the kernel against torch's ops, bit
for bit, for a verify block, a drafter block (one broadcast ``hi`` per row), a sliding window, int32
indices and spans that are no multiple of the kernel's chunk; in a CUDA graph captured for new spans
(none may compile inside a capture)."""

import pytest
import torch

from dflash_ipc.decode import band_mask as kernel
from dflash_ipc.decode.band_mask import BAND_MASK_ENV, triton_band_mask
from dflash_ipc.decode.ragged_attention import band_mask, layer_masks
from decode_switch_helpers import check_switch_setting

cuda = pytest.mark.skipif(not (torch.cuda.is_available() and kernel.available()), reason="needs CUDA and Triton")


def by_hand(lo, hi, length, window=None):
    b, q = hi.shape
    out = torch.zeros(b, 1, q, length, dtype=torch.bool)
    for r in range(b):
        for i in range(q):
            start = 0 if lo is None else int(lo[r, i])
            if window is not None:
                start = max(start, int(hi[r, i]) - window)
            out[r, 0, i, max(start, 0): max(int(hi[r, i]), 0)] = True
    return out


def test_the_torch_rule_lo_none_and_a_window():
    hi = torch.tensor([[3, 4, 5], [9, 10, 11]])
    lo = torch.tensor([[1, 1, 1], [0, 2, 2]])
    for args in ((lo, hi, 16), (None, hi, 16), (lo, hi, 16, 3), (None, hi, 12, 4), (None, hi[:, -1:].expand(2, 3), 16)):
        assert torch.equal(band_mask(*args), by_hand(*args)), args
    masks = layer_masks(["full_attention", "sliding_attention"], 4, None, hi, 16)
    assert torch.equal(masks["sliding_attention"], by_hand(None, hi, 16, 4))
    assert torch.equal(masks["full_attention"], by_hand(None, hi, 16))


def test_the_setting(monkeypatch):
    check_switch_setting(monkeypatch, BAND_MASK_ENV, kernel.enabled)


def torch_band_mask(lo, hi, length, window=None):
    lo = torch.zeros_like(hi) if lo is None else lo
    if window is not None:
        lo = torch.maximum(lo, hi - window)
    t = torch.arange(length, device=hi.device)
    return ((t >= lo[..., None]) & (t < hi[..., None]))[:, None]


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_the_kernel_gives_torchs_masks(monkeypatch, dtype):
    monkeypatch.delenv(BAND_MASK_ENV, raising=False)
    gen = torch.Generator().manual_seed(0)
    for b, q, length in ((1, 16, 128), (3, 16, 2064), (4, 1, 1000), (2, 7, 5000)):
        start = torch.randint(0, max(1, length - q), (b, 1), generator=gen)
        positions = (start + torch.arange(q)).to(dtype).cuda()
        lo = torch.randint(0, 5, (b, q), generator=gen).to(dtype).cuda()
        cases = [(None, positions + 1, length), (lo, positions + 1, length), (None, positions + 1, length, 37),
                 (lo, positions + 1, length, 3), (None, positions[:, -1:].expand(b, q) + 1, length)]
        for args in cases:
            assert kernel.takes(args[0], args[1])
            assert torch.equal(triton_band_mask(*args), torch_band_mask(*args)), (b, q, length, len(args))
            assert torch.equal(band_mask(*args), torch_band_mask(*args))


@pytest.mark.gpu
@cuda
def test_the_kernel_runs_in_a_cuda_graph_for_new_spans(monkeypatch):
    monkeypatch.delenv(BAND_MASK_ENV, raising=False)
    hi = (torch.arange(16) + 40).cuda()[None]
    triton_band_mask(None, hi, 128, 8)  # compiled outside the captures
    for length in (144, 1, 1000, 2048):  # new values and divisibility (by 16, == 1)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = triton_band_mask(None, hi, length, 8)
        hi += 3
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, torch_band_mask(None, hi, length, 8)), length
    monkeypatch.setenv(BAND_MASK_ENV, "off")
    assert not kernel.takes(None, hi)
