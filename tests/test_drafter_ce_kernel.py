"""drafter/ce_kernel.py: a CE chunk's rows and gradient in one kernel, the gradient over the logits.

On CPU: the switch ($DFLASH_CE_KERNEL) and where the kernel runs; where Triton is installed, the
kernel itself in Triton's interpreter (a fresh process, since the interpreter is chosen when a
kernel is defined) against the torch functions of objective.py. On CUDA (marked gpu): the same at a
135M-class vocabulary (49,152, six steps of a row) and a vocabulary that is no multiple of the
kernel's block, rows that start with -inf, NaN logits, the label at either end of the row, and the whole
chunked CE (weights, D-PACE, no gradient) with the kernel against the compiled functions."""

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from dflash_ipc.drafter import ce_kernel
from dflash_ipc.drafter.ce_kernel import CE_KERNEL_ENV, ce_rows, takes
from dflash_ipc.drafter.objective import _chunk_loss_and_grad, _chunk_rows_and_grad, weighted_ce_sum
from dflash_ipc.errors import ConfigError
from dflash_ipc.hf.target_head import FrozenTargetHead
from test_drafter_trainer import _new_trainer

cuda = pytest.mark.skipif(not (torch.cuda.is_available() and ce_kernel.triton is not None),
                          reason="needs CUDA and Triton")


def test_the_setting_and_where_the_kernel_runs(monkeypatch):
    monkeypatch.setenv(CE_KERNEL_ENV, "sometimes")
    with pytest.raises(ConfigError, match=f"{CE_KERNEL_ENV}.*'sometimes'.*auto"):
        ce_kernel.enabled()
    monkeypatch.setenv(CE_KERNEL_ENV, "off")
    assert not ce_kernel.enabled()
    monkeypatch.delenv(CE_KERNEL_ENV)
    assert ce_kernel.enabled()
    assert not takes(torch.zeros(4, 10, dtype=torch.bfloat16))  # CPU logits: the torch functions
    monkeypatch.setenv(CE_KERNEL_ENV, "of")  # a trainer refuses a typo when it is built, on any device
    with pytest.raises(ConfigError, match=f"{CE_KERNEL_ENV}.*'of'"):
        _new_trainer()
    monkeypatch.delenv(CE_KERNEL_ENV)
    with pytest.raises(ValueError, match="labels on meta"):  # a kernel reads every tensor on the logits' device
        ce_rows(torch.zeros(2, 10), torch.zeros(2, dtype=torch.long, device="meta"), grad=False)


def hard_rows(rows: int, vocab: int, dtype: torch.dtype, seed: int = 0):
    """Logits with a wide range, a row whose first entries (more than a block) are -inf, labels at
    both ends of the vocabulary; weights in [0, 1) with a zero."""
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, vocab, generator=gen) * 6).to(dtype)
    logits[1, :min(vocab - 1, 8192 + 5)] = float("-inf")  # more than the widest tile's step
    labels = torch.randint(0, vocab, (rows,), generator=gen)
    labels[1], labels[2] = vocab - 1, 0
    weights = torch.rand(rows, generator=gen)
    weights[3] = 0
    return logits, labels, weights


