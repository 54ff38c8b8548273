"""The drafter model: config, equivalence with HF Qwen3 pieces, masking, and a tiny overfit."""

import math

import pytest
import torch
from transformers import LlamaConfig, Qwen3Config
from transformers.models.qwen3 import modeling_qwen3 as hf

from dflash_ipc.drafter.attention import BlockLayout, build_mask, dense_mask
from dflash_ipc.drafter import model as model_mod
from dflash_ipc.drafter.model import (
    CudaCompiled,
    DFlashConfig,
    DFlashDraftModel,
    RotaryEmbedding,
    apply_rope,
    rms_norm,
    rms_norm_rope,
    swiglu,
)
from dflash_ipc.drafter.objective import build_training_batch, weighted_ce_sum
from dflash_ipc.hf.layer_ids import default_target_layer_ids
from dflash_ipc.hf.target_head import FrozenTargetHead
from dflash_ipc.errors import ConfigError

torch.set_num_threads(1)

QWEN3_8B = dict(hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                head_dim=128, intermediate_size=12288, vocab_size=151936, rms_norm_eps=1e-6,
                rope_theta=1000000, max_position_embeddings=40960)


def tiny_config(**kw) -> DFlashConfig:
    base = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, vocab_size=97, mask_token_id=96,
                target_layer_ids=[0, 2, 3], num_target_layers=4, block_size=4)
    base.update(kw)
    return DFlashConfig(**base)


def test_default_target_layer_ids():
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(28, 5) == [1, 7, 13, 19, 25]
    assert default_target_layer_ids(36, 1) == [18]
    assert default_target_layer_ids(4, 2) == [1, 1]
    with pytest.raises(ConfigError):
        default_target_layer_ids(3, 2)


def test_from_target_config_qwen3_8b():
    cfg = DFlashConfig.from_target_config(Qwen3Config(**QWEN3_8B), mask_token_id=151669)
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads, cfg.num_key_value_heads) == (
        4096, 12288, 32, 8)
    assert (cfg.head_dim, cfg.vocab_size, cfg.num_target_layers, cfg.num_hidden_layers) == (128, 151936, 36, 5)
    assert cfg.target_layer_ids == [1, 9, 17, 25, 33]
    assert cfg.rope_theta == 1e6 and cfg.rope_scaling is None and cfg.rms_norm_eps == 1e-6
    assert cfg.max_position_embeddings == 40960 and cfg.block_size == 16


def test_from_target_config_llama_defaults_and_scaling():
    llama = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=8, num_attention_heads=8,
                        num_key_value_heads=2, vocab_size=1000, rope_theta=5e5,
                        rope_scaling={"rope_type": "linear", "factor": 2.0})
    cfg = DFlashConfig.from_target_config(llama, num_draft_layers=3, block_size=8, mask_token_id=999)
    assert cfg.head_dim == 32 and cfg.num_key_value_heads == 2 and cfg.target_layer_ids == [1, 3, 5]
    assert cfg.rope_theta == 5e5 and cfg.rope_scaling == {"rope_type": "linear", "factor": 2.0}


def test_hf_dict_round_trip_and_zlab_layout():
    cfg = tiny_config(rope_scaling={"type": "linear", "factor": 4.0})
    assert cfg.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    assert DFlashConfig.from_hf_dict(cfg.to_hf_dict()) == cfg
    # z-lab published layout: top-level block_size, nested mask/layers, legacy rope keys
    zlab = {"architectures": ["DFlashDraftModel"], "block_size": 16, "num_target_layers": 36,
            "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]},
            "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 5,
            "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
            "rope_theta": 1000000, "vocab_size": 151936, "auto_map": {"AutoModel": "dflash.DFlashDraftModel"}}
    z = DFlashConfig.from_hf_dict(zlab)
    assert z.block_size == 16 and z.mask_token_id == 151669 and z.target_layer_ids == [1, 9, 17, 25, 33]
    with pytest.raises(ConfigError, match="mask_token_id"):
        DFlashConfig.from_hf_dict({**zlab, "dflash_config": {"target_layer_ids": [1]}}, source="x/config.json")


@pytest.mark.parametrize("bad,match", [
    (dict(mask_token_id=97), "mask_token_id"),
    (dict(num_key_value_heads=3), "num_key_value_heads"),
    (dict(target_layer_ids=[4]), "target_layer_ids"),
    (dict(block_size=1), "block_size"),
])
def test_config_validation(bad, match):
    with pytest.raises(ConfigError, match=match):
        tiny_config(**bad)


