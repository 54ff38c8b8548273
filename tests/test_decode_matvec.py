"""decode/matvec.py: the linear layers of a decode step or verify pass of a few rows.

On CPU: the custom op's schema and fake (torch.library.opcheck), one graph under torch.compile,
the module swap that shares the model's parameters, the setting, the row limit. On CUDA (marked
gpu): both Triton kernels against fp32 products at each launch config's shapes (bias, a K that
is no multiple of the block, a partial last block of N, 2..16 rows), which inputs the op sends
to which kernel, the drafter's block through the kernels against its modules, and a bf16
target's decode with the kernels against the same target without them, compiled and captured
(eval/lossless.py's near-tie rule: the kernels sum in another order than cuBLAS)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dflash_ipc.decode import matvec, rows_configs
from dflash_ipc.decode.matvec import GEMV_ENV, MatVecLinear, route_matvec
from dflash_ipc.errors import ConfigError
from decode_switch_helpers import check_switch_setting, decode_verdicts

cuda = pytest.mark.skipif(not (torch.cuda.is_available() and matvec.available()), reason="needs CUDA and Triton")


@pytest.mark.parametrize("bias", [False, True])
def test_the_op_checks_out_and_is_linear(bias):
    torch.manual_seed(0)
    x, w = torch.randn(3, 24), torch.randn(10, 24)
    b = torch.randn(10) if bias else None
    torch.library.opcheck(torch.ops.dflash.matvec_linear.default, (x, w, b, 16))
    assert torch.equal(torch.ops.dflash.matvec_linear(x, w, b, 16), F.linear(x, w, b))


def test_the_op_is_one_graph_under_compile():
    torch._dynamo.reset()
    fn = torch.compile(lambda x, w: torch.ops.dflash.matvec_linear(x, w, None, 16) * 2, fullgraph=True,
                       backend="aot_eager", dynamic=True)
    x, w = torch.randn(1, 5, 16), torch.randn(7, 16)
    assert torch.equal(fn(x, w), F.linear(x, w) * 2)
    # the rows decide the kernel inside the op, at run time: 5 rows and 40 are one graph
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    x40 = torch.randn(1, 40, 16)
    assert torch.equal(fn(x40, w), F.linear(x40, w) * 2)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == frames
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
    check_switch_setting(monkeypatch, GEMV_ENV, matvec.enabled)


def test_more_than_one_row_is_refused_by_the_kernel_entry():
    with pytest.raises(ValueError, match="one row"):
        matvec.triton_matvec(torch.randn(2, 8), torch.randn(4, 8))
    with pytest.raises(ValueError, match=f"1..{matvec.MAX_ROWS} rows"):
        matvec.triton_rows(torch.randn(matvec.MAX_ROWS + 1, 8), torch.randn(4, 8))
    with pytest.raises(ValueError, match="rows of the weight's K"):
        matvec.triton_rows(torch.randn(3, 8), torch.randn(4, 6))


def test_the_row_limit_setting(monkeypatch):
    assert matvec.max_rows() == matvec.MAX_ROWS == 16
    monkeypatch.setenv(matvec.MAX_ROWS_ENV, "1")
    assert matvec.max_rows() == 1
    assert MatVecLinear.sharing(nn.Linear(4, 4)).rows_limit == 1  # read where the module is built
    for bad in ("0", "17", "two", "-3"):
        monkeypatch.setenv(matvec.MAX_ROWS_ENV, bad)
        with pytest.raises(ConfigError, match="DFLASH_DECODE_GEMV_MAX_ROWS.*1 to 16"):
            matvec.max_rows()


def test_the_few_row_configs_are_the_sweeps_winners(monkeypatch):
    # benchmarks/matvec.py --rows 16 --sweep on an H200 (132 SMs): every Qwen3-1.7B and -8B weight
    monkeypatch.delenv(rows_configs.ROWS_CONFIGS_ENV, raising=False)
    config = matvec.rows_config  # a GPU without a table of its own: the rule
    assert config(2048, 6144) == dict(BLOCK_N=64, BLOCK_K=128, SPLIT=4, num_warps=4, num_stages=4)  # 1.7B down
    assert config(1024, 4096)["SPLIT"] == 8  # 8B k: 16 blocks
    assert config(4096, 2048) == dict(BLOCK_N=64, BLOCK_K=256, SPLIT=1, num_warps=4, num_stages=4)  # 1.7B q|k|v
    assert config(151936, 2048)["BLOCK_K"] == 128 and config(151936, 2048)["SPLIT"] == 1  # the head
    assert config(2048, 2048, sms=16)["SPLIT"] == 1  # a small GPU: 32 blocks are enough


def test_cpu_inputs_are_never_taken_and_the_op_is_f_linear_there():
    w = torch.randn(6, 8, dtype=torch.bfloat16)
    x = torch.randn(1, 4, 8, dtype=torch.bfloat16)
    assert not matvec.takes(x, w)
    assert torch.equal(matvec.decode_linear(x, w), F.linear(x, w))
    assert torch.equal(torch.ops.dflash.matvec_linear(x, w, None, 16), F.linear(x, w))


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
    assert torch.equal(torch.ops.dflash.matvec_linear(x, w, b, 16), got)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("m,n,k,bias", [(16, 4096, 2048, False), (16, 2048, 6144, True), (15, 151936, 2048, False),
                                        (2, 12288, 2048, False), (5, 1000, 700, True), (16, 33, 4096, False)])
def test_the_few_row_kernel_matches_fp32_and_the_op_sends_each_row_count_to_its_kernel(m, n, k, bias):
    torch.manual_seed(n + m)
    dev = "cuda:0"
    x = torch.randn(1, m, k, device=dev, dtype=torch.bfloat16)  # [B, q, K]: a verify block of one row
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k ** 0.5
    b = torch.randn(n, device=dev, dtype=torch.bfloat16) if bias else None
    want = F.linear(x.float(), w.float(), None if b is None else b.float())
    got = matvec.triton_rows(x, w, b)
    assert got.dtype == torch.bfloat16 and got.shape == (1, m, n)
    assert torch.allclose(got.float(), want, rtol=2 ** -7, atol=2 ** -7 * float(want.abs().max()))
    assert matvec.takes(x, w)
    assert torch.equal(torch.ops.dflash.matvec_linear(x, w, b, 16), got)
    assert torch.equal(matvec.decode_linear(x, w, b), got)
    assert torch.equal(matvec.decode_linear(x, w, b, rows_limit=m - 1), F.linear(x, w, b))  # cuBLAS above the limit
    assert torch.equal(matvec.triton_rows(x, w, b), got)  # again: the split counts were left at zero
    assert not matvec.takes(x, w, rows_limit=m - 1)
    wide = torch.randn(matvec.MAX_ROWS + 1, k, device=dev, dtype=torch.bfloat16)
    assert not matvec.takes(wide, w) and not matvec.takes(x.float(), w.float())
    assert torch.equal(torch.ops.dflash.matvec_linear(wide, w, b, 16), F.linear(wide, w, b))  # cuBLAS past MAX_ROWS
    one = x[:, :1]
    assert torch.equal(torch.ops.dflash.matvec_linear(one, w, b, 1), matvec.triton_matvec(one, w, b))
    strided = torch.randn(m, 2 * k, device=dev, dtype=torch.bfloat16)[:, :k]  # rows apart in memory
    assert torch.equal(matvec.triton_rows(strided, w, b), matvec.triton_rows(strided.contiguous(), w, b))


@pytest.mark.gpu
@cuda
def test_the_drafter_block_through_the_kernels_drafts_as_its_modules_do(tiny_cache, monkeypatch):
    import os
    from eval_helpers import random_drafter
    from dflash_ipc.decode.target import BatchedTarget
    from dflash_ipc.eval.drafter_context import DrafterContext
    from dflash_ipc.eval.drafter_projections import FusedProjections, ModuleProjections

    target_dir = os.path.join(tiny_cache, "tiny-target")
    dev = "cuda:0"
    target = BatchedTarget(target_dir, device=dev, dtype="bfloat16")
    model = random_drafter(target_dir, seed=5, block_size=16).to(dev, torch.bfloat16)
    params = {name: (p, p.detach().clone()) for name, p in model.named_parameters()}
    fused = DrafterContext(model, target.head)
    assert fused.kernel_linears and all(type(p) is FusedProjections for p in fused.projections)
    for name, p in model.named_parameters():  # the same parameters, the same values, in the groups' storage
        assert p is params[name][0] and torch.equal(p, params[name][1]), name
    monkeypatch.setenv(GEMV_ENV, "off")
    modules = DrafterContext(model, target.head)
    assert not modules.kernel_linears and all(type(p) is ModuleProjections for p in modules.projections)
    g = torch.Generator().manual_seed(0)
    features = torch.randn(1, 9, model.fc.in_features, generator=g).to(dev, torch.bfloat16)
    pos = torch.arange(9, device=dev)[None]  # 9 context rows at once: the few-row kernel for fc and k|v
    anchors, starts = torch.tensor([17], device=dev), torch.tensor([9], device=dev)
    logits = []
    for context in (fused, modules):
        context.reset(num_rows=1, capacity=96)
        context.append(torch.tensor([0], device=dev), features, pos, pos)
        logits.append(context.draft_logits(anchors, starts, max_start=9))  # one row's block of 16
    got, want = logits
    assert got.shape == want.shape == (1, 15, target.head.vocab_size)
    torch.testing.assert_close(got.float(), want.float(), atol=5e-2, rtol=5e-2)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("scope,rows", [("layer", 1), ("forward", 1), ("layer", 4)])
def test_a_bf16_decode_with_the_kernels_matches_it_without(tmp_path, monkeypatch, scope, rows):
    """rows 1: the matrix-vector kernel; 4 (and the prefills of up to 16 tokens): the few-row kernel."""
    verdicts = decode_verdicts(tmp_path, monkeypatch, GEMV_ENV, rows=rows, max_prompt=40, max_new=20, num_requests=6,
                               switched_on=lambda target: target.num_matvec_linears > 0, compile_scope=scope)
    assert all(v in ("identical", "near_tie") for v in verdicts), verdicts
    assert verdicts.count("identical") >= len(verdicts) - 2


def test_split_buffers_grow_and_keep_what_a_recorded_graph_may_still_use():
    buffers = matvec.SplitBuffers()
    part, count = buffers.get(torch.device("cpu"), 10, 3)
    assert part.numel() == 1 << 20 and count.numel() == 1 << 14 and not count.any()
    # every split launch of rows_config fits the first ones: < 64 blocks x 8 splits x 64 x 16 floats
    assert (rows_configs.ROWS_SPLIT_BELOW * rows_configs.MAX_ROWS_SPLIT * rows_configs.ROWS_BLOCK_N
            * matvec.DOT_ROWS <= 1 << 20)
    again = buffers.get(torch.device("cpu"), 100, 3)
    assert again[0] is part and again[1] is count
    bigger, same = buffers.get(torch.device("cpu"), (1 << 20) + 1, 3)
    assert bigger.numel() == (1 << 20) + 1 and same is count
    assert any(t is part for t in buffers._kept)  # not freed


def test_counts_made_in_a_capture_are_zeroed_by_the_next_call_outside_one():
    buffers = matvec.SplitBuffers()
    cpu = torch.device("cpu")
    _, count = buffers.get(cpu, 10, 3, capturing=True)  # in a capture its zeros would wait for the replay
    count.fill_(7)  # stands for memory nobody zeroed yet
    assert not buffers.get(cpu, 10, 3, capturing=True)[1].any()  # another capture zeroes them (at its replay)
    count.fill_(7)
    assert not buffers.get(cpu, 10, 3, capturing=False)[1].any()  # outside one: zeroed before use
    count.fill_(1)
    assert buffers.get(cpu, 10, 3, capturing=False)[1].eq(1).all()  # once only
