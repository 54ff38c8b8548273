"""decode/pdl.py: the decode kernels launched with programmatic dependent launch.

On CPU: the switch ($DFLASH_DECODE_PDL) and what a launch passes, for a GPU with and without
griddepcontrol. On CUDA (marked gpu): a chain of dependent launches of every
decode kernel, each reading what the one before wrote, eagerly and replayed from a CUDA graph,
with PDL and without: the same values bit for bit (a kernel that ran before its wait would read
its input half written)."""

import pytest
import torch

from dflash_ipc.decode import pdl
from dflash_ipc.decode.pdl import PDL_ENV
from decode_switch_helpers import check_switch_setting

cuda = pytest.mark.skipif(not (torch.cuda.is_available() and pdl.triton is not None), reason="needs CUDA and Triton")


def test_the_setting(monkeypatch):
    check_switch_setting(monkeypatch, PDL_ENV, pdl.enabled)


@pytest.mark.parametrize("capable", [True, False])
def test_auto_launches_with_pdl_on_gpus_that_have_it_and_the_kernel_waits_exactly_then(monkeypatch, capable):
    monkeypatch.setattr(pdl, "triton", pdl.triton or object())  # CPU builds of torch have no Triton
    monkeypatch.setattr(pdl, "_capable", lambda index: capable)
    monkeypatch.delenv(PDL_ENV, raising=False)
    # the kernel's wait (PDL) and the launch attribute (launch_pdl) never differ: one without the other races
    assert pdl.launch_args("cuda:0") == {"PDL": capable, "launch_pdl": capable}
    monkeypatch.setenv(PDL_ENV, "off")
    assert pdl.launch_args("cuda:0") == {"PDL": False, "launch_pdl": False}
    monkeypatch.delenv(PDL_ENV)
    assert pdl.launch_args("cpu") == {"PDL": False, "launch_pdl": False}


def _chain(x: torch.Tensor, weights, norm: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Every decode kernel in turn, each on the output of the one before: the few-row product
    (split K, and whole K with the norm's launch before it and silu * up after), the one-row
    product with its prologue, q/k rotary and the cache write, the attention and its combine, a
    k/v write."""
    from dflash_ipc.decode import kv_write, matvec, qk_rope
    from dflash_ipc.decode.decode_attention import triton_decode_attention

    for w_split, w_glu in weights:
        h = torch.empty_like(x)
        x = matvec.triton_rows(x, w_split)  # 1,024 x 1,024: K split 8 ways
        x = matvec.triton_rows(x, w_glu, glu=True, norm=norm, eps=1e-6, add=x.flip(0), h=h)
        x = x + h
    one = matvec.triton_matvec(x[:1], weights[0][0], residual=x[1:2].contiguous())  # [1, 1024]
    x = x * one.float().sigmoid().to(x.dtype)
    b, q = 1, x.shape[0]
    heads, kv_heads, dim = 4, 2, 128  # q|k|v of 8 heads of 128 = 1,024
    cos, sin = (torch.linspace(-1, 1, q * dim, device=x.device, dtype=x.dtype).view(1, q, dim) for _ in range(2))
    rows = torch.zeros(1, dtype=torch.long, device=x.device)
    pos = torch.arange(q, device=x.device).view(1, q)
    query = qk_rope.triton_qk_rope_write(x.view(b, q, -1), cos, sin, None, None, 1e-6, keys, values, rows, pos,
                                         heads, kv_heads)  # [1, 4, q, 128]
    mask = torch.ones(b, 1, q, keys.shape[1], dtype=torch.bool, device=x.device).tril(diagonal=0)
    attended = triton_decode_attention(query, keys[:1].transpose(1, 2), values[:1].transpose(1, 2), mask,
                                       splits=4)  # [1, q, 4, 128]
    kv_write.write(keys, values, rows + 1, pos, attended[:, :, :2], attended[:, :, 2:])
    return torch.cat([attended.flatten(), keys[1, :q].flatten(), x.flatten()])


@pytest.mark.gpu
@cuda
def test_a_chain_of_dependent_launches_gives_the_same_values_with_pdl_and_without(monkeypatch):
    torch.manual_seed(0)
    dev, dt = torch.device("cuda:0"), torch.bfloat16
    if not pdl._capable(0):
        pytest.skip("PDL needs a GPU of compute capability 9.0 or more")
    weights = [(torch.randn(1024, 1024, device=dev, dtype=dt) / 32, torch.randn(2048, 1024, device=dev, dtype=dt) / 32)
               for _ in range(6)]
    norm = torch.rand(1024, device=dev, dtype=dt) + 0.5
    x0 = torch.randn(16, 1024, device=dev, dtype=dt)
    results = {}
    for setting in ("off", "auto"):
        monkeypatch.setenv(PDL_ENV, setting)
        assert pdl.launch_args(dev)["launch_pdl"] == (setting == "auto")
        caches = [torch.zeros(2, 512, 2, 128, device=dev, dtype=dt) for _ in range(2)]  # 512 keys: 4 splits
        eager = _chain(x0, weights, norm, *caches).clone()
        static_x = x0.clone()
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            _chain(static_x, weights, norm, *caches)  # compiled and warmed up outside the capture
            with torch.cuda.graph(graph, stream=stream):
                out = _chain(static_x, weights, norm, *caches)
        torch.cuda.current_stream().wait_stream(stream)
        replays = []
        for _ in range(3):
            for c in caches:
                c.zero_()
            graph.replay()
            replays.append(out.clone())
        torch.cuda.synchronize()
        results[setting] = (eager, replays)
    eager_off, replays_off = results["off"]
    eager_on, replays_on = results["auto"]
    assert torch.isfinite(eager_off.float()).all() and eager_off.float().abs().sum() > 0
    assert torch.equal(eager_on, eager_off)
    for r_on, r_off in zip(replays_on, replays_off):
        assert torch.equal(r_on, r_off) and torch.equal(r_off, eager_off)
