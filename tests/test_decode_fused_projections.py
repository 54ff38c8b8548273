"""decode/fused_projections.py: q|k|v and gate|up as one product each.

CPU, float32, tiny random targets built from a config: the fused model's logits equal the
model's own, its parameters are views of the fused weights (no memory added), a member called
on its own input is still right, and the compiled decode layer (``aot_eager``) with fused
projections gives the eager tokens with no recompile per layer and no graph break. Fusion is
on for CUDA targets by default; here it is applied by hand (CPU keeps the model as loaded)."""

import torch
import torch.nn.functional as F
from torch._dynamo.testing import CompileCounterWithBackend
from transformers import LlamaConfig, LlamaForCausalLM

from dflash_ipc.decode import compiled, fused_projections
from dflash_ipc.decode.fused_projections import FUSE_ENV, FusedMember, fuse_projections
from dflash_ipc.decode.target import BatchedTarget
from decode_switch_helpers import check_switch_setting, greedy_tokens, make_requests

torch.set_num_threads(1)


def llama_with_biases():
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=100, attention_bias=True, mlp_bias=True)
    return LlamaForCausalLM(config).eval()


def test_fused_logits_equal_the_models_own_with_no_memory_added():
    model = llama_with_biases()
    ids = torch.randint(0, 100, (2, 7))
    with torch.no_grad():
        want = model(ids).logits
    count = sum(p.numel() for p in model.parameters())
    assert fuse_projections(model) == 4  # q|k|v and gate|up of 2 layers
    attn = model.model.layers[0].self_attn
    assert isinstance(attn.q_proj, FusedMember) and attn.q_proj.bias is not None
    group = attn.q_proj.group
    assert group.bounds == ((0, 32), (32, 48), (48, 64)) and group.weight.shape == (64, 32)
    for member in (attn.q_proj, attn.k_proj, attn.v_proj):  # views of the fused weight, not copies
        assert member.weight.untyped_storage().data_ptr() == group.weight.untyped_storage().data_ptr()
    assert sum(p.numel() for p in model.parameters()) == count
    with torch.no_grad():
        got = model(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert group.x is None and group.y is None  # every member read the product: nothing kept
    assert fuse_projections(model) == 0  # nothing plain left to fuse


def test_a_member_on_another_input_computes_its_own_columns():
    model = llama_with_biases()
    mlp = model.model.layers[1].mlp
    gate_w, up_w, up_b = mlp.gate_proj.weight.clone(), mlp.up_proj.weight.clone(), mlp.up_proj.bias.clone()
    fuse_projections(model)
    a, b = torch.randn(3, 32), torch.randn(3, 32)
    with torch.no_grad():
        torch.testing.assert_close(mlp.gate_proj(a), F.linear(a, gate_w, mlp.gate_proj.bias))
        torch.testing.assert_close(mlp.up_proj(b), F.linear(b, up_w, up_b))  # not a's product
        torch.testing.assert_close(mlp.up_proj(a), F.linear(a, up_w, up_b))


def test_groups_that_differ_are_left_alone():
    model = llama_with_biases()
    attn = model.model.layers[0].self_attn
    attn.v_proj = torch.nn.Linear(32, 16, bias=False)  # the others have biases
    assert fuse_projections(model) == 3
    assert type(attn.q_proj) is torch.nn.Linear


def test_the_setting(monkeypatch):
    check_switch_setting(monkeypatch, FUSE_ENV, fused_projections.enabled)
    assert fused_projections.enabled("cuda:0")  # unset: on for CUDA (no Triton needed)


def test_compiled_fused_layers_give_the_eager_tokens_once_compiled(four_layer_target, monkeypatch):
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    monkeypatch.setattr(compiled, "BACKEND", counter)
    batch = make_requests(5, max_len=30, max_new=12)

    def run(target, compile):
        return greedy_tokens(target, batch, compile=compile, max_rows=2)

    plain = BatchedTarget(four_layer_target, device="cpu", dtype="float32", compile_scope="layer")
    fused = BatchedTarget(four_layer_target, device="cpu", dtype="float32", compile_scope="layer")
    assert fuse_projections(fused.model) == 8
    torch._dynamo.utils.counters.clear()
    want = run(plain, "off")
    assert run(fused, "off") == want
    assert run(fused, "on") == want and not fused._compiled_extend.failed
    # steps and prefills, each a rows bucket of 2 and one of 1 row, for all 4 layers; the final norm
    # and the rotary table, one row and more rows each
    assert counter.frame_count == 4 + 4
    assert not torch._dynamo.utils.counters["graph_break"]
    torch._dynamo.reset()
