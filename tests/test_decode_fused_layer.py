"""decode/fused_layer.py: a decoder layer's few-row step as three products carrying its small ops.

CPU: which layers are fused (the Llama family with both projection groups fused, a SiLU gate,
no MLP bias); the fused forward gives the class's output bit for bit (the ops' torch path is
the eager layer's ops) for Llama, Mistral, Qwen2 (biases on q|k|v) and Qwen3 (q/k norms) in
float32 and bfloat16; the ops' schemas (opcheck); the compiled decode (``aot_eager``) with the
fused step gives the eager tokens, runs the fused step for a few rows and the layer's own for
more, and compiles no more graphs per layer. On CUDA (marked gpu): the kernels' prologue and
epilogue against the torch ops, and a bf16 target's decode fused against unfused."""

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config,
                          Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

from dflash_ipc.decode import compiled, fused_layer, matvec
from dflash_ipc.decode.fused_layer import FUSE_LAYER_ENV, fusable
from dflash_ipc.decode.fused_projections import fuse_projections
from dflash_ipc.decode.target import BatchedTarget
from dflash_ipc.errors import ConfigError
from decode_switch_helpers import decode_verdicts, greedy_tokens, make_requests

torch.set_num_threads(1)
SMALL = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=100)
FAMILY = {"llama": (LlamaConfig, LlamaForCausalLM, {}), "mistral": (MistralConfig, MistralForCausalLM, {}),
          "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),  # biases on q|k|v
          "qwen3": (Qwen3Config, Qwen3ForCausalLM, dict(head_dim=8)),  # q/k norms
          "llama-mha-bias": (LlamaConfig, LlamaForCausalLM, dict(num_key_value_heads=4, attention_bias=True))}


def model_of(family: str, dtype=torch.float32, **fields):
    torch.manual_seed(0)
    config_class, model_class, extra = FAMILY[family]
    model = model_class(config_class(**{**SMALL, **extra, **fields})).eval().to(dtype)
    with torch.no_grad():  # norms away from 1, so that a norm left out or applied twice shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.mul_(1 + 0.2 * torch.randn_like(p))
    return model


def extend_logits(target, compile: bool, calls: dict | None = None):
    """Two rows' prompts prefilled, then a step of 1 token and one of 3 (a verify block): logits."""
    target.reset(num_rows=2, capacity=64)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 100, (n,), generator=g).numpy() for n in (5, 9)]
    target.prefill([0, 1], prompts, features=False)
    lengths = torch.tensor([5, 9])
    out = []
    for q in (1, 3):
        tokens = torch.randint(0, 100, (2, q), generator=g)
        out.append(target.extend(tokens, lengths, int(lengths.max()), features=False, compiled=compile)[0])
        if compile and calls is not None and target._compiled_extend is not None and not calls:
            for name, step in (("fused", target._compiled_extend.fused_step), ("own", target._compiled_extend.step)):
                calls[name] = 0
                step.compiled = _counting(step.compiled, calls, name)
        lengths = lengths + q
    return out


def _counting(fn, calls, name):
    def counted(*args):
        calls[name] += 1
        return fn(*args)
    return counted


@pytest.mark.parametrize("family", sorted(FAMILY))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_layers_give_the_layers_own_logits_bit_for_bit(family, dtype, tmp_path, monkeypatch):
    monkeypatch.setenv(FUSE_LAYER_ENV, "on")
    monkeypatch.setattr(compiled, "BACKEND", "eager")  # Dynamo's graphs run the same torch ops: no other rounding
    torch._dynamo.reset()
    model = model_of(family, dtype)
    target = BatchedTarget(str(tmp_path), model=model, compile_scope="layer")
    assert target.num_fused_layers == 0  # its projections are not fused yet
    fuse_projections(model)
    assert all(fusable(layer) for layer in model.model.layers)
    want = extend_logits(target, compile=False)  # the layers' own forward (over the fused projections, as on CUDA)
    calls = {}
    got = extend_logits(target, compile=True, calls=calls)
    assert target._compiled_extend.num_fused == 2 and not target._compiled_extend.fused_step.failed
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    assert calls == {"fused": 2, "own": 0}  # the 3-token step, one call per layer, after the counters were set
    torch._dynamo.reset()


@pytest.mark.parametrize("fields", [dict(mlp_bias=True), dict(hidden_act="gelu")], ids=["mlp_bias", "gelu"])
def test_layers_the_kernels_do_not_compute_are_not_fused(fields):
    model = model_of("llama", **fields)
    fuse_projections(model)
    assert not any(fusable(layer) for layer in model.model.layers)


def test_a_layer_of_another_family_is_not_fused():
    from transformers import Gemma2Config, Gemma2ForCausalLM  # (1 + w) norms, a GELU gate
    model = Gemma2ForCausalLM(Gemma2Config(**SMALL, head_dim=8)).eval()
    fuse_projections(model)
    assert not any(fusable(layer) for layer in model.model.layers)


