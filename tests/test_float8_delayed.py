"""drafter.fp8_recipe delayed (drafter/float8_delayed.py, drafter/float8_cast.py).

On CPU, in emulation (float8-rounded operands, float32 matmuls): the one-pass cast against its
definition, the abs-max histories (the first step's own abs-max, then the last steps' maximum
with its margin, fixed within a step; an all-zero step; the memory probe; an optimizer step),
the layer's values and gradients against float32 and against torchao's tensorwise layer where
it is installed, shared casts, a gradient-checkpointing recompute, a trainer step's loss and
gradients against bf16 (the conversion's parameters, checkpoint and export:
tests/test_drafter_precision.py), the config's refusals; where Triton is installed, the cast
kernel in its interpreter. On a GPU (marked gpu): the kernel bit for bit against the torch ops,
the real float8 GEMMs against their emulation, training steps against bf16."""

import collections
import copy
import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from dflash_ipc.bench import drafter as bd
from dflash_ipc.config.load import config_from_dict
from dflash_ipc.drafter import float8_cast, float8_delayed as fd, precision as prec
from dflash_ipc.drafter.model import DFlashDraftModel
from dflash_ipc.errors import ConfigError

torch.set_num_threads(1)
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _rel(a, b) -> float:
    return float((a.detach().float() - b.detach().float()).norm() / b.detach().float().norm())


def _bits(t):
    return t.view(torch.uint8)


# --- the one-pass cast ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_cast_scales_saturates_transposes_and_keeps_the_running_amax(dtype):
    x = torch.randn(40, 32, dtype=torch.bfloat16) * 3
    x[5, 7] = -8192.0  # past the scale's range: saturates, as a late spike does
    scale, amax = torch.tensor(10.0), torch.tensor([20000.0])
    q, qt = float8_cast.cast_to_float8(x, scale, amax, dtype, transpose=True)
    fmax = torch.finfo(dtype).max
    assert q.dtype == dtype and q.shape == (40, 32) and qt.shape == (32, 40) and qt.is_contiguous()
    assert torch.equal(_bits(qt), _bits(q.t().contiguous()))
    assert torch.equal(_bits(q), _bits((x.float() * 10).clamp(-fmax, fmax).to(dtype)))
    assert float(q[5, 7].float()) == -fmax
    assert float(amax) == 20000.0  # a running maximum: the larger one stays
    amax.zero_()
    assert float8_cast.cast_to_float8(x, scale, amax, dtype, transpose=False)[1] is None
    assert float(amax) == 8192.0


def test_cast_refuses_what_it_does_not_take():
    with pytest.raises(ValueError, match="takes 2-D"):
        float8_cast.cast_to_float8(torch.zeros(2, 3, 4), torch.tensor(1.0), torch.zeros(1), E4M3, transpose=False)
    with pytest.raises(ValueError, match="takes 2-D"):
        float8_cast.cast_to_float8(torch.zeros(2, 3), torch.tensor(1.0), torch.zeros(1), torch.bfloat16,
                                   transpose=False)


