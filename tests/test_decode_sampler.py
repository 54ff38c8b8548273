"""Token choice on the device: greedy is the argmax; sampling draws from temperature / top-k /
top-p as transformers defines them (checked against the exact distribution), by key and index."""

import numpy as np
import pytest
import torch

from dflash_ipc.decode.sampler import TokenChoice, choose, uniforms
from dflash_ipc.errors import ConfigError


def expected(logits, temperature, top_k=0, top_p=1.0):
    """The distribution transformers' temperature -> top-k -> top-p warpers leave, over vocab order."""
    p = torch.softmax(logits.double() / temperature, -1)
    order = p.argsort(descending=True)
    keep = torch.zeros_like(p, dtype=torch.bool)
    kept_mass = 0.0
    ranked = p[order] / p[order[: top_k or len(p)]].sum()
    for rank, i in enumerate(order.tolist()):
        if (top_k and rank >= top_k) or kept_mass >= top_p:
            break
        keep[i] = True
        kept_mass += float(ranked[rank])
    q = torch.where(keep, p, 0.0)
    return (q / q.sum()).numpy()


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 0, 0.8), (1.3, 5, 1.0), (1.0, 6, 0.7)])
def test_sampling_matches_the_distribution(temperature, top_k, top_p):
    torch.manual_seed(0)
    logits = torch.randn(12) * 2
    want = expected(logits, temperature, top_k, top_p)
    n = 40000
    choice = TokenChoice(temperature=temperature, top_k=top_k, top_p=top_p)
    got = choose(logits.expand(n, -1).contiguous(), choice, torch.arange(n) * 7919 + 13, torch.full((n,), 3))
    freq = np.bincount(got.numpy(), minlength=12) / n
    assert np.all(freq[want == 0] == 0)  # outside top-k / top-p: never drawn
    # every probability within 5 standard errors
    assert np.all(np.abs(freq - want) <= 5 * np.sqrt(want * (1 - want) / n) + 1e-9), (freq, want)


def test_draws_depend_on_key_and_index_only():
    logits = torch.randn(3, 50)
    choice = TokenChoice(temperature=1.0)
    keys, index = torch.tensor([5, 6, 7]), torch.tensor([0, 1, 2])
    a = choose(logits, choice, keys, index)
    b = choose(logits[[2, 0, 1]], choice, keys[[2, 0, 1]], index[[2, 0, 1]])  # rows in another order
    assert a[[2, 0, 1]].tolist() == b.tolist()
    u = uniforms(torch.arange(100000), torch.zeros(100000, dtype=torch.long))
    assert 0 < float(u.min()) and float(u.max()) < 1 and abs(float(u.mean()) - 0.5) < 0.005
    assert len(set(u.tolist())) > 99000  # neighbouring keys do not collide
    assert choose(logits, TokenChoice()).tolist() == logits.argmax(-1).tolist()


def test_row_keys_and_validation():
    choice = TokenChoice(temperature=1.0, seed=4)
    assert choice.row_key((3, 0, 1)) == choice.row_key((3, 0, 1)) != choice.row_key((3, 0, 2))
    assert 0 <= choice.row_key((1, 1)) < 2**31 and TokenChoice(seed=5).row_key((1, 1)) != choice.row_key((1, 1))
    for bad, field in (({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"), ({"top_k": -2}, "top_k")):
        with pytest.raises(ConfigError, match=field):
            TokenChoice(**bad)
