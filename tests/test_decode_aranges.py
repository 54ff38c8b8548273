"""decode/aranges.py: index vectors made once per length and device.

On CPU: the values, one tensor per (length, device) on every call, a new one per length, a plain
arange inside a compile trace. On CUDA (marked gpu): one first asked for during a graph capture
is not kept (it lives in the graph's pool), one asked for before is, and the capture reads it."""

import pytest
import torch

from dflash_ipc.decode import aranges

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_one_kept_tensor_per_length_and_device():
    a = aranges.arange(7, "cpu")
    assert a.tolist() == list(range(7)) and a.dtype == torch.int64
    assert aranges.arange(7, torch.device("cpu")) is a
    assert aranges.arange(8, "cpu") is not a and aranges.arange(8, "cpu").tolist() == list(range(8))


def test_a_compile_trace_gets_its_own_arange():
    @torch.compile(backend="eager", fullgraph=True)
    def offsets(x):
        return x[:, None] + aranges.arange(4, x.device)

    aranges._kept.pop((4, "cpu", None), None)
    assert offsets(torch.tensor([10, 20])).tolist() == [[10, 11, 12, 13], [20, 21, 22, 23]]
    assert (4, "cpu", None) not in aranges._kept  # the trace made its own


@pytest.mark.gpu
@cuda
def test_a_vector_first_made_in_a_capture_is_not_kept():
    starts = torch.tensor([5], device="cuda:0")
    kept = aranges.arange(16, "cuda:0")  # asked for before the capture, as a step's warm-up does
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = starts[:, None] + aranges.arange(16, "cuda:0") + aranges.arange(999, "cuda")[:16]
    assert aranges.arange(16, "cuda:0") is kept
    assert (999, "cuda", torch.cuda.current_device()) not in aranges._kept
    starts.fill_(100)
    graph.replay()
    torch.cuda.synchronize()
    assert out.tolist() == [[100 + 2 * i for i in range(16)]]  # 100 + i (kept) + i (the capture's own)