INTERPRETED = textwrap.dedent("""
    import torch
    from dflash_ipc.drafter import float8_cast
    # Triton 3.6's interpreter rounds some float8 conversions across a binade (7.97 -> 4.0 in e4m3),
    # so here every scaled value is one the format holds exactly: what this checks is the tiling,
    # the masks, both layouts, the clamp and the abs-max; the rounding is checked on a GPU.
    torch.manual_seed(0)
    for dtype, src, (n, k) in ((torch.float8_e4m3fn, torch.bfloat16, (70, 96)),
                               (torch.float8_e5m2, torch.float32, (33, 200))):
        exact = torch.randint(-8, 9, (n, k)).float() / 4  # quarters up to 2: exact in both formats
        x = (exact / 8).to(src)
        x[n - 1, k - 1] = 4096.0  # saturates
        amax = torch.zeros(1)
        q, qt = float8_cast._cast_kernel_launch(x, torch.tensor(8.0), amax, dtype, True)
        want, want_t = float8_cast.cast_reference(x, torch.tensor(8.0), torch.zeros(1), dtype, transpose=True)
        print(torch.equal(q.view(torch.uint8), want.view(torch.uint8)),
              torch.equal(qt.view(torch.uint8), want_t.view(torch.uint8)), float(amax) == 4096.0)
    # float32 (a weight) through cast_to_float8: one launch writes both layouts (the transposed one
    # from a second load), and its first use checks them against each other
    launched, launch = [], float8_cast._cast_kernel_launch
    float8_cast._cast_kernel_launch = lambda x, *a: launched.append((x.dtype, a[-1])) or launch(x, *a)
    w = (torch.randint(-8, 9, (32, 48)).float() / 32)
    q, qt = float8_cast.cast_to_float8(w, torch.tensor(8.0), torch.zeros(1), torch.float8_e4m3fn, transpose=True)
    print(launched == [(torch.float32, True)] and qt.is_contiguous()
          and torch.equal(qt.view(torch.uint8), q.t().contiguous().view(torch.uint8))
          and float8_cast._kernel_transposes_right == {(w.device, torch.float32, torch.float8_e4m3fn, 48): True})
""")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton (its interpreter)")
def test_the_cast_kernel_in_tritons_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(sys.path))
    done = subprocess.run([sys.executable, "-c", INTERPRETED], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["True"] * 7


def test_a_kernel_whose_transposes_are_wrong_is_caught_at_first_use(monkeypatch, caplog):
    """A compiler that gets the transposed layout wrong (as one did from float32 on an H100):
    the first transposed cast of each (device, source, format, K) is checked, and where one
    failed every transpose of it is torch's."""
    launched = []

    def kernel(x, scale, amax, dtype, transpose):  # right row-major output; a transpose that is not one
        launched.append(transpose)
        q, _ = float8_cast.cast_reference(x, scale, amax, dtype, transpose=False)
        return q, (q.reshape(q.shape[1], q.shape[0]).clone() if transpose else None)

    monkeypatch.setattr(float8_cast, "kernel_takes", lambda x: True)
    monkeypatch.setattr(float8_cast, "_cast_kernel_launch", kernel)
    monkeypatch.setattr(float8_cast, "_kernel_transposes_right", {})
    w = torch.randn(48, 32)
    with caplog.at_level("WARNING", logger=float8_cast.__name__):
        for _ in range(2):
            q, qt = float8_cast.cast_to_float8(w, torch.tensor(4.0), torch.zeros(1), E4M3, transpose=True)
            assert torch.equal(_bits(qt), _bits(q.t().contiguous()))
    assert launched == [True, False]  # checked once; after that the kernel writes the row-major copy only
    assert len(caplog.records) == 1  # one warning, at the check
    assert "differs from its row-major output transposed" in caplog.records[0].getMessage()
    assert float8_cast._kernel_transposes_right == {(w.device, torch.float32, E4M3, 32): False}
    x = torch.randn(32, 48, dtype=torch.bfloat16)  # another source (or K) is checked on its own
    float8_cast.cast_to_float8(x, torch.tensor(4.0), torch.zeros(1), E4M3, transpose=True)
    assert launched == [True, False, True] and len(float8_cast._kernel_transposes_right) == 2


# --- the histories ----------------------------------------------------------------------------


def test_first_step_scales_by_the_tensors_own_amax_then_by_the_last_steps():
    history = fd.AmaxHistory(2, length=3)
    fmax = torch.finfo(E4M3).max
    amaxes = [2.0, 8.0, 1.0, 0.5, 0.25]
    for step, a in enumerate(amaxes):
        fd.next_step()
        x = torch.full((16, 16), a / 2)
        x[0, 0] = a
        _, _, inv = history.cast(0, fd.INPUT, x, transpose=False)
        seen = amaxes[max(0, step - 3): step] or [a]  # the three steps before this one; step 0: its own
        assert float(inv) == pytest.approx(max(seen) * (fd.AMAX_MARGIN if step else 1) / fmax)
        if step:  # from the second step on, fixed within a step (the first scales each cast by its own)
            assert float(history.cast(0, fd.INPUT, x / 4, transpose=False)[2]) == float(inv)
    assert history.ready == [[True, False], [False, False]]  # layer 1 never cast: no history to scale by
    del history


def test_a_layer_called_twice_in_a_step_keeps_the_larger_amax():
    history = fd.AmaxHistory(1)
    fd.next_step()
    history.cast(0, fd.GRAD, torch.full((16, 16), 3.0), transpose=False)  # the context rows
    history.cast(0, fd.GRAD, torch.full((16, 16), 5.0), transpose=True)  # the block rows
    fd.next_step()
    inv = history.cast(0, fd.GRAD, torch.ones(16, 16), transpose=False)[2]
    assert float(inv) == pytest.approx(5.0 * fd.AMAX_MARGIN / torch.finfo(E5M2).max)


def test_the_weight_is_cast_once_a_step_and_again_after_an_update():
    history = fd.AmaxHistory(1)
    weight = nn.Parameter(torch.randn(32, 16))
    fd.next_step()
    first = history.weight(0, weight)
    assert history.weight(0, weight)[0] is first[0]  # a recompute, the backward: the same cast
    with torch.no_grad():
        weight.mul_(2)  # an optimizer step in place
    second = history.weight(0, weight)
    assert second[0] is not first[0] and float(second[2]) == pytest.approx(2 * float(first[2]))
    assert torch.equal(_bits(second[1]), _bits(second[0].t().contiguous()))
    fd.next_step()
    assert history.weight(0, weight)[0] is not second[0]  # a new step casts again


# --- the layer ---------------------------------------------------------------------------------


def _mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 48, bias=False))


