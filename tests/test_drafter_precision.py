"""drafter.precision: the config choices, the refusals (no torchao needed), the float8 LM head
against float32 (no torchao needed), and with torchao's emulation on CPU: the conversion,
the unchanged checkpoint and export names, a training step against bf16, one compiled
graph per weight shape. GPU tests run the real float8 kernels."""

import collections
import copy
import sys
import types

import pytest
import torch

from dflash_ipc.bench import drafter as bd
from dflash_ipc.config.load import config_from_dict, load_config
from dflash_ipc.drafter import precision as prec
from dflash_ipc.drafter.model import CudaCompiled, DFlashDraftModel
from dflash_ipc.drafter.objective import _chunk_loss_and_grad_eager, weighted_ce_sum
from dflash_ipc.hf.target_head import FrozenTargetHead
from dflash_ipc.errors import ConfigError

torch.set_num_threads(1)

try:
    prec.torchao_float8()
    HAVE_TORCHAO = True
except ConfigError:
    HAVE_TORCHAO = False
needs_torchao = pytest.mark.skipif(not HAVE_TORCHAO, reason="needs torchao >= 0.18 (pip install 'dflash-ipc[fp8]')")


def _has_fp8_gpu() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability(0) >= prec.MIN_CAPABILITY


# --- config and refusals: no torchao needed ------------------------------------------------------


