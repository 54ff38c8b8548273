"""eval/drafter_projections.py: a drafter layer's products over concatenated weights (CPU: F.linear)."""

import torch
from torch import nn

from dflash_ipc.drafter.model import DFlashConfig, DFlashDecoderLayer
from dflash_ipc.eval.drafter_projections import FusedProjections, ModuleProjections, fusable, layer_projections


def _layer(seed=0) -> DFlashDecoderLayer:
    torch.manual_seed(seed)
    config = DFlashConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=8, vocab_size=64, mask_token_id=63, target_layer_ids=[0],
                          num_target_layers=2, block_size=4)
    layer = DFlashDecoderLayer(config)
    for p in layer.parameters():
        nn.init.normal_(p, std=0.2)
    return layer


def test_fused_products_equal_the_modules_and_keep_the_parameters():
    layer = _layer()
    x = torch.randn(5, 32)
    before = {name: (p, p.detach().clone()) for name, p in layer.named_parameters()}
    reference = ModuleProjections(layer)
    want = (*reference.qkv(x), *reference.kv(x), reference.o(torch.randn(5, 32)), reference.mlp_forward(x))
    fused = FusedProjections(layer)
    for name, p in layer.named_parameters():
        assert p is before[name][0] and torch.equal(p, before[name][1]), name  # same Parameter, same values
    attn, mlp = layer.self_attn, layer.mlp
    assert attn.q_proj.weight.data_ptr() == fused.w_qkv.data_ptr()  # views of the group's tensor: no copy
    assert attn.v_proj.weight.data_ptr() == fused.w_kv[attn.k_proj.out_features:].data_ptr()
    assert mlp.up_proj.weight.data_ptr() == fused.w_gate_up[mlp.gate_proj.out_features:].data_ptr()
    torch.manual_seed(0)
    got = (*fused.qkv(x), *fused.kv(x))
    for a, b in zip(got, want[:5], strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fused.mlp_forward(x), want[6], atol=1e-5, rtol=1e-5)
    o_in = torch.randn(5, 32)
    torch.testing.assert_close(fused.o(o_in), reference.o(o_in), atol=1e-6, rtol=1e-6)


def test_only_layers_without_biases_in_one_dtype_are_fused():
    layer = _layer()
    assert fusable(layer)
    assert [type(p) for p in layer_projections([layer], kernels=False)] == [ModuleProjections]
    assert [type(p) for p in layer_projections([layer], kernels=True)] == [FusedProjections]
    biased = _layer(1)
    biased.self_attn.k_proj = nn.Linear(32, 16, bias=True)
    assert not fusable(biased)
    assert [type(p) for p in layer_projections([biased], kernels=True)] == [ModuleProjections]
    mixed = _layer(2)
    mixed.mlp.up_proj.to(torch.float64)
    assert not fusable(mixed)


def test_a_second_context_reuses_the_groups_while_the_weights_are_their_views():
    layer = _layer()
    first = FusedProjections(layer)
    again = FusedProjections(layer)
    assert again.w_qkv is first.w_qkv and again.w_gate_up is first.w_gate_up
    assert "dflash_qkv_weight" not in layer.state_dict() and len(layer.state_dict()) == len(_layer().state_dict())
    with torch.no_grad():
        layer.self_attn.k_proj.weight.data = layer.self_attn.k_proj.weight.detach().clone()  # moved off the group
    moved = FusedProjections(layer)
    assert moved.w_qkv is not first.w_qkv
    assert layer.self_attn.k_proj.weight.data_ptr() == moved.w_kv.data_ptr()
    x = torch.randn(3, 32)
    torch.testing.assert_close(moved.qkv(x)[1], layer.self_attn.k_proj(x))