def check_against_torch(run, logits, labels, weights, grad_atol):
    """``run(x, labels, scale, grad)`` (the kernel, in place) against objective.py's functions."""
    want_ce, want_grad = _chunk_rows_and_grad(logits.float(), labels)
    _, want_weighted = _chunk_loss_and_grad(logits.float(), labels, weights)
    for scale, want in ((None, want_grad), (weights, want_weighted)):
        x = logits.clone()
        ce = run(x, labels, scale, True)
        torch.testing.assert_close(ce, want_ce, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(x.float(), want.to(x.dtype).float(), rtol=1e-5, atol=grad_atol)
    x = logits.clone()
    torch.testing.assert_close(run(x, labels, None, False), want_ce, rtol=1e-5, atol=1e-5)
    assert torch.equal(x, logits)  # no gradient asked: the logits are left alone
    x = logits.clone()
    run(x, labels, weights, True)
    assert torch.equal(x[weights == 0], torch.zeros_like(x[weights == 0]))  # a zero weight: no gradient at all


def check_nan_rows(run, vocab: int, dtype: torch.dtype, device: str = "cpu"):
    """Rows whose CE and gradient are NaN where torch's are, and finite where torch's are: a NaN
    among the -inf entries that open a row, more of them than the widest tile reads at once, then
    finite logits (a GPU maximum drops a NaN operand: a kernel that trusted the maximum to carry
    it gave this row a finite CE); a NaN at the end of a row and one among finite logits; a row
    all -inf (torch: NaN); a finite row."""
    logits = torch.randn(5, vocab).to(dtype)
    logits[0, :8192 + 5] = float("-inf")
    logits[0, 5] = float("nan")
    logits[1, vocab - 1] = float("nan")
    logits[2, 5] = float("nan")
    logits[3] = float("-inf")
    labels = torch.tensor([vocab - 1, 1, 2, 0, 3])
    want_ce, want_grad = _chunk_rows_and_grad(logits.float(), labels)
    assert want_ce[:4].isnan().all() and want_ce[4].isfinite()  # what the kernel must match
    logits, labels = logits.to(device), labels.to(device)
    x = logits.clone()
    ce = run(x, labels, None, True)
    assert torch.equal(ce.isnan().cpu(), want_ce.isnan()), ce
    assert torch.equal(x.isnan().all(1).cpu(), want_grad.isnan().all(1)) and x[4].isfinite().all()
    assert torch.equal(run(logits.clone(), labels, None, False).isnan(), ce.isnan())


INTERPRETED = textwrap.dedent("""
    import numpy as np
    import torch
    from triton.runtime import interpreter
    from dflash_ipc.drafter import ce_kernel
    # A GPU's float maximum (maxnum) drops a NaN operand; Triton 3.6's interpreter propagates it,
    # under which a kernel that trusted the maximum to carry a NaN would pass: run the GPU's rule.
    assert hasattr(interpreter.InterpreterBuilder, "create_maxnumf")  # the rule this test replaces
    interpreter.InterpreterBuilder.create_maxnumf = lambda self, lhs, rhs: self.binary_op(lhs, rhs, np.fmax)
    from test_drafter_ce_kernel import check_against_torch, check_nan_rows, hard_rows

    for lanes in (False, True):
        def run(x, labels, scale, grad):
            ce = torch.empty(x.shape[0])
            ce_kernel._launch(x, labels, scale, ce, grad, (4096, lanes, 4))
            return ce

        for dtype, vocab, atol in ((torch.float32, 9000, 1e-6), (torch.bfloat16, 3 * 4096, 8e-3)):
            check_against_torch(run, *hard_rows(5, vocab, dtype), grad_atol=atol)
            check_nan_rows(run, vocab, dtype)
        labels = torch.tensor([9000])  # outside the vocabulary: NaN, not a read past the row
        print("ok", run(torch.zeros(1, 9000), labels, None, False).isnan().item())
""")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton (its interpreter)")
def test_the_kernel_in_tritons_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join([os.path.dirname(__file__), *sys.path]))
    done = subprocess.run([sys.executable, "-c", INTERPRETED], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["ok", "True"] * 2


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("vocab", [49152, 151936 // 8 + 3])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_kernel_on_cuda(vocab, dtype):
    logits, labels, weights = hard_rows(37, vocab, dtype)
    logits, labels, weights = logits.cuda(), labels.cuda(), weights.cuda()

    for tile in (*ce_kernel.TILES, None):  # each shape, then the one timed fastest
        def run(x, labels, scale, grad):
            assert takes(x)
            return ce_rows(x, labels, scale, grad=grad, tile=tile)

        check_against_torch(run, logits, labels, weights, grad_atol=8e-3 if dtype == torch.bfloat16 else 1e-6)
        check_nan_rows(run, vocab, dtype, "cuda")
    assert any(key[0] == vocab and key[1] == dtype for key in ce_kernel._tiles)
    assert ce_rows(logits[:0], labels[:0], grad=True).shape == (0,)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dpace", [None, (0.5, 16)])
def test_the_chunked_ce_with_the_kernel_equals_the_compiled_functions(monkeypatch, dpace):
    gen = torch.Generator().manual_seed(1)
    rows, vocab, hidden = 64 * 16, 49152, 96
    head = FrozenTargetHead((torch.randn(vocab, hidden, generator=gen) * 0.05).to(torch.bfloat16).cuda())
    h = torch.randn(rows, hidden, generator=gen).to(torch.bfloat16).cuda()
    labels = torch.randint(0, vocab, (rows,), generator=gen).cuda()
    weights = torch.rand(64, 16, generator=gen)
    weights[:, 0] = 0
    weights[7, 5:] = 0
    weights = weights.reshape(-1).cuda()
    results = {}
    for setting in ("off", "auto"):
        monkeypatch.setenv(CE_KERNEL_ENV, setting)
        hh = h.clone().requires_grad_(True)
        with torch.autocast("cuda", dtype=torch.bfloat16):  # as the trainer calls it
            loss = weighted_ce_sum(hh, head, labels, weights, chunk_size=300, dpace=dpace)
        loss.backward()
        with torch.no_grad():
            value = weighted_ce_sum(h, head, labels, weights, chunk_size=300, dpace=dpace)
        results[setting] = (loss.detach(), hh.grad, value)
    (loss_off, grad_off, value_off), (loss_on, grad_on, value_on) = results["off"], results["auto"]
    torch.testing.assert_close(loss_on, loss_off, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(value_on, value_off, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(grad_on.float(), grad_off.float(), rtol=2e-2, atol=2e-3)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")
def test_the_kernel_compiles_for_sm90_to_wide_loads_with_the_cache_hints():
    """Every variant compiled for an H100/H200 (no GPU needed) as Triton specialises it at a launch on
    rows of 16-byte multiples: 16-byte loads, the first pass's asking L2 to keep the row (evict_last),
    the second's to drop it (evict_first); 16-byte stores of the gradient, only with GRAD."""
    import triton
    from triton.backends.compiler import GPUTarget

    kernel = ce_kernel._ce_rows_kernel
    cases = [(element, grad, scaled, tile) for element, grad, scaled in
             (("*bf16", True, True), ("*bf16", True, False), ("*fp32", False, False)) for tile in ce_kernel.TILES]
    for element, grad, scaled, (block, lanes, warps) in cases:
        consts = dict(GRAD=grad, SCALED=scaled, BLOCK=block, LANES=lanes)
        types = {"x_ptr": element, "labels_ptr": "*i64", "scale_ptr": "*fp32", "ce_ptr": "*fp32",
                 "V": "i32", "stride_row": "i32"}
        sig = {n: "constexpr" if n in consts else types[n] for n in kernel.arg_names}
        aligned = {(kernel.arg_names.index(n),): [["tt.divisibility", 16]] for n in ("x_ptr", "V", "stride_row")}
        compiled = triton.compile(triton.compiler.ASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=aligned),
                                  target=GPUTarget("cuda", 90, 128), options=dict(num_warps=warps))
        lines = compiled.asm["ptx"].splitlines()
        wide_loads = [line for line in lines if "ld.global" in line and ".v4.b32" in line]
        hints = {("evict_last" in line, "evict_first" in line) for line in wide_loads}
        assert hints == {(True, False)} | ({(False, True)} if grad else set()), (element, grad, scaled, lanes)
        wide_stores = [line for line in lines if "st.global.v4.b32" in line]
        assert bool(wide_stores) == grad  # the gradient over the logits; the CE is one scalar per row