@pytest.mark.parametrize("scaling", [None, {"rope_type": "linear", "factor": 2.0}])
def test_rotary_matches_transformers(scaling):
    cfg = tiny_config(rope_theta=1e6, rope_scaling=scaling, max_position_embeddings=40960)
    ref = hf.Qwen3RotaryEmbedding(Qwen3Config(hidden_size=64, num_attention_heads=4, head_dim=16, rope_theta=1e6,
                                              rope_scaling=dict(scaling) if scaling else None,
                                              max_position_embeddings=40960))
    pos = torch.arange(0, 40000, 13)
    cos, sin = ref(torch.zeros(1), pos[None])
    mcos, msin = RotaryEmbedding(cfg)(pos)
    torch.testing.assert_close(mcos, cos[0], rtol=0, atol=0)
    torch.testing.assert_close(msin, sin[0], rtol=0, atol=0)


def one_sequence_layout(length: int, anchors: list[int], bs: int) -> BlockLayout:
    ids = torch.arange(length)
    batch = build_training_batch(ids, torch.ones(length, dtype=torch.bool), torch.tensor([0, length]),
                                 [torch.tensor(anchors)], block_size=bs, mask_token_id=0, gamma=7.0)
    return batch.layout


def test_attention_equals_hf_qwen3_attention_over_concatenated_sequence():
    """KV injection == HF Qwen3Attention run on [ctx; block] with the DFlash mask."""
    torch.manual_seed(0)
    cfg = tiny_config()
    model = DFlashDraftModel(cfg)
    ours = model.layers[0].self_attn
    hf_cfg = Qwen3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         intermediate_size=96, rms_norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta)
    hf_cfg._attn_implementation = "eager"
    ref = hf.Qwen3Attention(hf_cfg, layer_idx=0)
    with torch.no_grad():
        for name in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"):
            getattr(ref, name).weight.copy_(getattr(ours, name).weight)
            getattr(ours, name).weight.add_(torch.randn_like(getattr(ours, name).weight) * 0.1)
            getattr(ref, name).weight.copy_(getattr(ours, name).weight)
    length, anchors, bs = 11, [0, 3, 7, 9], 4
    layout = one_sequence_layout(length, anchors, bs)
    ctx, x = torch.randn(length, 64), torch.randn(len(anchors) * bs, 64)
    block_pos = (torch.tensor(anchors)[:, None] + torch.arange(bs)).reshape(-1)
    positions = torch.cat([torch.arange(length), block_pos])
    cos, sin = model.rotary(positions)
    mask = dense_mask(layout)  # [Q, T+Q]
    out = ours(x, ctx, cos, sin, mask)

    n = length + x.shape[0]
    full = torch.eye(n, dtype=torch.bool)  # context rows: themselves only (their output is unused)
    full[length:] = mask
    additive = torch.zeros(n, n).masked_fill(~full, torch.finfo(torch.float32).min)
    ref_out, _ = ref(torch.cat([ctx, x])[None], (cos[None], sin[None]), additive[None, None])
    torch.testing.assert_close(out, ref_out[0, length:], rtol=1e-5, atol=1e-5)


def test_mlp_and_norm_equal_hf():
    torch.manual_seed(0)
    cfg = tiny_config()
    layer = DFlashDraftModel(cfg).layers[0]
    hf_cfg = Qwen3Config(hidden_size=64, intermediate_size=96, rms_norm_eps=cfg.rms_norm_eps)
    mlp, norm = hf.Qwen3MLP(hf_cfg), hf.Qwen3RMSNorm(64, eps=cfg.rms_norm_eps)
    with torch.no_grad():
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(mlp, name).weight.copy_(getattr(layer.mlp, name).weight)
        layer.input_layernorm.weight.uniform_(0.5, 1.5)
        norm.weight.copy_(layer.input_layernorm.weight)
    x = torch.randn(7, 64) * 3
    torch.testing.assert_close(layer.mlp(x), mlp(x))
    torch.testing.assert_close(layer.input_layernorm(x), norm(x))


