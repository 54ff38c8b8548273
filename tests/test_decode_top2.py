"""decode/top2.py: the greedy token, its margin and top logit in one pass.

On CPU: torch's path gives argmax and sampler.top2_margin's figures, and the switch. On CUDA
(marked gpu): the kernels against torch's argmax and topk, bit for bit, on logits made to tie
(a maximum repeated inside a chunk and across chunks: the first index wins, top-2 counts it
twice), rows of -inf, a vocabulary that is no multiple of the chunk, row-strided views and
three dtypes."""

import pytest
import torch

from dflash_ipc.decode import top2
from dflash_ipc.decode.sampler import top2_margin
from dflash_ipc.decode.top2 import BLOCK, TOP2_ENV, greedy_top2, torch_greedy_top2
from decode_switch_helpers import check_switch_setting

cuda = pytest.mark.skipif(not (torch.cuda.is_available() and top2.available()), reason="needs CUDA and Triton")


def tied_logits(rows: int, vocab: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Random logits, most rows made to tie at their maximum: row r repeats it at positions that
    fall in one chunk, in two chunks, last of all; with more than one row, one is all -inf and one
    has one finite value."""
    gen = torch.Generator().manual_seed(rows * 7 + vocab)
    x = torch.randn(rows, vocab, generator=gen).to(dtype)
    for r in range(rows):
        peak = x[r].max() + 1
        kind = r % 5
        if kind == 1:  # a tie inside one chunk
            x[r, 5], x[r, 9] = peak, peak
        elif kind == 2 and vocab > BLOCK:  # across chunks: the later chunk's index must lose
            x[r, BLOCK + 3], x[r, vocab - 1] = peak, peak
            x[r, 2 * BLOCK - 1 if vocab > 2 * BLOCK else 7] = peak
        elif kind == 3:  # the maximum last, the second just before
            x[r, vocab - 1], x[r, vocab - 2] = peak, peak - 0.5
    if rows > 1:  # a single row keeps its values: the plain batch-1 step's case
        x[0] = float("-inf")
        x[1] = float("-inf")
        x[1, vocab // 2] = 3.0
    return x.to(device)


def test_torch_path_is_argmax_and_the_samplers_margin():
    x = tied_logits(12, 3000, torch.float32, "cpu")
    tokens, margin, top = torch_greedy_top2(x)
    assert torch.equal(tokens, x.argmax(-1))
    ref_margin, ref_top = top2_margin(x)
    assert torch.equal(top, ref_top) and torch.equal(margin.nan_to_num(), ref_margin.nan_to_num())
    # a tie at the maximum: margin 0, the first index
    assert margin[6].item() == 0 and tokens[6].item() == 5
    assert [t.shape for t in greedy_top2(x.view(3, 4, -1))] == [torch.Size([3, 4])] * 3  # CPU: torch's path


def test_the_setting(monkeypatch):
    check_switch_setting(monkeypatch, TOP2_ENV, top2.enabled)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rows,vocab", [(1, 151936), (16, 151936), (15, 49152), (40, BLOCK * 2 + 77), (7, 300)])
def test_the_kernels_give_torchs_token_margin_and_top(monkeypatch, dtype, rows, vocab):
    monkeypatch.delenv(TOP2_ENV, raising=False)
    x = tied_logits(rows, vocab, dtype, "cuda:0")
    got = greedy_top2(x)
    want = torch_greedy_top2(x)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and torch.equal(g.nan_to_num(), w.nan_to_num())
    # batch and block dimensions, and a row-strided view (the last position of a verify block)
    blocks = x[: rows - rows % 2].view(-1, 2, vocab) if rows > 1 else x.view(1, 1, vocab)
    for view in (blocks, blocks[:, -1]):
        for g, w in zip(greedy_top2(view), torch_greedy_top2(view)):
            assert g.shape == view.shape[:-1] and torch.equal(g.nan_to_num(), w.nan_to_num())


@pytest.mark.gpu
@cuda
def test_the_kernels_run_in_a_cuda_graph_and_off_is_torch(monkeypatch):
    x = tied_logits(16, 151936, torch.bfloat16, "cuda:0")
    greedy_top2(x)  # compiled outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = greedy_top2(x)
    fresh = tied_logits(16, 151936, torch.bfloat16, "cuda:0").flip(-1)
    x.copy_(fresh)
    graph.replay()
    torch.cuda.synchronize()
    for g, w in zip(out, torch_greedy_top2(fresh)):
        assert torch.equal(g.nan_to_num(), w.nan_to_num())
    monkeypatch.setenv(TOP2_ENV, "off")
    assert not top2.enabled("cuda:0")
    for g, w in zip(greedy_top2(fresh), torch_greedy_top2(fresh)):  # off: torch's ops
        assert torch.equal(g.nan_to_num(), w.nan_to_num())


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("pdl_setting", ["auto", "off"])
def test_a_float32_head_then_the_kernels_capture_as_the_decoders_do(monkeypatch, pdl_setting):
    """cuBLAS's float32 product of 45 rows (a drafted block of 3 rows), then the kernels: warmed up on
    a side stream, then captured in thread-local mode, as decode/graphs.py does."""
    from dflash_ipc.decode import pdl

    monkeypatch.delenv(TOP2_ENV, raising=False)
    monkeypatch.setenv(pdl.PDL_ENV, pdl_setting)
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(45, 64, generator=gen).to("cuda:0")
    head = torch.randn(1000, 64, generator=gen).to("cuda:0")

    def step():
        return greedy_top2(torch.nn.functional.linear(hidden, head))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        out = step()
    hidden.copy_(torch.randn(45, 64, generator=gen))
    graph.replay()
    torch.cuda.synchronize()
    for g, w in zip(out, torch_greedy_top2(torch.nn.functional.linear(hidden, head))):
        assert torch.equal(g.nan_to_num(), w.nan_to_num())


@pytest.mark.gpu
@cuda
def test_a_nan_logit_ranks_as_infinity(monkeypatch):
    monkeypatch.delenv(TOP2_ENV, raising=False)
    x = tied_logits(4, 9000, torch.float32, "cuda:0")
    x[2, 7000] = float("nan")
    tokens, margins, tops = greedy_top2(x)
    assert tokens[2].item() == 7000 == x.argmax(-1)[2].item()  # torch's token: no +inf before the NaN
    assert tops[2].item() == float("inf") and margins[2].item() == float("inf")
    assert torch.equal(tokens[3:], x[3:].argmax(-1))
