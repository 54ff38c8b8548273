"""A step's host tensors go to the GPU in one pinned, non-blocking copy (drafter/host_copy.py)."""

import pytest
import torch

from dflash_ipc.drafter.host_copy import ALIGN, pack, packed_offsets, to_device, unpack
from dflash_ipc.drafter.objective import build_training_batch


def mixed_tensors():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(-5, 5, (7,), generator=g),                     # int64
            torch.rand(3, 5, generator=g),                                # float32, 2-D
            torch.randint(0, 9, (11,), generator=g, dtype=torch.int32),
            torch.tensor([True, False, True]),                            # bool, 3 bytes
            torch.empty(0, dtype=torch.long),                             # empty
            torch.arange(12.0, dtype=torch.float64).view(3, 4).t()]      # not contiguous


def test_packing_puts_every_tensor_at_an_aligned_offset_and_unpacks_equal():
    tensors = mixed_tensors()
    offsets, total = packed_offsets(tensors)
    assert all(o % ALIGN == 0 for o in offsets) and total % ALIGN == 0
    assert offsets == sorted(offsets) and total >= sum(t.numel() * t.element_size() for t in tensors)
    back = unpack(pack(tensors, pin=False).clone(), tensors)  # the copy stands for the device buffer
    for t, b in zip(tensors, back):
        assert b.dtype == t.dtype and b.shape == t.shape and torch.equal(b, t)


def test_off_the_gpu_tensors_move_as_they_are():
    tensors = mixed_tensors()
    for t, moved in zip(tensors, to_device(tensors, "cpu")):
        assert moved is t or torch.equal(moved, t)


def batch():
    ids = torch.randint(0, 50, (30,), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(30, dtype=torch.bool)
    cu = torch.tensor([0, 12, 30], dtype=torch.int32)
    return build_training_batch(ids, mask, cu, [torch.tensor([2, 5]), torch.tensor([0, 3, 9])], block_size=4,
                                mask_token_id=49, gamma=7.0)


def test_a_training_batch_keeps_every_field_through_the_move():
    b = batch()
    moved = b.to("cpu")
    assert moved.num_anchors == b.num_anchors and moved.layout.block_size == b.layout.block_size
    for name in ("block_ids", "block_positions", "labels", "weights", "loss_rows"):
        assert torch.equal(getattr(moved, name), getattr(b, name)), name
    for name in ("query_seq", "query_anchor", "query_block", "ctx_seq", "ctx_pos", "cu_seqlens"):
        assert torch.equal(getattr(moved.layout, name), getattr(b.layout, name)), name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_one_non_blocking_copy_to_the_gpu_equals_tensor_to():
    tensors = mixed_tensors() + [torch.ones(2, device="cuda")]
    moved = to_device(tensors, "cuda")
    torch.cuda.synchronize()
    for t, m in zip(tensors, moved):
        assert m.device.type == "cuda" and m.dtype == t.dtype and torch.equal(m.cpu(), t.cpu())
    b, on_gpu = batch(), batch().to("cuda")
    torch.cuda.synchronize()
    assert torch.equal(on_gpu.labels.cpu(), b.labels) and torch.equal(on_gpu.layout.ctx_pos.cpu(), b.layout.ctx_pos)
