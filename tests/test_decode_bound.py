"""decode/bound.py: the weight-bandwidth bound of decoding and the bandwidth it is taken at."""

import pytest
import torch
from torch import nn

from dflash_ipc.decode import bound


def test_the_bound_of_a_run():
    b = bound.bound(tokens=100, seconds=2.0, steps=100, weight_bytes=10**9, hbm_bytes_per_s=1e12,
                    kv_positions_read=1000, kv_bytes_per_token=10**9)
    assert b.weights_s == pytest.approx(0.1) and b.with_kv_s == pytest.approx(1.1)
    assert b.ratio == pytest.approx(0.05) and b.ratio_with_kv == pytest.approx(0.55)
    assert b.tokens_per_s == 50 and b.bound_tokens_per_s == pytest.approx(1000)


def test_weight_bytes_skip_an_untied_input_embedding_only():
    class LM(nn.Module):
        def __init__(self, tied: bool):
            super().__init__()
            self.embed, self.body = nn.Embedding(10, 4), nn.Linear(4, 4, bias=False)
            self.head = nn.Linear(4, 10, bias=False)
            if tied:
                self.head.weight = self.embed.weight

        def get_input_embeddings(self):
            return self.embed

        def get_output_embeddings(self):
            return self.head

    assert bound.weight_bytes(LM(tied=False)) == (16 + 40) * 4
    assert bound.weight_bytes(LM(tied=True)) == (16 + 40) * 4  # the tied weight counted once, as the head


@pytest.mark.parametrize("name,tbps", [("NVIDIA H100 80GB HBM3", 3.35), ("NVIDIA H200", 4.8), ("NVIDIA H100 NVL", 3.9),
                                       ("NVIDIA H100 PCIe", 2.0), ("NVIDIA GH200 480GB", 4.8),
                                       ("A GPU of the future", 4.8)])
def test_the_bandwidth_is_the_gpus_own_unless_given(monkeypatch, name, tbps):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert bound.hbm_tbps("cuda:0") == tbps  # a GPU not in the table (or ambiguous): the H200's figure
    assert bound.hbm_tbps("cuda:0", given=1.5) == 1.5
    assert bound.hbm_tbps("cpu") == 4.8