def _grads(model, x):
    x = x.clone().requires_grad_()
    with torch.autocast(x.device.type, dtype=torch.bfloat16):  # on CUDA too: bf16 activations, as in training
        y = model(x)
    y.float().square().mean().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return y, x.grad, grads


def test_the_layer_follows_float32_as_closely_as_tensorwise_does():
    plain = _mlp()
    model = copy.deepcopy(plain)
    converted, left = fd.convert_linears(model, emulate=True)
    assert len(converted) == 2 and left == []
    others = []
    if importlib.util.find_spec("torchao") is not None:
        try:
            tensorwise = copy.deepcopy(plain)
            prec.convert_linears(tensorwise, "tensorwise", emulate=True)
            others.append(tensorwise)
        except ConfigError:
            pass
    for step in range(3):  # the first step on its own abs-max, then on the histories
        fd.next_step()
        x = torch.randn(3, 13, 64)  # 39 rows: padded to 48 inside
        y32 = plain(x.clone().requires_grad_())
        y, gx, gw = _grads(model, x)
        xr = x.clone().requires_grad_()
        plain(xr).square().mean().backward()
        ref = [xr.grad] + [p.grad.clone() for p in plain.parameters()]
        plain.zero_grad(set_to_none=True)
        assert y.dtype == torch.bfloat16 and y.shape == (3, 13, 48)
        errors = [_rel(y, y32), _rel(gx, ref[0])] + [_rel(g, r) for g, r in zip(gw, ref[1:])]
        assert max(errors) < 0.2, errors  # e4m3 inputs and weights, e5m2 gradients
        for other in others:  # torchao's tensorwise on the same numbers: the same error, give or take
            yo, gxo, gwo = _grads(other, x)
            theirs = [_rel(yo, y32), _rel(gxo, ref[0])] + [_rel(g, r) for g, r in zip(gwo, ref[1:])]
            assert all(mine < 1.5 * t + 0.01 for mine, t in zip(errors, theirs)), (errors, theirs)
        with torch.no_grad():  # an update in place, as an optimizer's: the casts follow it
            for p in [p for m in (plain, model, *others) for p in m.parameters()]:
                p.mul_(0.97)
    assert all(layer.history is converted[0].history for layer in converted)


@pytest.mark.parametrize("steps", [1, 2])  # the first step's own abs-max, then the histories
def test_a_checkpoint_recompute_casts_as_the_forward_did(steps):
    model = _mlp()
    fd.convert_linears(model, emulate=True)
    x = torch.randn(32, 64)
    for _ in range(steps):
        fd.next_step()
        _, gx, gw = _grads(model, x)
    xr = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = checkpoint(model, xr, use_reentrant=False)
    y.float().square().mean().backward()
    assert torch.equal(xr.grad, gx)
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), gw))


