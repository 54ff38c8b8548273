"""decode/matvec.py: the one-row linear layers of a decode step at batch 1.

On CPU: the custom op's schema and fake (torch.library.opcheck), one graph under torch.compile,
the module swap that shares the model's parameters, the setting. On CUDA (marked gpu): the
Triton kernel against cuBLAS at each launch config's shapes (bias, a K that is no multiple of
the block, a partial last block of N), and a bf16 target's decode with the kernel against the
same target without it, compiled and captured (eval/lossless.py's near-tie rule: the kernel
sums in another order than cuBLAS)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dflash_ipc.decode import matvec
from dflash_ipc.decode.matvec import GEMV_ENV, MatVecLinear, route_matvec
from dflash_ipc.errors import ConfigError
from decode_switch_helpers import decode_verdicts

cuda = pytest.mark.skipif(not (torch.cuda.is_available() and matvec.available()), reason="needs CUDA and Triton")


@pytest.mark.parametrize("bias", [False, True])
def test_the_op_checks_out_and_is_linear(bias):
    torch.manual_seed(0)
    x, w = torch.randn(3, 24), torch.randn(10, 24)
    b = torch.randn(10) if bias else None
    torch.library.opcheck(torch.ops.dflash.matvec_linear.default, (x, w, b))
    assert torch.equal(torch.ops.dflash.matvec_linear(x, w, b), F.linear(x, w, b))


def test_the_op_is_one_graph_under_compile():
    torch._dynamo.reset()
    fn = torch.compile(lambda x, w: torch.ops.dflash.matvec_linear(x, w, None) * 2, fullgraph=True, backend="aot_eager")
    x, w = torch.randn(1, 5, 16), torch.randn(7, 16)
    assert torch.equal(fn(x, w), F.linear(x, w) * 2)
    torch._dynamo.reset()


def test_route_matvec_swaps_every_plain_linear_over_the_same_parameters():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Sequential(nn.Linear(16, 4, bias=False)))
    params = [p for p in model.parameters()]
    x = torch.randn(2, 8)
    want = model(x)
    assert route_matvec(model) == 2
    assert [type(m) for m in (model[0], model[2][0])] == [MatVecLinear, MatVecLinear]
    assert all(a is b for a, b in zip(model.parameters(), params, strict=True))  # shared, not copied
    assert torch.equal(model(x), want)  # CPU: F.linear itself
    assert route_matvec(model) == 0  # already swapped: nothing left
    with pytest.raises(ValueError, match="holds the linear"):
        route_matvec(nn.Linear(2, 2))


def test_the_setting(monkeypatch):
    monkeypatch.setenv(GEMV_ENV, "sometimes")
    with pytest.raises(ConfigError, match="DFLASH_DECODE_GEMV.*auto"):
        matvec.enabled("cuda:0")
    monkeypatch.setenv(GEMV_ENV, "off")
    assert not matvec.enabled("cuda:0")
    monkeypatch.delenv(GEMV_ENV)
    assert not matvec.enabled("cpu")


def test_more_than_one_row_is_refused_by_the_kernel_entry():
    with pytest.raises(ValueError, match="one row"):
        matvec.triton_matvec(torch.randn(2, 8), torch.randn(4, 8))


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("n,k,bias", [(1024, 2048, False), (2048, 6144, True), (4096, 4096, False),
                                      (6144, 2048, True), (151936, 2048, False), (1000, 700, True), (33, 4096, False)])
def test_triton_matches_cublas(n, k, bias):
    torch.manual_seed(n)
    dev = "cuda:0"
    x = torch.randn(1, 1, k, device=dev, dtype=torch.bfloat16)  # [B, q, K] as a decoder layer passes it
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k ** 0.5
    b = torch.randn(n, device=dev, dtype=torch.bfloat16) if bias else None
    want = F.linear(x.float(), w.float(), None if b is None else b.float())
    got = matvec.triton_matvec(x, w, b)
    assert got.dtype == torch.bfloat16 and got.shape == (1, 1, n)
    # bf16 output: within two units of its last place of the fp32 product
    assert torch.allclose(got.float(), want, rtol=2 ** -7, atol=2 ** -7 * float(want.abs().max()))
    assert torch.equal(torch.ops.dflash.matvec_linear(x, w, b), got)
    two = torch.randn(2, k, device=dev, dtype=torch.bfloat16)
    assert torch.equal(torch.ops.dflash.matvec_linear(two, w, b), F.linear(two, w, b))  # cuBLAS from two rows


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("scope", ["layer", "forward"])
def test_a_bf16_decode_with_the_kernel_matches_it_without(tmp_path, monkeypatch, scope):
    verdicts = decode_verdicts(tmp_path, monkeypatch, GEMV_ENV, rows=1, max_prompt=40, max_new=20, num_requests=6,
                               switched_on=lambda target: target.num_matvec_linears > 0, compile_scope=scope)
    assert all(v in ("identical", "near_tie") for v in verdicts), verdicts
    assert verdicts.count("identical") >= len(verdicts) - 2