@pytest.mark.parametrize("override, needle", [
    ("drafter.precision=fp16", "drafter.precision: 'fp16' not allowed; allowed: bf16, fp8"),
    ("drafter.fp8_recipe=blockwise", "drafter.fp8_recipe: 'blockwise' not allowed; allowed: tensorwise, rowwise"),
    ("drafter.fp8_lm_head=logits", "drafter.fp8_lm_head: 'logits' not allowed; allowed: auto, all, grad, none"),
])
def test_precision_choices_are_checked(override, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(")):
        load_config(None, [override])


def test_fp8_needs_bf16_compute_and_bf16_is_the_default():
    cfg = load_config(None, [])
    assert (cfg.drafter.precision, cfg.drafter.fp8_recipe, cfg.drafter.fp8_lm_head) == ("bf16", "tensorwise", "auto")
    # auto: the float8 head under decay weights, the head's own dtype under D-PACE (the default weighting)
    assert [prec.lm_head_matmuls("auto", w) for w in ("decay", "dpace")] == ["all", "none"]
    assert [prec.lm_head_matmuls(h, "dpace") for h in ("all", "grad", "none")] == ["all", "grad", "none"]
    with pytest.raises(ConfigError, match="drafter.precision: fp8 needs drafter.dtype=bfloat16.*got float32"):
        load_config(None, ["drafter.precision=fp8", "drafter.dtype=float32"])
    assert load_config(None, ["drafter.precision=fp8", "drafter.dtype=bfloat16"]).drafter.precision == "fp8"


def test_bf16_leaves_the_model_alone_and_never_imports_torchao(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao", None)  # any import of it would raise
    model = DFlashDraftModel(bd.drafter_model_config("tiny"))
    before = {n: type(m) for n, m in model.named_modules()}
    cfg = config_from_dict({"drafter": {"precision": "bf16"}})
    assert prec.apply_precision(cfg.drafter, model, bd.random_head(model.config, "cpu", None), "cpu") is None
    assert {n: type(m) for n, m in model.named_modules()} == before


def test_fp8_refused_on_cpu_through_the_trainer(monkeypatch):
    monkeypatch.delenv(prec.EMULATE_ENV, raising=False)
    config = bd.drafter_model_config("tiny")
    cfg = config_from_dict({"drafter": {"num_workers": 1, "dtype": "bfloat16", "precision": "fp8"}})
    with pytest.raises(ConfigError, match=r"fp8 needs a CUDA GPU of compute capability >= 8.9.*runs on cpu; "
                                          r"set drafter.precision=bf16"):
        bd.DrafterTrainer(cfg, config, bd.random_head(config, "cpu", None), device="cpu", total_steps=1)


def test_fp8_refused_on_a_gpu_without_float8(monkeypatch):
    monkeypatch.delenv(prec.EMULATE_ENV, raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(ConfigError, match=r"compute capability >= 8.9.*cuda:0 is NVIDIA A100-SXM4-80GB \(8.0\)"):
        prec.require_fp8("cuda:0")


def test_fp8_refused_without_torchao_or_with_an_old_one(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setitem(sys.modules, "torchao", None)
    with pytest.raises(ConfigError, match=r"needs torchao >= 0.18, which does not import here.*"
                                          r"pip install 'dflash-ipc\[fp8\]'"):
        prec.require_fp8("cuda:0")
    old = types.ModuleType("torchao")
    old.__version__, old.float8 = "0.16.0", types.ModuleType("torchao.float8")
    monkeypatch.setitem(sys.modules, "torchao", old)
    monkeypatch.setitem(sys.modules, "torchao.float8", old.float8)
    with pytest.raises(ConfigError, match=r"needs torchao >= 0.18, found 0.16.0; pip install"):
        prec.require_fp8("cuda:0")


# --- the float8 LM head: no torchao needed -------------------------------------------------------


def _head_case(peaked: bool, seed: int = 0, vocab: int = 2048):
    """W [V, H] bf16, h [C, H] bf16, labels, weights: near-uniform or peaked logits."""
    gen = torch.Generator().manual_seed(seed)
    hidden, rows = 256, 48
    weight = (torch.randn(vocab, hidden, generator=gen) * 0.02).bfloat16()
    h = (torch.randn(rows, hidden, generator=gen) * (8.0 if peaked else 1.0)).bfloat16()
    logits = h.float() @ weight.float().t()
    labels = torch.where(torch.rand(rows, generator=gen) < 0.5, logits.argmax(-1),
                         torch.randint(0, vocab, (rows,), generator=gen))
    return weight, h, labels, torch.rand(rows, generator=gen) + 0.1


def _reference(weight, h, labels, weights):
    """float32 loss and dL/dh of the same rows."""
    loss, dlogits = _chunk_loss_and_grad_eager(h.float() @ weight.float().t(), labels, weights)
    return loss, dlogits @ weight.float()


def _rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.parametrize("rowwise", [False, True])
@pytest.mark.parametrize("fp8_logits", [True, False])
def test_fp8_head_matches_float32(rowwise, fp8_logits):
    for peaked in (False, True):
        weight, h, labels, weights = _head_case(peaked)
        head = prec.Fp8LMHead(weight, rowwise=rowwise, fp8_logits=fp8_logits, emulate=True)
        loss, dh = head.loss_and_input_grad(h, labels, weights, with_grad=True)
        ref_loss, ref_dh = _reference(weight, h, labels, weights)
        assert dh.dtype == torch.float32 and dh.shape == h.shape
        # float8 logits round ~2 % of their spread; bf16 logits and float8 gradients alone much less
        assert abs(float(loss / ref_loss) - 1) < (2e-2 if fp8_logits else 1e-3)
        assert _rel(dh, ref_dh) < (0.15 if fp8_logits and peaked else 0.05)
        no_grad_loss, none = head.loss_and_input_grad(h, labels, weights, with_grad=False)
        assert none is None and float(no_grad_loss) == pytest.approx(float(loss), rel=1e-5)


@pytest.mark.parametrize("rowwise", [False, True])
def test_leaving_the_one_hot_out_of_float8_is_what_keeps_the_gradient(rowwise):
    """Quantizing w*(softmax - onehot) whole puts the dominant one-hot term through float8
    rounding (measured 4-6 % error); the split keeps dL/dh within 0.5 %."""
    weight, h, labels, weights = _head_case(peaked=False)
    head = prec.Fp8LMHead(weight, rowwise=rowwise, fp8_logits=False, emulate=True)
    _, dh = head.loss_and_input_grad(h, labels, weights, with_grad=True)
    _, ref_dh = _reference(weight, h, labels, weights)
    _, dlogits = _chunk_loss_and_grad_eager((h @ weight.t()).float(), labels, weights)
    q, inv = prec.quantize(dlogits, head.grad_dtype, rowwise=rowwise)
    whole = prec.scaled_matmul(q, head.wt_q.t(), inv, head.wt_inv.t(), torch.float32, fast_accum=False, emulate=True)
    assert _rel(dh, ref_dh) < 0.005 and _rel(whole, ref_dh) > 0.03


def test_quantize_scales_and_round_trip():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(33, 64, generator=gen) * torch.logspace(-3, 2, 33)[:, None]  # rows of very different size
    for rowwise, dtype, step in ((False, prec.E4M3, 2**-3), (True, prec.E4M3, 2**-3), (False, prec.E5M2, 2**-2)):
        q, inv = prec.quantize(x, dtype, rowwise)
        assert q.dtype == dtype and inv.dtype == torch.float32 and inv.shape == ((33, 1) if rowwise else ())
        back = q.float() * inv
        big = x.abs() > (x.abs().amax(-1, keepdim=True) if rowwise else x.abs().amax()) / 8  # in the normal range
        assert ((back - x).abs() <= step * x.abs())[big].all()  # half an ulp: 2^-4 (e4m3), 2^-3 (e5m2)
        if rowwise:  # power-of-two scales: exact scaling, the row maximum in the top binade
            scale = inv.reciprocal()
            assert torch.equal(scale, torch.exp2(torch.log2(scale).round()))
    q, inv = prec.quantize(torch.zeros(4, 16), prec.E4M3, rowwise=True)
    assert torch.isfinite(inv).all() and not q.float().any()


def test_quantized_probs_are_the_weighted_softmax():
    weight, h, labels, weights = _head_case(peaked=True)
    logits = (h @ weight.t()).float()
    for rowwise, dtype in ((True, prec.E4M3), (False, prec.E5M2)):
        loss, q, inv = prec.loss_and_quantized_probs(logits, labels, weights, dtype, rowwise)
        want = torch.softmax(logits, -1) * weights[:, None]
        got = q.float() * inv
        assert float(loss) == pytest.approx(float(_chunk_loss_and_grad_eager(logits.clone(), labels, weights)[0]))
        top = want >= want.amax(-1, keepdim=True) / 4
        assert ((got - want).abs() <= 2**-2 * want)[top].all()
        fmax = torch.finfo(dtype).max
        if rowwise:  # the scale puts each row's maximum in float8's top binade
            biggest = q.float().abs().amax(-1) / fmax
            assert (biggest > 0.49).all() and (biggest <= 1).all()
        else:  # one scale from the bound of every entry, the largest weight: no tensor-wide reduction first
            assert float(inv) == pytest.approx(float(weights.amax()) / fmax)
            # the tensor's maximum lands where it lies under its bound: scaled by the scale, not clamped
            ratio = float(want.amax()) / float(weights.amax())
            assert float(q.float().abs().amax()) / fmax == pytest.approx(ratio, rel=0.13)


def test_tensorwise_probs_near_underflow_keep_the_gradient():
    """Flat softmaxes (a fresh drafter over a big vocabulary: every entry ~1/V) and small
    weights: the bound's scale leaves them far below the format's top, where a tensor-wide
    amax would have put them, and dL/dh stays as close to exact as with peaked ones."""
    gen = torch.Generator().manual_seed(5)
    vocab, hidden, rows = 4096, 64, 24
    weight = torch.randn(vocab, hidden, generator=gen) / hidden ** 0.5
    h = torch.randn(rows, hidden, generator=gen) * 0.05  # near-uniform logits
    labels = torch.randint(0, vocab, (rows,), generator=gen)
    weights = torch.rand(rows, generator=gen) * 0.3 + 0.01
    head = prec.Fp8LMHead(weight, rowwise=False, fp8_logits=False, emulate=True)
    _, dh = head.loss_and_input_grad(h, labels, weights, with_grad=True)
    probs = torch.softmax(h @ weight.t(), -1) * weights[:, None]
    assert float(probs.amax()) < 0.01 * float(weights.amax())  # far below the bound
    # the float8 part alone (the exact one-hot part would hide its error): (w * softmax) @ W,
    # as close as with the tensor's own amax as the scale (float8's relative rounding, which a
    # flat softmax's cancelling sum amplifies, is the same at either scale: no entry underflows)
    soft = dh + weights[:, None] * weight[labels]
    q, inv = prec.quantize(probs, prec.E5M2, rowwise=False)
    amax_scaled = prec.scaled_matmul(q, head.wt_q.t(), inv, head.wt_inv.t(), torch.float32, fast_accum=False,
                                     emulate=True)
    want = probs @ weight
    assert _rel(soft, want) <= 1.1 * _rel(amax_scaled, want)
    assert _rel(soft, want) < 0.2


@pytest.mark.parametrize("fn,dynamic,extra", [
    (prec.quantize, (0,), (prec.E4M3, True)),
    (prec.loss_and_quantized_probs, (0, 1, 2), (prec.E5M2, False)),
])
def test_head_kernels_trace_as_one_graph_for_every_chunk_size(fn, dynamic, extra):
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = CudaCompiled(fn, dynamic_args=dynamic, backend=counter)
    gen = torch.Generator().manual_seed(0)
    for rows in (5, 17, 40):
        logits = torch.randn(rows, 64, generator=gen).bfloat16()
        args = (logits,) if fn is prec.quantize else (logits, torch.randint(0, 64, (rows,), generator=gen),
                                                      torch.rand(rows, generator=gen))
        for got, want in zip(compiled.compiled(*args, *extra), fn(*args, *extra)):
            torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=0)
    assert counter.frame_count == 1
    torch._dynamo.reset()


def test_head_of_unsupported_shape_stays_in_its_dtype():
    assert prec.Fp8LMHead.create(torch.zeros(100, 64).bfloat16(), rowwise=False) is None  # 100 % 16 != 0
    assert prec.Fp8LMHead.create(torch.zeros(96, 64).bfloat16(), rowwise=False) is not None


def test_weighted_ce_sum_runs_the_fp8_head_in_forward_and_backward():
    weight, h, labels, weights = _head_case(peaked=False)
    head = FrozenTargetHead(weight.clone(), weight)
    fp8 = prec.Fp8LMHead(weight, rowwise=False, emulate=True)
    x = h.clone().requires_grad_(True)
    loss = weighted_ce_sum(x, head, labels, weights, chunk_size=20, fp8_head=fp8)
    loss.backward()
    ref_loss, ref_dh = _reference(weight, h, labels, weights)
    assert float(loss.detach() / ref_loss) == pytest.approx(1, abs=2e-2) and _rel(x.grad, ref_dh) < 0.05
    with torch.no_grad():
        assert float(weighted_ce_sum(x, head, labels, weights, chunk_size=20, fp8_head=fp8)) == pytest.approx(
            float(loss), rel=1e-5)


# --- the linear layers: torchao's emulation on CPU ----------------------------------------------


def _fp8_cfg(weighting: str = "decay", **drafter):
    """Decay weights: the float8 LM head is on (fp8_lm_head auto)."""
    return config_from_dict({"drafter": {"num_workers": 1, "dtype": "bfloat16", "precision": "fp8", **drafter},
                             "objective": {"max_anchors_per_seq": 16, "anchors_per_step": 32, "weighting": weighting}})


@pytest.mark.parametrize("recipe", [pytest.param("tensorwise", marks=needs_torchao),
                                    pytest.param("rowwise", marks=needs_torchao), "delayed"])
def test_conversion_keeps_parameters_checkpoint_and_export(monkeypatch, tmp_path, recipe):
    from safetensors import safe_open

    from dflash_ipc.drafter.inference_format import save_inference_checkpoint

    monkeypatch.setenv(prec.EMULATE_ENV, "1")
    config = bd.drafter_model_config("tiny")
    torch.manual_seed(0)
    plain = DFlashDraftModel(config)
    model = copy.deepcopy(plain)
    params = dict(model.named_parameters())
    fp8_head = prec.apply_precision(_fp8_cfg(fp8_recipe=recipe).drafter, model, bd.random_head(config, "cpu", None),
                                    "cpu")
    assert isinstance(fp8_head, prec.Fp8LMHead) and fp8_head.rowwise == (recipe == "rowwise")
    linears = [n for n, m in plain.named_modules() if isinstance(m, torch.nn.Linear)]
    assert len(linears) == 7 * config.num_hidden_layers + 1
    layer_class = "DelayedFloat8Linear" if recipe == "delayed" else "Float8Linear"  # ours, or torchao's
    assert all(type(model.get_submodule(n)).__name__ == layer_class for n in linears)
    after = dict(model.named_parameters())
    assert after.keys() == params.keys() and all(after[n] is p for n, p in params.items())  # the same objects
    assert {k: v.shape for k, v in model.state_dict().items()} == {k: v.shape for k, v in plain.state_dict().items()}
    for which, m in (("plain", plain), ("fp8", model)):
        save_inference_checkpoint(m, str(tmp_path / which))
    files = [safe_open(str(tmp_path / w / "model.safetensors"), framework="pt") for w in ("plain", "fp8")]
    assert sorted(files[0].keys()) == sorted(files[1].keys())
    for name in files[0].keys():
        assert torch.equal(files[0].get_tensor(name), files[1].get_tensor(name))
    assert (tmp_path / "plain" / "config.json").read_text() == (tmp_path / "fp8" / "config.json").read_text()


def _step_gradients(trainer, seqs) -> tuple[float, dict]:
    """The trainer's own forward and chunked CE (its fp8 head included), one backward."""
    batch, features, mask, _ = trainer._build(trainer.take(collections.deque(seqs)))
    trainer.model.zero_grad()
    loss = trainer.loss_sum(batch, features, mask)  # under the trainer's bf16 autocast
    (loss / batch.weights.sum()).backward()
    return float(loss.detach() / batch.weights.sum()), {n: p.grad.clone() for n, p in trainer.model.named_parameters()}


@needs_torchao
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_step_follows_the_bf16_step(monkeypatch, recipe):
    monkeypatch.setenv(prec.EMULATE_ENV, "1")
    config = bd.drafter_model_config("tiny")
    results = []
    for drafter in ({"precision": "bf16"}, {"precision": "fp8", "fp8_recipe": recipe}):
        gen = torch.Generator().manual_seed(0)
        trainer = bd.DrafterTrainer(_fp8_cfg(**drafter), config, bd.random_head(config, "cpu", gen), device="cpu",
                                    total_steps=2)
        seqs = bd.random_sequences(config, step=0, num_seqs=2, seq_len=64, max_anchors=16, device=torch.device("cpu"),
                                   gen=gen, cpu_gen=torch.Generator().manual_seed(1))
        results.append(_step_gradients(trainer, seqs))
        assert (trainer.fp8_head is None) == (drafter["precision"] == "bf16")
    (loss16, grads16), (loss8, grads8) = results
    assert loss8 == pytest.approx(loss16, rel=5e-3)
    for name, g in grads16.items():
        cos = torch.nn.functional.cosine_similarity(grads8[name].flatten(), g.flatten(), dim=0)
        assert cos > 0.98, name


@needs_torchao
def test_the_memory_probe_runs_the_steps_fp8_lm_head(monkeypatch):
    from dflash_ipc.drafter import fit as drafter_fit

    monkeypatch.setenv(prec.EMULATE_ENV, "1")
    config = bd.drafter_model_config("tiny")
    gen = torch.Generator().manual_seed(0)
    trainer = bd.DrafterTrainer(_fp8_cfg(), config, bd.random_head(config, "cpu", gen), device="cpu", total_steps=2)
    seqs = bd.random_sequences(config, step=0, num_seqs=2, seq_len=64, max_anchors=16, device=torch.device("cpu"),
                               gen=gen, cpu_gen=torch.Generator().manual_seed(1))
    calls, real = [], trainer.fp8_head.loss_and_input_grad
    monkeypatch.setattr(trainer.fp8_head, "loss_and_input_grad",
                        lambda *a, **kw: calls.append(kw["with_grad"]) or real(*a, **kw))
    drafter_fit.forward_backward(trainer, trainer.take(collections.deque(seqs)))
    assert calls and all(calls)  # the loss and dL/dh of training's float8 head, not the bf16 one
    assert all(p.grad is None for p in trainer.model.parameters())

class AlwaysCompiled(CudaCompiled):
    """Compiles on CPU too (the layers' wrappers compile only on CUDA)."""
    __call__ = CudaCompiled.compiled


def _compiled_and_eager_twins():
    """(the tiny drafter with its float8 layers compiled, an eager copy, the compiled layers)."""
    model = DFlashDraftModel(bd.drafter_model_config("tiny"))
    eager = copy.deepcopy(model)
    converted = prec.convert_linears(model, "tensorwise", emulate=True)
    prec.convert_linears(eager, "tensorwise", emulate=True)
    prec.compile_linears(converted)
    return model, eager, converted


def _assert_layers_match_eager(model, eager, row_counts) -> None:
    """Every float8 layer, at each row count: the compiled values and input gradients are eager's."""
    gen = torch.Generator().manual_seed(0)
    for rows in row_counts:
        prec.next_step()  # each row count as a step of its own (the trainer calls it per step)
        for name, layer in [(n, m) for n, m in eager.named_modules() if type(m).__name__ == "Float8Linear"]:
            x = torch.randn(rows, layer.in_features, generator=gen, requires_grad=True)
            x2 = x.detach().clone().requires_grad_(True)
            got, want = model.get_submodule(name)(x), layer(x2)
            assert got.shape == want.shape
            torch.testing.assert_close(got, want)
            got.square().sum().backward()
            want.square().sum().backward()
            torch.testing.assert_close(x.grad, x2.grad)


@needs_torchao
def test_compiled_float8_layers_share_one_graph_per_weight_shape(monkeypatch):
    """The layers' compiled forward (rows dynamic): one graph per distinct weight shape for
    every layer and row count, values and gradients as eager; a deep copy calls its own
    layers. aot_eager: tracing without codegen."""
    from torch._dynamo.testing import CompileCounterWithBackend

    monkeypatch.setenv(prec.EMULATE_ENV, "1")
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    monkeypatch.setattr(prec, "_fused_float8_forward", AlwaysCompiled(prec._float8_forward, dynamic_args=(0,),
                                                                       backend=counter))
    model, eager, converted = _compiled_and_eager_twins()
    _assert_layers_match_eager(model, eager, (24, 40))
    assert counter.frame_count == len({tuple(m.weight.shape) for m in converted})
    twin = copy.deepcopy(model)
    assert twin.fc.forward.module is twin.fc and model.fc.forward.module is model.fc
    torch._dynamo.reset()


def test_a_row_count_gets_static_graphs_once_it_repeats_and_only_so_many():
    rows = prec.StaticRowCounts(limit=2)
    a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    assert rows.padded(a, 32768) is None  # first sight: dynamic (a one-off costs no compile)
    assert rows.padded(b, 32768) is None  # another layer's first sight too
    assert rows.padded(a, 32768) is None and not rows.static  # a repeat promotes it: static from the next step
    rows.next_step()
    assert rows.padded(a, 32768) == 32768 and rows.padded(b, 32500) == 32768  # static, padded (quantum 512)
    assert rows.padded(a, 5000) is None and rows.padded(a, 5000) is None  # promoted in this step
    rows.next_step()
    assert rows.padded(a, 5000) == 5120  # quantum 4096 / 32 = 128
    assert rows.padded(a, 9000) is None and rows.padded(a, 9000) is None  # the limit: dynamic from now on
    rows.next_step()
    assert rows.padded(a, 9000) is None and rows.static == {32768, 5120}
    assert [prec.static_row_quantum(n) for n in (300, 1024, 8192, 32768, 40000)] == [16, 32, 256, 1024, 1024]
    small = prec.StaticRowCounts()
    assert all(small.padded(a, n) is None for n in (0, 0, 16, 16, 1023, 1023)) and not small.static


def test_nothing_is_promoted_inside_a_backward_pass():
    """Gradient checkpointing runs a layer's forward again inside the backward pass: that
    recompute must take the graph the forward took (dynamic, at a count's first sight)."""
    rows, layer = prec.StaticRowCounts(), torch.nn.Linear(2, 2)
    seen_in_backward = []

    class Recompute(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            seen_in_backward.append(rows.padded(layer, 4096))
            return grad * 2

    assert rows.padded(layer, 4096) is None  # the forward: first sight
    Recompute.apply(torch.ones(1, requires_grad=True)).sum().backward()
    assert seen_in_backward == [None] and not rows.static
    # A later call of the same forward promotes the count: the recompute still takes the
    # forward's (dynamic) graph, and the next step the static one.
    assert rows.padded(layer, 4096) is None
    Recompute.apply(torch.ones(1, requires_grad=True)).sum().backward()
    assert seen_in_backward == [None, None] and not rows.static
    rows.next_step()
    assert rows.padded(layer, 4096) == 4096


@needs_torchao
def test_static_row_counts_give_the_values_and_gradients_of_eager(monkeypatch):
    """Where the layers compile (CUDA), a repeating row count runs a graph of its own, padded
    outside it: one graph per weight shape and padded count, values and gradients as eager.
    aot_eager on CPU: tracing without codegen."""
    from torch._dynamo.testing import CompileCounterWithBackend

    monkeypatch.setenv(prec.EMULATE_ENV, "1")
    torch._dynamo.reset()
    static, dynamic = CompileCounterWithBackend("aot_eager"), CompileCounterWithBackend("aot_eager")
    monkeypatch.setattr(prec, "_compiles", lambda x: True)
    monkeypatch.setattr(prec, "STATIC_ROWS", prec.StaticRowCounts(min_rows=1))
    monkeypatch.setattr(prec, "_static_float8_forward", AlwaysCompiled(prec._float8_forward_padded, dynamic_args=(),
                                                                        backend=static, dynamic=False))
    monkeypatch.setattr(prec, "_fused_float8_forward", AlwaysCompiled(prec._float8_forward, dynamic_args=(0,),
                                                                       backend=dynamic))
    model, eager, converted = _compiled_and_eager_twins()
    shapes = {tuple(m.weight.shape) for m in converted}
    _assert_layers_match_eager(model, eager, (40, 40, 44))  # 40 repeats (static at 48 rows), 44 pads to it
    assert prec.STATIC_ROWS.static == {48}
    assert static.frame_count == len(shapes) and dynamic.frame_count == len(shapes)
    assert torch._dynamo.config.recompile_limit >= prec.RECOMPILE_LIMIT
    torch._dynamo.reset()


@needs_torchao
def test_float8_layers_see_rows_in_multiples_of_16(monkeypatch):
    """torch._scaled_mm refuses a weight-gradient GEMM over a row count that is not a multiple
    of 16 (a step's token count is anything): the layers pad with zero rows, and the values and
    gradients are those of the unpadded layer."""
    monkeypatch.setenv(prec.EMULATE_ENV, "1")
    model = DFlashDraftModel(bd.drafter_model_config("tiny"))
    reference = copy.deepcopy(model)
    prec.convert_linears(reference, "tensorwise", emulate=True)
    prec.compile_linears(prec.convert_linears(model, "tensorwise", emulate=True))
    layer, plain = model.fc, reference.fc
    x = torch.randn(2, 13, layer.in_features, generator=torch.Generator().manual_seed(0), requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    want = plain(x2)
    want.square().sum().backward()
    seen = []
    forward = type(layer).forward
    monkeypatch.setattr(type(layer), "forward", lambda self, inp: seen.append(inp.shape) or forward(self, inp))
    got = layer(x)
    got.square().sum().backward()
    assert seen == [torch.Size([32, layer.in_features])]  # 26 rows -> 32
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(x.grad, x2.grad)
    torch.testing.assert_close(layer.weight.grad, plain.weight.grad)


def _shared_and_separate(recipe: str):
    """(the tiny drafter with shared-input float8 groups, the same drafter layer by layer)."""
    model = DFlashDraftModel(bd.drafter_model_config("tiny"))
    separate = copy.deepcopy(model)
    for m in (model, separate):
        prec.convert_linears(m, recipe, emulate=True)
    assert prec.share_input_casts(model, in_graph=False) == 2 * model.config.num_hidden_layers
    return model, separate


def _project_all(model, x, ctx):
    """Every shared-input group of the first layer on (x, ctx) under bf16 autocast."""
    attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return (attn.project(x, (attn.q_proj, attn.k_proj, attn.v_proj)) + attn.project(ctx, (attn.k_proj, attn.v_proj))
                + mlp.project(x, (mlp.gate_proj, mlp.up_proj)))


def _run_blocks(model, x, ctx):
    """`_project_all`, then one backward."""
    layer, outs = model.layers[0], _project_all(model, x, ctx)
    gen = torch.Generator().manual_seed(7)
    torch.autograd.backward(outs, [torch.randn(o.shape, generator=gen).to(o.dtype) for o in outs])
    return outs, {n: p.grad for n, p in layer.named_parameters() if p.grad is not None}


@needs_torchao
@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
def test_layers_that_share_an_input_cast_it_once_with_the_numbers_of_separate_layers(monkeypatch, recipe):
    """One float8 matmul over q|k|v (and k|v, gate|up): rowwise, the outputs and weight gradients
    are the separate layers' bit for bit (per-row scales do not see the concatenation) and the
    input gradient differs by the rounding of a sum; tensorwise one scale spans the group, so
    they are close. The input is cast once per group: 3 input casts where 7 were."""
    monkeypatch.setenv(prec.EMULATE_ENV, "1")
    model, separate = _shared_and_separate(recipe)
    gen = torch.Generator().manual_seed(0)
    hidden = model.config.hidden_size
    x, ctx = torch.randn(40, hidden, generator=gen), torch.randn(24, hidden, generator=gen)
    runs = []
    for m in (model, separate):
        xi, ci = x.clone().requires_grad_(True), ctx.clone().requires_grad_(True)
        outs, grads = _run_blocks(m, xi, ci)
        runs.append((outs, grads, xi.grad, ci.grad))
    (outs, grads, dx, dctx), (want_outs, want_grads, want_dx, want_dctx) = runs
    assert [o.shape for o in outs] == [o.shape for o in want_outs] and grads.keys() == want_grads.keys()
    if recipe == "rowwise":
        assert all(torch.equal(o, w) for o, w in zip(outs, want_outs))
        assert all(torch.equal(grads[n], want_grads[n]) for n in grads)
        torch.testing.assert_close(dx, want_dx, rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(dctx, want_dctx, rtol=2e-2, atol=2e-2)
    else:
        for o, w in zip(outs, want_outs):
            assert ((o.float() - w.float()).norm() / w.float().norm()) < 0.08
        for n in grads:
            assert torch.nn.functional.cosine_similarity(grads[n].flatten(), want_grads[n].flatten(), dim=0) > 0.99, n
    casts = collections.Counter()
    real = prec.torchao_float8().float8_linear.hp_tensor_to_float8_dynamic

    def counting(t, *a, **kw):
        casts[tuple(t.shape)] += 1
        return real(t, *a, **kw)
    monkeypatch.setattr(prec.torchao_float8().float8_linear, "hp_tensor_to_float8_dynamic", counting)
    for m, want in ((model, 3), (separate, 7)):
        casts.clear()
        with torch.no_grad():
            _project_all(m, x, ctx)
        assert sum(casts[(rows, hidden)] for rows in (24, 32, 40, 48)) == want  # the inputs, padded or not


@needs_torchao
def test_shared_casts_are_a_setting_and_each_group_compiles_once_for_every_row_count(monkeypatch):
    """fp8_shared_casts false keeps one layer at a time; the groups' compiled forward (rows
    dynamic) is one graph per group shape, with eager's values and gradients."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from dflash_ipc.drafter.model import each_linear
    monkeypatch.setenv(prec.EMULATE_ENV, "1")
    config = bd.drafter_model_config("tiny")
    for shared in (True, False):
        model = DFlashDraftModel(config)
        prec.apply_precision(_fp8_cfg(fp8_shared_casts=shared).drafter, model, bd.random_head(config, "cpu", None),
                             "cpu")
        hooks = {type(m.project).__name__ for m in model.modules() if hasattr(m, "project")}
        assert hooks == ({"SharedInputFloat8"} if shared else {"function"})
        assert shared or all(m.project is each_linear for m in model.modules() if hasattr(m, "project"))
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    monkeypatch.setattr(prec, "_fused_shared_input", AlwaysCompiled(prec._shared_input_forward, dynamic_args=(0,),
                                                                     backend=counter))
    model, separate = _shared_and_separate("tensorwise")
    eager = copy.deepcopy(model)
    monkeypatch.setattr(prec, "_compiles", lambda x: True)  # the compiled path (CUDA's) on CPU
    gen = torch.Generator().manual_seed(1)
    for rows in (24, 40):
        prec.next_step()
        x = torch.randn(rows, config.hidden_size, generator=gen)
        ctx = torch.randn(rows + 5, config.hidden_size, generator=gen)
        got, got_grads = _run_blocks(model, x, ctx)
        monkeypatch.setattr(prec, "_compiles", lambda x: False)
        want, want_grads = _run_blocks(eager, x, ctx)
        monkeypatch.setattr(prec, "_compiles", lambda x: True)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w)
        for n in want_grads:
            torch.testing.assert_close(got_grads[n], want_grads[n])
        for m in (model, eager):
            m.zero_grad(set_to_none=True)
    assert counter.frame_count == 3  # q|k|v, k|v and gate|up: one graph each for every row count
    torch._dynamo.reset()


# --- the real float8 kernels -------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not _has_fp8_gpu(), reason="needs a CUDA GPU of compute capability >= 8.9")
@pytest.mark.parametrize("rowwise", [False, True])
def test_scaled_mm_head_equals_its_emulation_on_gpu(rowwise):
    weight, h, labels, weights = (t.cuda() for t in _head_case(peaked=False))
    real = prec.Fp8LMHead(weight, rowwise=rowwise).loss_and_input_grad(h, labels, weights, with_grad=True)
    emulated = prec.Fp8LMHead(weight, rowwise=rowwise, emulate=True).loss_and_input_grad(h, labels, weights,
                                                                                         with_grad=True)
    assert float(real[0]) == pytest.approx(float(emulated[0]), rel=2e-3)
    assert _rel(real[1], emulated[1]) < 2e-2


@pytest.mark.gpu
@pytest.mark.skipif(not (_has_fp8_gpu() and HAVE_TORCHAO), reason="needs torchao and a GPU of capability >= 8.9")
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_training_steps_on_gpu_follow_bf16(recipe):
    """Real float8 kernels, compiled: a few steps of the bench's tiny drafter in fp8 track bf16."""
    losses = {}
    for variant in ({"precision": "bf16"}, {"precision": "fp8", "fp8_recipe": recipe}):
        f = bd.run_drafter_bench("cuda:0", steps=3, shape="tiny", anchors_per_seq=16, num_seqs=2, seq_len=128,
                                 warmup=1, variant=variant)
        losses[variant["precision"]] = f["loss_last"]
    assert losses["fp8"] == pytest.approx(losses["bf16"], rel=2e-2)


@needs_torchao
def test_fp8_under_dpace_keeps_the_lm_head_in_its_own_dtype(monkeypatch):
    """fp8_lm_head auto with D-PACE (the default weighting): float8 layers, no float8 LM head."""
    monkeypatch.setenv(prec.EMULATE_ENV, "1")
    config = bd.drafter_model_config("tiny")
    head = bd.random_head(config, "cpu", torch.Generator().manual_seed(0))
    assert bd.DrafterTrainer(_fp8_cfg(weighting="dpace"), config, head, device="cpu", total_steps=2).fp8_head is None
    assert bd.DrafterTrainer(_fp8_cfg(weighting="decay"), config, head, device="cpu", total_steps=2).fp8_head is not None


def test_fp8_layers_off_needs_a_float8_head_and_no_shared_casts():
    base = ["drafter.precision=fp8", "drafter.dtype=bfloat16", "drafter.fp8_layers=false"]
    assert load_config(None, base + ["objective.weighting=decay"]).drafter.fp8_layers is False
    with pytest.raises(ConfigError, match="drafter.fp8_layers.*nothing in float8"):
        load_config(None, base + ["drafter.fp8_lm_head=none"])
    with pytest.raises(ConfigError, match="drafter.fp8_layers.*dpace"):  # auto is none under D-PACE
        load_config(None, base + ["objective.weighting=dpace"])
    with pytest.raises(ConfigError, match="drafter.fp8_shared_casts.*fp8_layers true"):
        load_config(None, base + ["objective.weighting=decay", "drafter.fp8_shared_casts=true"])
    # fp8 settings mean nothing under bf16: no combination of them is refused there
    bf16 = load_config(None, ["drafter.fp8_layers=false", "drafter.fp8_lm_head=none", "drafter.fp8_shared_casts=true"])
    assert bf16.drafter.precision == "bf16"


@needs_torchao
def test_fp8_for_a_drafter_below_the_measured_crossover_warns(monkeypatch, caplog):
    monkeypatch.setenv(prec.EMULATE_ENV, "1")
    config = bd.drafter_model_config("tiny")  # hidden 64
    head = bd.random_head(config, "cpu", torch.Generator().manual_seed(0))
    with caplog.at_level("WARNING", logger=prec.__name__):
        prec.apply_precision(_fp8_cfg().drafter, DFlashDraftModel(config), head, "cpu")
    assert any("hidden size is 64" in r.getMessage() and "bench drafter --precision bf16,fp8" in r.getMessage()
               for r in caplog.records if r.levelname == "WARNING")
    caplog.clear()
    monkeypatch.setattr(prec, "FP8_FASTER_FROM_HIDDEN", 64)
    with caplog.at_level("WARNING", logger=prec.__name__):
        prec.apply_precision(_fp8_cfg().drafter, DFlashDraftModel(config), head, "cpu")
    assert not [r for r in caplog.records if r.levelname == "WARNING"]


@needs_torchao
def test_fp8_layers_off_keeps_every_layer_bf16_and_the_head_in_float8(monkeypatch):
    """Small drafters: the layers' float8 casts cost more than they save, the head is most of
    the FLOPs (docs/benchmarks.md): only the LM head's matmuls in float8."""
    monkeypatch.setenv(prec.EMULATE_ENV, "1")
    config = bd.drafter_model_config("tiny")
    head = bd.random_head(config, "cpu", torch.Generator().manual_seed(0))
    trainer = bd.DrafterTrainer(_fp8_cfg(fp8_layers=False), config, head, device="cpu", total_steps=2)
    assert trainer.fp8_head is not None
    linears = [m for m in trainer.model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(type(m) is torch.nn.Linear for m in linears)  # none became a Float8Linear
    both = bd.DrafterTrainer(_fp8_cfg(), config, head, device="cpu", total_steps=2)
    assert any(type(m) is not torch.nn.Linear for m in both.model.modules() if isinstance(m, torch.nn.Linear))
    variants = bd.precision_variants(["fp8"], lm_heads=["all", "none"], layers=["on", "off"],
                                     shared_casts=["off", "on"])
    # layers off needs a float8 head and no shared casts: those pairs are not run
    assert [(v["fp8_lm_head"], v.get("fp8_layers", True), v.get("fp8_shared_casts", False)) for v in variants] == [
        ("all", True, False), ("all", False, False), ("all", True, True), ("none", True, False), ("none", True, True)]
    assert bd.variant_label(variants[1]) == "fp8 tensorwise, lm_head all, layers bf16"