class _ThreeReaders(nn.Module):
    """q/k/v of one input, as an attention block's ``project``; ``share``: the same tensor to each."""

    def __init__(self, share: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.q, self.k, self.v = nn.Linear(64, 96, bias=False), nn.Linear(64, 32, bias=False), nn.Linear(64, 32)
        self.share = share

    def forward(self, x):
        return [layer(x if self.share else x.clone()) for layer in (self.q, self.k, self.v)]


def test_layers_that_read_one_tensor_cast_it_once_with_the_numbers_of_separate_casts(monkeypatch):
    casts = []
    monkeypatch.setattr(fd, "cast_to_float8", lambda x, *a, **k: casts.append(x.shape) or float8_cast.cast_to_float8(
        x, *a, **k))
    results = {}
    for share in (True, False):
        model = _ThreeReaders(share)
        history = fd.convert_linears(model, emulate=True)[0][0].history
        outs = []
        for step in range(3):
            fd.next_step()
            casts.clear()
            x = torch.randn(40, 64, generator=torch.Generator().manual_seed(step)) * (1 + step)
            x.requires_grad_()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                ys = model(x.to(torch.bfloat16))
            sum(y.float().square().mean() for y in ys).backward()
            outs.append([*ys, x.grad, *[p.grad.clone() for p in model.parameters()]])
            model.zero_grad(set_to_none=True)
            inputs = [c for c in casts if c == (48, 64)]  # 40 rows padded to 48; the rest: weights, gradients
            assert len(inputs) == (1 if share else 3)
        results[share] = (outs, history.history.clone())
    for shared, separate in zip(results[True][0], results[False][0]):
        assert all(torch.equal(a, b) for a, b in zip(shared, separate))  # every scale and history the same
    assert torch.equal(results[True][1], results[False][1])


def test_a_tensor_changed_in_place_is_cast_again():
    model = nn.Sequential(nn.Linear(64, 32, bias=False))
    fd.convert_linears(model, emulate=True)
    history = model[0].history
    fd.next_step()
    x = torch.ones(16, 64)
    first = history.input_cast(0, x, x, transpose=False)
    assert history.input_cast(0, x, x, transpose=False)[0] is first[0]
    assert history.input_cast(0, x, x, transpose=True)[0] is not first[0]  # now with the transpose a backward needs
    x.mul_(2)
    again = history.input_cast(0, x, x, transpose=False)
    assert again[0] is not first[0] and float(again[0].float().max()) == float(first[0].float().max())


def test_no_grad_forward_keeps_no_transposed_input():
    model = _mlp()
    fd.convert_linears(model, emulate=True)
    fd.next_step()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        y = model(torch.randn(16, 64))
    assert y.shape == (16, 48) and y.grad_fn is None


# --- in the trainer ----------------------------------------------------------------------------


def _fp8_cfg(**drafter):
    return config_from_dict({"drafter": {"num_workers": 1, "dtype": "bfloat16", "precision": "fp8", **drafter},
                             "objective": {"max_anchors_per_seq": 16, "anchors_per_step": 32, "weighting": "decay"}})


def test_a_delayed_step_follows_the_bf16_step(monkeypatch):
    """A first step (no history yet), then the trainer's own forward and backward on the
    histories it left: loss and every parameter's gradient near bf16's."""
    monkeypatch.setenv(prec.EMULATE_ENV, "1")
    config = bd.drafter_model_config("tiny")
    results = []
    for drafter in ({"precision": "bf16"}, {"precision": "fp8", "fp8_recipe": "delayed"}):
        gen = torch.Generator().manual_seed(0)
        trainer = bd.DrafterTrainer(_fp8_cfg(**drafter), config, bd.random_head(config, "cpu", gen), device="cpu",
                                    total_steps=4)
        first = bd.random_sequences(config, step=0, num_seqs=2, seq_len=64, max_anchors=16,
                                    device=torch.device("cpu"), gen=gen, cpu_gen=torch.Generator().manual_seed(1))
        loss0 = trainer.step(trainer.take(collections.deque(first)))["loss"]
        prec.next_step()  # the first step's abs-maxes become the scales
        second = bd.random_sequences(config, step=1, num_seqs=2, seq_len=64, max_anchors=16,
                                     device=torch.device("cpu"), gen=gen, cpu_gen=torch.Generator().manual_seed(2))
        batch, features, mask, _ = trainer._build(trainer.take(collections.deque(second)))
        trainer.model.zero_grad()
        loss = trainer.loss_sum(batch, features, mask) / batch.weights.sum()
        loss.backward()
        results.append((loss0, float(loss.detach()), {n: p.grad.clone() for n, p in trainer.model.named_parameters()}))
        if drafter["precision"] == "fp8":
            assert all(all(r) for r in trainer.model.fc.history.ready)  # the second pass ran on histories
    (loss0_16, loss16, grads16), (loss0_8, loss8, grads8) = results
    assert loss0_8 == pytest.approx(loss0_16, rel=1e-2) and loss8 == pytest.approx(loss16, rel=1e-2)
    for name, g in grads16.items():
        cos = torch.nn.functional.cosine_similarity(grads8[name].flatten(), g.flatten(), dim=0)
        assert cos > 0.98, name


def test_the_memory_probe_sets_no_scale(monkeypatch):
    """drafter/fit.py's forward and backward before the first step: its made-up inputs must not
    become the first step's scales (a real input of larger range would saturate)."""
    from dflash_ipc.drafter import fit

    monkeypatch.setenv(prec.EMULATE_ENV, "1")
    config = bd.drafter_model_config("tiny")
    gen = torch.Generator().manual_seed(0)
    trainer = bd.DrafterTrainer(_fp8_cfg(fp8_recipe="delayed"), config, bd.random_head(config, "cpu", gen),
                                device="cpu", total_steps=4)
    seqs = bd.random_sequences(config, step=0, num_seqs=2, seq_len=64, max_anchors=16, device=torch.device("cpu"),
                               gen=gen, cpu_gen=torch.Generator().manual_seed(1))
    fit.forward_backward(trainer, trainer.take(collections.deque(seqs)))
    history = trainer.model.fc.history
    assert float(history.pending.abs().max()) == 0.0
    prec.next_step()
    assert not any(any(r) for r in history.ready)  # the first real step scales by its own abs-max


def test_any_optimizer_step_drops_the_weights_casts():
    """A fused optimizer writes the weights without bumping their version: the step itself
    must drop the casts (the trainer's roll would too, but not every caller rolls)."""
    model = nn.Sequential(nn.Linear(64, 32, bias=False))
    fd.convert_linears(model, emulate=True)
    history, weight = model[0].history, model[0].weight

    class DataWrites(torch.optim.Optimizer):  # as a fused kernel: no version bump
        def __init__(self, params):
            super().__init__(params, {})

        def step(self):
            for group in self.param_groups:
                for p in group["params"]:
                    p.data.mul_(2)

    optimizer = DataWrites(model.parameters())
    fd.next_step()
    first = history.weight(0, weight)
    version = weight._version
    optimizer.step()
    assert weight._version == version  # the case the hook is for
    second = history.weight(0, weight)
    assert float(second[2]) == pytest.approx(2 * float(first[2]))


def test_an_all_zero_step_keeps_the_scale():
    history = fd.AmaxHistory(1, length=1)
    fd.next_step()
    history.cast(0, fd.GRAD, torch.full((16, 16), 2.0), transpose=False)
    fd.next_step()
    scale = float(history.cast(0, fd.GRAD, torch.zeros(16, 16), transpose=False)[2])
    fd.next_step()  # the history now holds only the zero step
    assert float(history.cast(0, fd.GRAD, torch.ones(16, 16), transpose=False)[2]) == scale
    assert scale == pytest.approx(2.0 * fd.AMAX_MARGIN / torch.finfo(E5M2).max)


def test_inference_mode_and_a_deep_copy():
    model = _mlp()
    fd.convert_linears(model, emulate=True)
    fd.next_step()
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert model(torch.randn(16, 64)).shape == (16, 48)  # no version counter there: nothing cached
    _grads(model, torch.randn(16, 64))
    twin = copy.deepcopy(model)
    ours, theirs = model[0].history, twin[0].history
    assert theirs is not ours and twin[2].history is theirs  # one history per model, shared by its layers
    fd.next_step()  # both roll
    assert theirs.ready == ours.ready and torch.equal(theirs.scales, ours.scales) and all(theirs.ready[0])
    assert torch.equal(theirs.inverses, ours.inverses)


@pytest.mark.parametrize("override, needle", [
    ({"compile": "reduce-overhead"}, "needs drafter.compile off"),
    ({"sharding": "fsdp", "num_workers": 2, "devices": ["cuda:0", "cuda:1"]}, "needs drafter.sharding none"),
    ({"fp8_shared_casts": True}, "needs drafter.fp8_recipe tensorwise or rowwise"),
])
def test_delayed_refuses_what_it_does_not_run_under(override, needle):
    with pytest.raises(ConfigError, match=needle):
        _fp8_cfg(fp8_recipe="delayed", **override)


def test_delayed_needs_no_torchao(monkeypatch):
    """Its layers are ours: a GPU without torchao still trains in fp8 delayed."""
    monkeypatch.setenv(prec.EMULATE_ENV, "1")
    monkeypatch.setitem(sys.modules, "torchao", None)  # import fails
    prec.require_fp8("cpu", torchao=False)
    with pytest.raises(ConfigError, match="torchao"):
        prec.require_fp8("cpu")


# --- on a GPU ----------------------------------------------------------------------------------


def _has_fp8_gpu() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability(0) >= prec.MIN_CAPABILITY


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and float8_cast.triton is not None), reason="needs CUDA and Triton")
@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("shape, src, column_major", [((4096, 1024), torch.bfloat16, False),
                                                      ((1000, 208), torch.bfloat16, True),
                                                      ((48, 4096), torch.float32, False)])