def test_apply_rope_rotates_pairs():
    x = torch.tensor([[[1.0, 2.0, 3.0, 4.0]]])  # [1, 1, D=4]: pairs (x0, x2), (x1, x3)
    ang = torch.tensor([[0.5, 0.25, 0.5, 0.25]])
    out = apply_rope(x, ang.cos(), ang.sin())[0, 0]
    want = [1 * math.cos(0.5) - 3 * math.sin(0.5), 2 * math.cos(0.25) - 4 * math.sin(0.25),
            3 * math.cos(0.5) + 1 * math.sin(0.5), 4 * math.cos(0.25) + 2 * math.sin(0.25)]
    torch.testing.assert_close(out, torch.tensor(want))


def packed_inputs(cfg, lengths, anchors, seed=0):
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    ids = torch.randint(0, cfg.vocab_size - 1, (total,), generator=gen)
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)))
    batch = build_training_batch(ids, torch.ones(total, dtype=torch.bool), cu, [torch.tensor(a) for a in anchors],
                                 block_size=cfg.block_size, mask_token_id=cfg.mask_token_id, gamma=7.0)
    features = torch.randn(total, cfg.num_context_features * cfg.hidden_size, generator=gen)
    embed = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=gen)
    return batch, features, embed


def run(model, batch, features, embed, backend="dense"):
    return model(features, batch.context_positions, embed[batch.block_ids], batch.block_positions,
                 build_mask(batch.layout, backend))


def test_packed_batch_equals_sequences_alone():
    torch.manual_seed(0)
    cfg = tiny_config()
    model = DFlashDraftModel(cfg)
    lengths, anchors = [9, 6, 12], [[0, 4, 7], [2], [1, 5, 10]]
    batch, features, embed = packed_inputs(cfg, lengths, anchors)
    packed = run(model, batch, features, embed)
    start, row = 0, 0
    for n, a in zip(lengths, anchors):
        single, _, _ = packed_inputs(cfg, [n], [a])
        single.block_ids = batch.block_ids[row: row + len(a) * cfg.block_size]
        alone = run(model, single, features[start: start + n], embed)
        torch.testing.assert_close(packed[row: row + len(a) * cfg.block_size], alone, rtol=1e-5, atol=1e-5)
        start, row = start + n, row + len(a) * cfg.block_size


def test_block_sees_only_context_before_its_anchor():
    torch.manual_seed(0)
    cfg = tiny_config()
    model = DFlashDraftModel(cfg)
    batch, features, embed = packed_inputs(cfg, [12], [[6]])
    base = run(model, batch, features, embed)
    later = features.clone()
    later[6:] += 1.0  # context at positions >= anchor: invisible
    torch.testing.assert_close(run(model, batch, later, embed), base, rtol=0, atol=0)
    earlier = features.clone()
    earlier[5] += 1.0  # context just before the anchor: visible
    assert (run(model, batch, earlier, embed) - base).abs().max() > 1e-3


def test_gradient_checkpointing_gives_same_grads():
    torch.manual_seed(0)
    cfg = tiny_config()
    model = DFlashDraftModel(cfg)
    batch, features, embed = packed_inputs(cfg, [10, 7], [[1, 5], [0, 3]])
    proj = torch.randn(batch.block_ids.numel(), cfg.hidden_size)
    grads = []
    for ckpt in (False, True):
        model.zero_grad()
        model.gradient_checkpointing = ckpt
        (run(model, batch, features, embed) * proj).sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)