def test_the_ops_check_out():
    torch.manual_seed(0)
    x, a = torch.randn(3, 24), torch.randn(3, 24)
    g, w, b, wgu, wd = torch.randn(24), torch.randn(10, 24), torch.randn(10), torch.randn(20, 24), torch.randn(24, 10)
    torch.library.opcheck(torch.ops.dflash.norm_linear.default, (x, g, 1e-6, w, b, 16))
    torch.library.opcheck(torch.ops.dflash.add_norm_glu.default, (x, a, g, 1e-6, wgu, 16))
    torch.library.opcheck(torch.ops.dflash.linear_add.default, (x[:, :10], wd, a, 16))
    act, h = torch.ops.dflash.add_norm_glu(x, a, g, 1e-6, wgu, 16)
    assert torch.equal(h, a + x) and act.shape == (3, 10)
    qkv, cos, sin = torch.randn(2, 3, 4 * 8), torch.randn(2, 3, 8), torch.randn(2, 3, 8)
    keys, values, rows, pos = torch.zeros(3, 6, 1, 8), torch.zeros(3, 6, 1, 8), torch.tensor([2, 0]), torch.tensor(
        [[0, 1, 2], [3, 4, 5]])
    torch.library.opcheck(torch.ops.dflash.qk_rope_write.default,
                          (qkv, cos, sin, torch.randn(8), torch.randn(8), 1e-6, keys, values, rows, pos, 2, 1))
    query = torch.ops.dflash.qk_rope_write(qkv, cos, sin, None, None, 1e-6, keys, values, rows, pos, 2, 1)
    assert query.shape == (2, 2, 3, 8) and torch.equal(values[2, :3, 0], qkv[0, :, 24:])  # v written as it is


def test_the_setting(monkeypatch):
    monkeypatch.setenv(FUSE_LAYER_ENV, "sometimes")
    with pytest.raises(ConfigError, match=f"{FUSE_LAYER_ENV}.*auto.*on.*off"):
        fused_layer.enabled("cpu")
    monkeypatch.setenv(FUSE_LAYER_ENV, "off")
    assert not fused_layer.enabled("cuda:0")
    monkeypatch.setenv(FUSE_LAYER_ENV, "on")
    assert fused_layer.enabled("cpu")
    monkeypatch.delenv(FUSE_LAYER_ENV)
    assert not fused_layer.enabled("cpu")  # auto: CUDA targets whose products run the kernels
    assert fused_layer.enabled("cuda:0") == matvec.available()


def test_the_rows_setting(monkeypatch):
    monkeypatch.setenv(fused_layer.ROWS_ENV, "17")
    with pytest.raises(ConfigError, match=f"{fused_layer.ROWS_ENV}.*1 to 16"):
        fused_layer.max_rows()
    monkeypatch.setenv(fused_layer.ROWS_ENV, "1")
    assert fused_layer.max_rows() == 1
    monkeypatch.delenv(fused_layer.ROWS_ENV)
    assert fused_layer.max_rows() == matvec.MAX_ROWS


def test_the_compiled_decode_runs_the_fused_step_for_few_rows_and_gives_the_eager_tokens(four_layer_target,
                                                                                       monkeypatch):
    monkeypatch.setenv(FUSE_LAYER_ENV, "on")
    monkeypatch.setenv(fused_layer.ROWS_ENV, "2")  # 2 rows fused; the prefills (and 3 rows) the layer's own step
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    monkeypatch.setattr(compiled, "BACKEND", counter)
    batch = make_requests(7, max_len=30, max_new=12)

    def run(target, compile, max_rows):
        return greedy_tokens(target, batch, compile=compile, max_rows=max_rows)

    plain = BatchedTarget(four_layer_target, device="cpu", dtype="float32", compile_scope="layer")
    fused = BatchedTarget(four_layer_target, device="cpu", dtype="float32", compile_scope="layer")
    assert fuse_projections(fused.model) == 8
    want = run(plain, "off", 2)
    calls = {"fused": 0, "own": 0, "prefill": 0}
    assert run(fused, "on", 2) == want  # builds the compiled layers
    layers = fused._compiled_extend
    assert layers.num_fused == 4 and not layers.failed and not layers.fused_step.failed
    for name, step in (("fused", layers.fused_step), ("own", layers.step), ("prefill", layers.prefill_step)):
        def counting(*args, _step=step.compiled, _name=name):
            calls[_name] += 1
            return _step(*args)
        step.compiled = counting
    torch._dynamo.utils.counters.clear()
    assert run(fused, "on", 2) == want
    # every step of 1 or 2 rows fused; prefills (any rows) the layer's own forward, compiled
    assert calls["fused"] > 0 and calls["own"] == 0 and calls["prefill"] > 0
    assert run(fused, "on", 3) == want
    assert calls["own"] > 0  # 3 rows: more than the fused step takes
    # fused and own steps, prefills: a rows bucket and one row each, all 4 layers; the final norm
    # and the rotary table: one row and more rows each
    assert counter.frame_count <= 6 + 4
    assert not torch._dynamo.utils.counters["graph_break"]
    torch._dynamo.reset()


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and matvec.available()), reason="needs CUDA and Triton")
@pytest.mark.parametrize("m,n,k", [(1, 4096, 2048), (1, 6144, 2048), (16, 4096, 2048), (5, 6144, 2048),
                                   (16, 1000, 700), (1, 33, 4096), (3, 1536, 1024)])