def test_the_cast_kernel_is_the_torch_ops_bit_for_bit_on_cuda(dtype, shape, src, column_major):
    x = (torch.randn(*shape, device="cuda") * 5).to(src)
    x[3, 5] = 1e5
    if column_major:  # as a gradient may arrive: the kernel reads its strides, nothing copies it first
        x = x.t().contiguous().t()
    scale = torch.tensor(37.5, device="cuda")
    amax = torch.zeros(1, device="cuda")
    q, qt = float8_cast.cast_to_float8(x, scale, amax, dtype, transpose=True)
    want, want_t = float8_cast.cast_reference(x, scale, torch.zeros(1, device="cuda"), dtype, transpose=True)
    assert torch.equal(_bits(q), _bits(want)) and torch.equal(_bits(qt), _bits(want_t))
    assert float(amax) == float(x.float().abs().max())


@pytest.mark.gpu
@pytest.mark.skipif(not _has_fp8_gpu(), reason="needs a CUDA GPU of compute capability >= 8.9")
def test_the_float8_gemms_match_their_emulation_on_gpu():
    """One layer, bf16 activations, the same output gradient into both: the casts are the same
    float8 values, so what differs is the GEMMs' sums (and fast accumulation in the forward).
    (Through a stack of layers the gradient of one depends on the other's bf16 output, whose
    rounding flips some e5m2 roundings of the next gradient: 1.2 % apart on an H100.)"""
    gen = torch.Generator("cuda").manual_seed(3)
    xs = [torch.randn(4, 100, 256, device="cuda", generator=gen) for _ in range(2)]
    grads = [torch.randn(4, 100, 192, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(2)]
    results = []
    for emulate in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(256, 192)).cuda()
        fd.convert_linears(model, emulate=emulate)
        out = []
        for x, g in zip(xs, grads):  # step 1 scales by the tensors' own abs-max, step 2 by the history
            fd.next_step()
            x = x.clone().requires_grad_()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                y = model(x)
            y.backward(g)
            out.append((y.detach(), x.grad, model[0].weight.grad.clone(), model[0].bias.grad.clone()))
            model.zero_grad(set_to_none=True)
        results.append(out)
    for got, want in zip(*results):
        assert all(_rel(a, b) < 1e-2 for a, b in zip(got, want)), [_rel(a, b) for a, b in zip(got, want)]


@pytest.mark.gpu
@pytest.mark.skipif(not _has_fp8_gpu(), reason="needs a CUDA GPU of compute capability >= 8.9")
def test_delayed_training_steps_on_gpu_follow_bf16():
    losses = {}
    for variant in ({"precision": "bf16"}, {"precision": "fp8", "fp8_recipe": "delayed"}):
        f = bd.run_drafter_bench("cuda:0", steps=4, shape="tiny", anchors_per_seq=16, num_seqs=2, seq_len=128,
                                 warmup=1, variant=variant)
        losses[variant["precision"]] = f["loss_last"]
    assert losses["fp8"] == pytest.approx(losses["bf16"], rel=2e-2)