def test_tiny_drafter_overfits_fixed_batch():
    """30 AdamW steps on fixed features: the weighted CE must fall well below its start."""
    torch.manual_seed(0)
    cfg = tiny_config(num_hidden_layers=1, block_size=4)
    model = DFlashDraftModel(cfg)
    batch, features, embed = packed_inputs(cfg, [24, 17], [[0, 3, 8, 12, 19], [1, 6, 11]], seed=1)
    head = FrozenTargetHead(embed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    mask = build_mask(batch.layout, "dense")
    losses = []
    for _ in range(30):
        hidden = model(features, batch.context_positions, head.embed(batch.block_ids), batch.block_positions, mask)
        loss = weighted_ce_sum(hidden, head, batch.labels, batch.weights, chunk_size=16) / batch.weights.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[0] > math.log(cfg.vocab_size) * 0.8  # starts near chance
    assert losses[-1] < 0.3 * losses[0], losses


def test_autocast_bf16_step_runs_and_tracks_float32():
    """The trainer's mode: float32 parameters under bf16 autocast, bf16 features."""
    torch.manual_seed(0)
    cfg = tiny_config()
    model = DFlashDraftModel(cfg)
    batch, features, embed = packed_inputs(cfg, [10, 7], [[1, 5], [0, 3]])
    head = FrozenTargetHead(embed.to(torch.bfloat16))
    ref = run(model, batch, features, embed)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = run(model, batch, features.to(torch.bfloat16), embed.to(torch.bfloat16))
        loss = weighted_ce_sum(out, head, batch.labels, batch.weights)
    loss.backward()
    torch.testing.assert_close(out.float(), ref, rtol=0.1, atol=0.1)
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("autocast", [False, True])
def test_model_flex_and_dense_agree_on_gpu(autocast):
    torch.manual_seed(0)
    cfg = tiny_config(block_size=16, num_hidden_layers=2)
    model = DFlashDraftModel(cfg).cuda()
    batch, features, embed = packed_inputs(cfg, [300, 77, 190], [[0, 5, 40, 130, 280], [3, 60], [9, 100, 150]])
    batch, features, embed = batch.to("cuda"), features.cuda(), embed.cuda()
    # A fixed random projection: a loss like out.square().mean() is nearly constant after
    # the final RMSNorm, so its upstream gradients would be rounding noise.
    proj = torch.randn(batch.block_ids.numel(), cfg.hidden_size, device="cuda")
    outs, grads = [], []
    for backend in ("dense", "flex"):
        model.zero_grad()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            out = run(model, batch, features, embed, backend)
        (out.float() * proj).sum().backward()
        outs.append(out.detach().float())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    tol = dict(rtol=3e-2, atol=3e-2) if autocast else dict(rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(outs[1], outs[0], **tol)
    for name in grads[0]:
        g_dense, g_flex = grads[0][name], grads[1][name]
        rel = (g_flex - g_dense).norm() / g_dense.norm()
        assert rel < (3e-2 if autocast else 1e-4), (name, rel.item())


def test_rms_norm_returns_input_dtype_with_float32_statistics():
    """bf16 input, float32 weight (the trainer's mode): the value the Linear consumers saw
    before (float32 ``weight * normalize(x)`` rounded to bf16), now rounded once, in bf16."""
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(9, 64, generator=gen) * 5).to(torch.bfloat16)
    w = torch.rand(64, generator=gen) + 0.5
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16)
    out = rms_norm(x, w, 1e-6)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, (w * normed).to(torch.bfloat16))
    assert rms_norm(x.float(), w, 1e-6).dtype == torch.float32
    assert rms_norm(x.double(), w, 1e-6).dtype == torch.float64


def test_rms_norm_rope_applies_rope_in_float32_then_rounds():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 4, 16, generator=gen).to(torch.bfloat16)  # [N, heads, D]
    w = torch.rand(16, generator=gen) + 0.5
    ang = torch.rand(5, 16, generator=gen) * 100
    out = rms_norm_rope(x, w, 1e-6, ang.cos(), ang.sin())
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16)
    want = apply_rope(w * normed, ang.cos(), ang.sin())  # float32 RoPE, as before the change
    assert out.dtype == torch.bfloat16 and torch.equal(out, want.to(torch.bfloat16))


def _rand_args(fn, n, gen):
    bf = dict(dtype=torch.bfloat16)
    if fn is rms_norm:
        return [torch.randn(n, 64, generator=gen).to(**bf).requires_grad_(), torch.rand(64, generator=gen)
                .add(0.5).requires_grad_(), 1e-6]
    if fn is rms_norm_rope:
        return [torch.randn(n, 4, 16, generator=gen).to(**bf).requires_grad_(), torch.rand(16, generator=gen)
                .add(0.5).requires_grad_(), 1e-6, torch.randn(n, 16, generator=gen), torch.randn(n, 16, generator=gen)]
    return [torch.randn(n, 32, generator=gen).to(**bf).requires_grad_(),
            torch.randn(n, 32, generator=gen).to(**bf).requires_grad_()]


