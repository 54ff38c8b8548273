"""decode/accept.py: a greedy cycle's acceptance, host row and next inputs in one launch.

On CPU: torch's path counts the drafts that lead the target's tokens, lays out the host row,
takes the next anchor at the accepted position and the next start capped at the limit, writes
into given buffers (the starts in place), and refuses shapes that do not fit; the switch. On CUDA
(marked gpu): the kernel against torch's path exactly, on blocks made to accept every count from
none to all, eagerly and in CUDA graphs captured for new limits (values that Triton would otherwise specialise
on: none may compile inside a capture)."""

import pytest
import torch

from dflash_ipc.decode import accept
from dflash_ipc.decode.accept import FUSED_ACCEPT_ENV, greedy_accept_packed, torch_accept_packed
from decode_switch_helpers import check_switch_setting

cuda = pytest.mark.skipif(not (torch.cuda.is_available() and accept.available()), reason="needs CUDA and Triton")


def cycle_results(rows: int, bs: int, device, seed: int = 0):
    """drafted, tokens, margins, tops, starts of ``rows`` rows; row r's drafts agree with the
    target's tokens on the first ``r % bs`` positions (all bs-1 of them from r % bs == bs-1 on)."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 151_936, (rows, bs), generator=gen)
    drafted = (tokens[:, :-1] + 1 + torch.randint(0, 5, (rows, bs - 1), generator=gen)) % 151_936
    for r in range(rows):
        drafted[r, : r % bs] = tokens[r, : r % bs]
    margins, tops = torch.rand(rows, bs, generator=gen), torch.randn(rows, bs, generator=gen)
    starts = torch.randint(10, 500, (rows,), generator=gen)
    return [t.to(device) for t in (drafted, tokens, margins, tops, starts)]


def test_torch_path_counts_the_leading_matches_and_packs_the_host_row():
    drafted = torch.tensor([[5, 6, 9], [4, 6, 7], [5, 6, 7]])
    tokens = torch.tensor([[5, 6, 7, 8], [5, 6, 7, 8], [5, 6, 7, 8]])
    margins, tops = torch.rand(3, 4), torch.randn(3, 4)
    starts = torch.tensor([10, 20, 30])
    packed, anchors, nxt = greedy_accept_packed(drafted, tokens, margins, tops, starts, limit=32)
    assert packed[:, 0].tolist() == [2, 0, 3]
    assert torch.equal(packed[:, 1:5], tokens.float()) and torch.equal(packed[:, 5:9], margins)
    assert torch.equal(packed[:, 9:], tops)
    assert anchors.tolist() == [7, 5, 8]  # the token at the accepted position: the last committed one
    assert nxt.tolist() == [13, 21, 32]  # 30 + 3 + 1 capped at the limit


def test_out_buffers_are_written_and_the_starts_may_be_updated_in_place():
    drafted, tokens, margins, tops, starts = cycle_results(9, 5, "cpu")
    want = torch_accept_packed(drafted, tokens, margins, tops, starts, 300)
    out = (torch.empty(9, 16), torch.empty(9, dtype=torch.long), starts)
    got = greedy_accept_packed(drafted, tokens, margins, tops, starts, 300, out=out)
    assert all(g is o for g, o in zip(got, out))
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert got[0][:, 0].tolist() == [r % 5 for r in range(9)]


def test_shapes_that_do_not_fit_are_refused():
    drafted, tokens, margins, tops, starts = cycle_results(3, 4, "cpu")
    with pytest.raises(ValueError, match=r"drafted \(3, 4\).*want \[B, bs-1\]"):
        greedy_accept_packed(tokens, tokens, margins, tops, starts, 100)
    with pytest.raises(ValueError, match=r"starts \(2,\)"):
        greedy_accept_packed(drafted, tokens, margins, tops, starts[:2], 100)


def test_the_setting(monkeypatch):
    check_switch_setting(monkeypatch, FUSED_ACCEPT_ENV, accept.enabled)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("rows,bs", [(1, 16), (3, 16), (40, 16), (7, 5), (2, 2), (33, 10)])
def test_the_kernel_gives_torchs_results(monkeypatch, rows, bs):
    monkeypatch.delenv(FUSED_ACCEPT_ENV, raising=False)
    inputs = cycle_results(rows, bs, "cuda:0", seed=rows)
    for limit in (10**6, 300, 0):
        got = greedy_accept_packed(*inputs, limit)
        want = torch_accept_packed(*inputs, limit)
        assert all(g.dtype == w.dtype and torch.equal(g, w) for g, w in zip(got, want)), limit


@pytest.mark.gpu
@cuda
def test_the_kernel_runs_in_a_cuda_graph_with_its_starts_in_place(monkeypatch):
    monkeypatch.delenv(FUSED_ACCEPT_ENV, raising=False)
    drafted, tokens, margins, tops, starts = cycle_results(16, 16, "cuda:0")
    out = (torch.empty(16, 49, device="cuda:0"), torch.empty(16, dtype=torch.long, device="cuda:0"), starts)
    greedy_accept_packed(drafted, tokens, margins, tops, starts.clone(), 1000)  # compiled outside the captures
    for limit in (1000, 333, 1024, 1, 17):  # new values and divisibility (by 16, == 1): none may compile in a capture
        begin = starts.clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            greedy_accept_packed(drafted, tokens, margins, tops, starts, limit, out=out)
        starts.copy_(begin)
        graph.replay()
        torch.cuda.synchronize()
        want = torch_accept_packed(drafted, tokens, margins, tops, begin, limit)
        assert all(torch.equal(g, w) for g, w in zip(out, want)), limit
    monkeypatch.setenv(FUSED_ACCEPT_ENV, "off")
    assert not accept.enabled("cuda:0")