def test_the_kernels_prologue_and_epilogue_match_the_torch_ops(m, n, k):
    torch.manual_seed(n + m)
    dev, dt = "cuda:0", torch.bfloat16
    x, a = torch.randn(1, m, k, device=dev, dtype=dt), torch.randn(1, m, k, device=dev, dtype=dt)
    g = (1 + 0.2 * torch.randn(k, device=dev)).to(dt)
    w, b = torch.randn(n, k, device=dev, dtype=dt) / k ** 0.5, torch.randn(n, device=dev, dtype=dt)
    wgu, r = torch.randn(2 * n, k, device=dev, dtype=dt) / k ** 0.5, torch.randn(1, m, n, device=dev, dtype=dt)
    wd = torch.randn(k, n, device=dev, dtype=dt) / n ** 0.5

    def close(got, want):  # bf16 outputs within two units of their last place of the torch ops'
        assert got.shape == want.shape and got.dtype == want.dtype
        torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=2 ** -7 * float(want.abs().max()))

    def torch_ops(op, *args):
        return op(*args, 0)  # rows_limit 0: the torch path

    close(torch.ops.dflash.norm_linear(x, g, 1e-6, w, b, 16), torch_ops(torch.ops.dflash.norm_linear, x, g, 1e-6, w, b))
    act, h = torch.ops.dflash.add_norm_glu(x, a, g, 1e-6, wgu, 16)
    want_act, want_h = torch_ops(torch.ops.dflash.add_norm_glu, x, a, g, 1e-6, wgu)
    assert torch.equal(h, want_h)
    close(act, want_act)
    y = torch.randn(1, m, n, device=dev, dtype=dt)
    close(torch.ops.dflash.linear_add(y, wd, x, 16), torch_ops(torch.ops.dflash.linear_add, y, wd, x))
    close(torch.ops.dflash.linear_add(x, w, r, 16), torch_ops(torch.ops.dflash.linear_add, x, w, r))


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and matvec.available()), reason="needs CUDA and Triton")
@pytest.mark.parametrize("q,norms", [(1, True), (16, True), (3, False)])
def test_the_qk_rope_kernel_gives_the_torch_ops_values(q, norms):
    from dflash_ipc.decode import qk_rope
    torch.manual_seed(q)
    dev, dt, b, hq, hkv, d = "cuda:0", torch.bfloat16, 2, 16, 8, 128
    qkv = torch.randn(b, q, (hq + 2 * hkv) * d, device=dev, dtype=dt)
    angles = torch.rand(b, q, d, device=dev) * 6.3  # a rotary table's values: cos and sin of angles
    cos, sin = angles.cos().to(dt), angles.sin().to(dt)
    weights = [(1 + 0.2 * torch.randn(d, device=dev)).to(dt) for _ in range(2)] if norms else [None, None]
    rows, pos = torch.tensor([3, 1], device=dev), torch.arange(q, device=dev)[None].repeat(b, 1) + torch.tensor(
        [[7], [0]], device=dev)
    caches = [[torch.zeros(5, 40, hkv, d, device=where, dtype=dt) for _ in range(2)] for where in ("cpu", dev)]
    want = qk_rope.qk_rope_write(qkv.cpu(), cos.cpu(), sin.cpu(), *[w if w is None else w.cpu() for w in weights],
                                 1e-6, *caches[0], rows.cpu(), pos.cpu(), hq, hkv)  # the torch ops, on CPU
    got = torch.ops.dflash.qk_rope_write(qkv, cos, sin, *weights, 1e-6, *caches[1], rows, pos, hq, hkv)
    # the torch ops' roundings: equal but where CPU and GPU rsqrt (or exp) differ in a last bit, which
    # moves a bf16 rounding by one unit of its last place
    torch.testing.assert_close(got.cpu().float(), want.float(), rtol=2 ** -7, atol=2 ** -6)
    assert (got.cpu() != want).float().mean() < 0.01
    for mine, theirs in zip(caches[1], caches[0]):
        torch.testing.assert_close(mine.cpu().float(), theirs.float(), rtol=2 ** -7, atol=2 ** -6)
    assert torch.equal(caches[1][1].cpu(), caches[0][1])  # v: copied as it is


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and matvec.available()), reason="needs CUDA and Triton")
@pytest.mark.parametrize("rows", [1, 4])
def test_a_bf16_decode_with_fused_layers_matches_it_without(tmp_path, monkeypatch, rows):
    verdicts = decode_verdicts(tmp_path, monkeypatch, FUSE_LAYER_ENV, rows=rows, max_prompt=40, max_new=20,
                               num_requests=6, switched_on=lambda target: target.num_fused_layers > 0)
    assert all(v in ("identical", "near_tie") for v in verdicts), verdicts
    assert verdicts.count("identical") >= len(verdicts) - 2