@pytest.mark.parametrize("fn,dynamic", [(rms_norm, (0,)), (rms_norm_rope, (0, 3, 4)), (swiglu, (0, 1))])
def test_compiled_elementwise_one_graph_for_all_row_counts(fn, dynamic):
    """The compiled path traces whole (fullgraph) once for any number of rows, and its
    values and gradients are the eager ones (aot_eager: tracing without codegen)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = CudaCompiled(fn, dynamic_args=dynamic, backend=counter)
    gen = torch.Generator().manual_seed(0)
    for n in (7, 13, 30):
        args = _rand_args(fn, n, gen)
        eager_args = [a.detach().clone().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a
                      for a in args]
        got, want = compiled.compiled(*args), fn(*eager_args)
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)
        proj = torch.randn(got.shape, generator=gen)
        (got.float() * proj).sum().backward()
        (want.float() * proj).sum().backward()
        for a, e in zip(args, eager_args):
            if isinstance(a, torch.Tensor) and a.requires_grad:
                torch.testing.assert_close(a.grad, e.grad, rtol=2e-2, atol=2e-2)
    assert counter.frame_count == 1
    compiled(*_rand_args(fn, 3, gen))  # a plain call on CPU tensors runs eagerly: no new graph
    assert counter.frame_count == 1
    torch._dynamo.reset()


def _always_compiled(backend) -> dict:
    """The model's element-wise wrappers, compiled on any device (to monkeypatch in)."""
    class Always(CudaCompiled):
        __call__ = CudaCompiled.compiled
    return {name: Always(fn, dynamic_args=dyn, backend=backend) for name, fn, dyn in (
        ("fused_rms_norm", rms_norm, (0,)), ("fused_rms_norm_rope", rms_norm_rope, (0, 3, 4)),
        ("fused_swiglu", swiglu, (0, 1)))}


def test_model_compiled_path_equals_eager_under_autocast(monkeypatch):
    """Values and grads of the compiled path; 5 graphs in all for every layer and both
    batch shapes (norm of the grad-free block embeddings and of the rest, q and k
    norm+RoPE, SwiGLU): no per-layer or per-shape recompiles."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch.manual_seed(0)
    cfg = tiny_config()
    model = DFlashDraftModel(cfg)
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    wrappers = _always_compiled(counter)
    for lengths, anchors in (([10, 7], [[1, 5], [0, 3]]), ([13], [[0, 4, 9]])):
        batch, features, embed = packed_inputs(cfg, lengths, anchors)
        proj = torch.randn(batch.block_ids.numel(), cfg.hidden_size)
        outs, grads = [], []
        for compiled in (False, True):
            if compiled:
                for name, wrapper in wrappers.items():
                    monkeypatch.setattr(model_mod, name, wrapper)
            model.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = run(model, batch, features.to(torch.bfloat16), embed.to(torch.bfloat16))
            assert out.dtype == torch.bfloat16
            (out.float() * proj).sum().backward()
            outs.append(out.float())
            grads.append([p.grad.clone() for p in model.parameters()])
            monkeypatch.undo()
        torch.testing.assert_close(outs[1], outs[0], rtol=2e-2, atol=2e-2)
        for a, b in zip(*grads):
            assert ((a - b).norm() / b.norm()) < 2e-2
    assert counter.frame_count == 5
    torch._dynamo.reset()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_model_inductor_and_eager_agree_on_gpu(monkeypatch):
    """The real compiled kernels (inductor/Triton) against DFLASH_COMPILE=0 eager."""
    torch.manual_seed(0)
    cfg = tiny_config(block_size=16)
    model = DFlashDraftModel(cfg).cuda()
    outs, grads = [], []
    for flag in ("0", "1"):
        monkeypatch.setenv(model_mod.COMPILE_ENV, flag)
        for lengths, anchors in (([300, 77], [[0, 5, 40, 130], [3, 60]]), ([190], [[9, 100, 150]])):
            batch, features, embed = packed_inputs(cfg, lengths, anchors)
            batch, features, embed = batch.to("cuda"), features.cuda(), embed.cuda()
            proj = torch.randn(batch.block_ids.numel(), cfg.hidden_size, device="cuda",
                               generator=torch.Generator("cuda").manual_seed(1))
            model.zero_grad()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = run(model, batch, features, embed)
            (out.float() * proj).sum().backward()
            outs.append(out.detach().float())
            grads.append([p.grad.clone() for p in model.parameters()])
    for i in range(2):  # two shapes: the second runs the dynamic-rows graph
        torch.testing.assert_close(outs[2 + i], outs[i], rtol=3e-2, atol=3e-2)
        for a, b in zip(grads[2 + i], grads[i]):
            assert ((a - b).norm() / b.norm()) < 3e-2
