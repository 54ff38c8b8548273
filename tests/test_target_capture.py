"""The target's captured features: packed, valid tokens only, equal to HF hidden states."""

import os

import torch
from transformers import AutoModelForCausalLM

from dflash_ipc.target.capture import FeatureCapture


def test_padded_batch_packs_the_same_features_as_each_sequence_alone(tiny_cache):
    path = os.path.join(tiny_cache, "tiny-target")
    layer_ids = [0, 2]
    capture = FeatureCapture(path, layer_ids=layer_ids, dtype="float32", attn_implementation="sdpa", device="cpu")
    full = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([7, 12, 3])
    ids = torch.zeros(3, 12, dtype=torch.long)
    for row, n in enumerate(lengths.tolist()):
        ids[row, :n] = torch.randint(10, 500, (n,), generator=g)
    out = torch.full((int(lengths.sum()) + 5, capture.feature_dim), float("nan"))
    assert capture.forward_into(ids, lengths, out) == int(lengths.sum())
    assert torch.isnan(out[int(lengths.sum()):]).all()  # nothing written past the batch
    offset = 0
    with torch.no_grad():
        for row, n in enumerate(lengths.tolist()):
            states = full(input_ids=ids[row:row + 1, :n], output_hidden_states=True).hidden_states
            want = torch.cat([states[i + 1][0] for i in layer_ids], dim=-1)  # [n, 2H]
            torch.testing.assert_close(out[offset:offset + n], want, rtol=1e-3, atol=1e-4)  # batched vs alone: float rounding only
            offset += n
