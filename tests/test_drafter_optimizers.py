"""optimizer.name: which parameters Muon gets, one state dict over two optimizers, a falling loss."""

import collections

import pytest
import torch

from dflash_ipc.config.schema import OptimizerConfig
from dflash_ipc.config.load import load_config
from dflash_ipc.drafter import optimizers
from dflash_ipc.drafter.model import DFlashConfig, DFlashDraftModel
from dflash_ipc.errors import ConfigError

torch.set_num_threads(1)


def tiny_model(layers: int = 2) -> DFlashDraftModel:
    torch.manual_seed(0)
    return DFlashDraftModel(DFlashConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=layers,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=64,
                                         mask_token_id=63, target_layer_ids=[0, 1], num_target_layers=2))


MATRICES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
            "mlp.up_proj", "mlp.down_proj")


def test_muon_gets_every_matrix_and_adamw_the_norms():
    model = tiny_model()
    model.extra = torch.nn.Parameter(torch.zeros(1, 8))  # a degenerate matrix stays with AdamW
    muon, adamw = optimizers.split_parameters(model)
    names = [n for n, _ in muon]
    assert names == ["fc.weight"] + [f"layers.{i}.{m}.weight" for i in range(2) for m in MATRICES]
    rest = [n for n, _ in adamw]
    assert rest == ["extra", "hidden_norm.weight"] + [
        f"layers.{i}.{m}.weight" for i in range(2) for m in ("self_attn.q_norm", "self_attn.k_norm",
                                                             "input_layernorm", "post_attention_layernorm")
    ] + ["norm.weight"]
    assert len(names) + len(rest) == len(list(model.parameters()))  # a partition, nothing twice or lost


def test_muon_optimizer_is_torchs_with_the_config_and_a_scheduler_reaches_both_parts():
    model = tiny_model(1)
    cfg = OptimizerConfig(name="muon", lr=1e-3, muon_lr=4e-3, muon_momentum=0.9, muon_weight_decay=0.01)
    opt = optimizers.build_optimizer(model, cfg, torch.device("cpu"))
    muon, adamw = opt.parts
    assert type(muon) is torch.optim.Muon and type(adamw) is torch.optim.AdamW
    group = muon.param_groups[0]
    assert (group["momentum"], group["weight_decay"], group["nesterov"], group["adjust_lr_fn"]) == \
        (0.9, 0.01, True, "match_rms_adamw")
    torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.25)
    assert [g["lr"] for g in muon.param_groups + adamw.param_groups] == [1e-3, 2.5e-4]
    assert type(optimizers.build_optimizer(model, OptimizerConfig(name="adamw"), torch.device("cpu"))) is torch.optim.AdamW


def test_the_chained_state_dict_numbers_parameters_like_one_optimizer_and_loads_back():
    model = tiny_model(1)
    opt = optimizers.build_optimizer(model, OptimizerConfig(name="muon"), torch.device("cpu"))
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    sd = opt.state_dict()
    counts = [len(g["params"]) for g in sd["param_groups"]]
    assert sum(counts) == len(list(model.parameters())) == len(sd["state"])
    assert [i for g in sd["param_groups"] for i in g["params"]] == list(range(sum(counts)))
    assert set(sd["state"][0]) == {"momentum_buffer"} and "exp_avg" in sd["state"][counts[0]]
    other = optimizers.build_optimizer(model, OptimizerConfig(name="muon"), torch.device("cpu"))
    other.load_state_dict(sd)
    assert other.param_groups[0] is other.parts[0].param_groups[0]  # still shared after the load
    assert torch.equal(other.state_dict()["state"][0]["momentum_buffer"], sd["state"][0]["momentum_buffer"])


def test_a_few_muon_steps_lower_the_loss():
    model = tiny_model(1)
    opt = optimizers.build_optimizer(model, OptimizerConfig(name="muon", lr=2e-2), torch.device("cpu"))
    g = torch.Generator().manual_seed(3)
    features, embeds = torch.randn(8, 64, generator=g), torch.randn(8, 32, generator=g)
    target = torch.randn(8, 32, generator=g)
    mask = torch.ones(8, 16, dtype=torch.bool)  # every query sees every key: a plain regression
    losses = []
    for _ in range(6):
        out = model(features, torch.arange(8), embeds, torch.arange(8, 16), mask)
        loss = torch.nn.functional.mse_loss(out, target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(b < a for a, b in zip(losses, losses[1:])) and losses[-1] < 0.92 * losses[0], losses


def test_muon_is_a_clear_error_without_torch_muon_and_with_fsdp(monkeypatch):
    monkeypatch.delattr(torch.optim, "Muon")
    with pytest.raises(ConfigError, match=r"optimizer.name=muon needs torch.optim.Muon \(torch >= 2.9\)"):
        optimizers.build_optimizer(tiny_model(1), OptimizerConfig(name="muon"), torch.device("cpu"))
    with pytest.raises(ConfigError, match="muon needs whole matrices on every rank"):
        load_config(None, ["optimizer.name=muon", "drafter.sharding=fsdp"])
    with pytest.raises(ConfigError, match="optimizer.name: 'lion' not allowed; allowed: adamw, muon"):
        load_config(None, ["optimizer.name=lion"])


def test_a_chained_optimizers_state_is_a_live_view_of_its_parts():
    import torch

    from dflash_ipc.drafter.optimizers import ChainedOptimizer
    a, b = torch.nn.Parameter(torch.ones(2, 2)), torch.nn.Parameter(torch.ones(3))
    chained = ChainedOptimizer([torch.optim.SGD([a], lr=0.1, momentum=0.9), torch.optim.SGD([b], lr=0.1, momentum=0.9)])
    assert not chained.state  # nothing stepped yet
    (a.sum() + b.sum()).backward()
    chained.step()
    assert set(chained.state) == {a, b} and "momentum_buffer" in chained.state[b]
