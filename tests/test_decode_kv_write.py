"""decode/kv_write.py: which writes take the kernel, and (GPU) that it writes what index_put_ writes."""

import pytest
import torch

from dflash_ipc.decode import kv_write, matvec
from dflash_ipc.decode.row_cache import RowKV

from decode_switch_helpers import check_switch_setting


def test_cpu_writes_keep_index_put():
    keys = torch.zeros(3, 17, 2, 4)
    k = torch.randn(2, 3, 2, 4)
    rows, pos = torch.tensor([2, 0]), torch.tensor([[1, 2, 3], [4, 5, 16]])
    assert kv_write.fits(keys, keys.clone(), rows, pos, k, k.clone())
    assert not kv_write.takes(keys, keys.clone(), rows, pos, k, k.clone())  # CPU tensors
    kv = RowKV(1, 3, 16)
    kv.write(0, rows, pos, k, -k)
    assert torch.equal(kv.keys[0][2, 1:4], k[0]) and torch.equal(kv.values[0][0, [4, 5, 16]], -k[1])


def test_layouts_the_kernel_does_not_take():
    keys = torch.zeros(3, 17, 2, 4, dtype=torch.bfloat16)
    k = torch.randn(2, 3, 2, 4, dtype=torch.bfloat16)
    rows, pos = torch.tensor([2, 0]), torch.tensor([[1, 2, 3], [4, 5, 16]])
    good = dict(keys=keys, values=keys.clone(), rows=rows, pos=pos, k=k, v=k.clone())
    assert kv_write.fits(**good)
    for change in (dict(k=k.float()),                                     # another dtype than the storage's
                   dict(v=torch.randn(2, 3, 4, 2, dtype=torch.bfloat16).transpose(2, 3)),  # D strided
                   dict(pos=torch.tensor([[1, 2, 3]])),                   # a broadcast position row
                   dict(rows=torch.tensor([[2], [0]])),
                   dict(rows=torch.tensor([True, False])),                # a mask, not indices
                   dict(pos=pos.float()),
                   dict(keys=torch.zeros(3, 2, 17, 4, dtype=torch.bfloat16).transpose(1, 2)),  # not contiguous
                   dict(values=torch.zeros(3, 18, 2, 4, dtype=torch.bfloat16)),
                   dict(k=torch.randn(2, 3, 2, 8, dtype=torch.bfloat16), v=torch.randn(2, 3, 2, 8, dtype=torch.bfloat16))):
        assert not kv_write.fits(**(good | change)), change
    assert kv_write.fits(**(good | dict(v=torch.randn(2, 2, 3, 4, dtype=torch.bfloat16).transpose(1, 2))))


def test_the_setting(monkeypatch):
    check_switch_setting(monkeypatch, kv_write.KV_WRITE_ENV, lambda device: kv_write.cuda_switch(
        kv_write.KV_WRITE_ENV, device))


cuda = pytest.mark.skipif(not (torch.cuda.is_available() and matvec.available()), reason="needs CUDA and Triton")


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_kernel_writes_what_index_put_writes(dtype):
    torch.manual_seed(0)
    dev = "cuda"
    kv, reference = RowKV(2, 5, 40), RowKV(2, 5, 40)
    k = torch.randn(3, 16, 8, 128, device=dev, dtype=dtype)
    v = torch.randn(3, 8, 16, 128, device=dev, dtype=dtype).transpose(1, 2)  # as RaggedCache.update passes it
    rows = torch.tensor([4, 0, 2], device=dev)
    pos = torch.arange(16, device=dev).repeat(3, 1) + torch.tensor([[0], [20], [5]], device=dev)
    pos[2, -1] = kv.scratch  # a padding token writes to the scratch slot (one: two would race for it)
    for layer in (0, 1):
        kv.write(layer, rows, pos, k, v)
        reference.write(layer, rows, pos, k, v)  # allocates; the second layer's write below is index_put_'s
    reference.keys[1].zero_(), reference.values[1].zero_()
    reference.keys[1].index_put_((rows[:, None], pos), k)
    reference.values[1].index_put_((rows[:, None], pos), v)
    assert kv_write.takes(kv.keys[1], kv.values[1], rows, pos, k, v)
    for mine, theirs in ((kv.keys[1], reference.keys[1]), (kv.values[1], reference.values[1])):
        assert torch.equal(mine, theirs)
    # into row 0 (a stray write past a row lands in the next one): position 60 is past the storage
    # and skipped, -1 counts from the end (the scratch slot) as index_put_'s indices do
    before = kv.keys[0].clone()
    first = torch.zeros(1, 16, dtype=torch.long, device=dev)
    first[0] = torch.arange(16, device=dev)
    first[0, 3], first[0, 4] = 60, -1
    kv_write.write(kv.keys[0], kv.values[0], torch.tensor([0], device=dev), first, k[:1] * 2, v[:1] * 2)
    want = before.clone()
    kept = [i for i in range(16) if i != 3]
    want[0, first[0, kept]] = (k[0] * 2)[kept]
    torch.cuda.synchronize()
    assert torch.equal(kv.keys[0], want)


@pytest.mark.gpu
@cuda
def test_a_write_in_a_cuda_graph_writes_the_replays_inputs():
    kv = RowKV(1, 2, 32)
    k = torch.randn(1, 16, 8, 64, device="cuda", dtype=torch.bfloat16)
    rows, pos = torch.tensor([1], device="cuda"), torch.arange(16, device="cuda")[None]
    kv.write(0, rows, pos, k, k)  # allocates outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kv.write(0, rows, pos, k, -k)
    k.normal_()
    pos += 8
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(kv.keys[0][1, 8:24], k[0]) and torch.equal(kv.values[0][1, 8:24], -k[0])
