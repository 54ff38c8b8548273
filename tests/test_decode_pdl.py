"""decode/pdl.py: the decode kernels launched with programmatic dependent launch.

On CPU: the switch ($DFLASH_DECODE_PDL) and what a launch passes, for a GPU with and without
griddepcontrol; a capture that fails under PDL is tried once more without it; where Triton is
installed, every decode kernel compiled for sm_90 waits before its first memory access (its PTX).
The attention kernel's K/V prefetch ahead of the wait: its switch and size (CPU; its values with
it and without: tests/test_decode_attention.py, on CUDA).
On CUDA (marked gpu): every decode kernel launched back to back, each reading what the one before
wrote, eagerly and replayed from a CUDA graph with a new input each replay, with PDL and without:
the same values bit for bit (a kernel that ran before its wait would read its input half written)."""

import inspect
import re

import pytest
import torch

from dflash_ipc.decode import pdl
from dflash_ipc.decode.pdl import PDL_ENV, triton
from decode_switch_helpers import check_switch_setting

cuda = pytest.mark.skipif(not (torch.cuda.is_available() and pdl.triton is not None), reason="needs CUDA and Triton")


def test_the_setting(monkeypatch):
    check_switch_setting(monkeypatch, PDL_ENV, pdl.enabled)


def test_kv_is_prefetched_only_under_pdl_and_at_most_prefetch_bytes_a_program(monkeypatch):
    check_switch_setting(monkeypatch, pdl.PREFETCH_ENV, pdl.prefetch_enabled)
    pdl_on = {"on": False}
    monkeypatch.setattr(pdl, "enabled", lambda device: pdl_on["on"])
    assert pdl.prefetch_tokens(512, 256, "cuda:0") == (0, 1)  # launches without PDL: nothing to overlap
    pdl_on["on"] = True
    assert pdl.prefetch_enabled("cuda:0")
    # (keys a program, bytes a K or V row) -> (keys, lines a row): powers of two, within both limits
    for tokens, row_bytes, want in [(512, 256, (64, 2)), (16, 192, (16, 2)), (1, 64, (1, 1)), (48, 256, (32, 2)),
                                    (512, 512, (32, 4)), (0, 256, (0, 1))]:
        got = pdl.prefetch_tokens(tokens, row_bytes, "cuda:0")
        assert got == want, (tokens, row_bytes, got)
        assert got[0] == 0 or (2 * got[0] * got[1] * pdl.LINE_BYTES <= pdl.PREFETCH_BYTES
                               and got[1] * pdl.LINE_BYTES >= row_bytes)
    monkeypatch.setenv(pdl.PREFETCH_ENV, "off")
    assert pdl.prefetch_tokens(512, 256, "cuda:0") == (0, 1)


@pytest.mark.parametrize("capable", [True, False])
def test_auto_launches_with_pdl_on_gpus_that_have_it_and_the_kernel_waits_exactly_then(monkeypatch, capable):
    monkeypatch.setattr(pdl, "_HAS_GDC", True)  # CPU builds of torch have no Triton
    monkeypatch.setattr(pdl, "_capable", lambda index: capable)
    monkeypatch.delenv(PDL_ENV, raising=False)
    # the kernel's wait (PDL) and the launch attribute (launch_pdl) never differ: one without the other races
    assert pdl.launch_args("cuda:0") == {"PDL": capable, "launch_pdl": capable}
    monkeypatch.setenv(PDL_ENV, "off")
    assert pdl.launch_args("cuda:0") == {"PDL": False, "launch_pdl": False}
    monkeypatch.delenv(PDL_ENV)
    assert pdl.launch_args("cpu") == {"PDL": False, "launch_pdl": False}


class _Graph:
    def pool(self):
        return "pool"

    def replay(self):
        pass


def _graphs_failing(when, attempts):
    """A StepGraphs whose captures record whether PDL was on and fail while ``when(pdl_on)``."""
    from dflash_ipc.decode.graphs import StepGraphs

    class Graphs(StepGraphs):
        def _record(self, shape, saved):
            on = pdl.enabled("cuda:0")
            attempts.append(on)
            self.state[0].add_(1)  # what a warm-up does to the state; put back after a failure
            if when(on):
                raise RuntimeError("operation not permitted when stream is capturing")
            return _Graph()
    return Graphs


@pytest.mark.parametrize("capable", [True, False])
def test_a_capture_that_fails_under_pdl_is_tried_once_more_without_it(monkeypatch, capable):
    monkeypatch.setattr(pdl, "_HAS_GDC", True)
    monkeypatch.setattr(pdl, "_capable", lambda index: capable)
    monkeypatch.setattr(pdl, "_turned_off", False)  # the process-wide switch, put back after the test
    monkeypatch.delenv(PDL_ENV, raising=False)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    steps = []
    attempts = []
    state = torch.zeros(3)
    graphs = _graphs_failing(lambda on: on, attempts)(lambda *shape: steps.append(shape), [state], enabled=True)
    graphs.run((1, 128))
    if capable:  # failed with PDL twice, captured without it: PDL stays off in this process
        assert attempts == [True, True, False] and graphs.enabled and graphs.num_captures == 1 and steps == []
        assert not pdl.enabled("cuda:0") and pdl.launch_args("cuda:0") == {"PDL": False, "launch_pdl": False}
    else:  # PDL was never on: nothing to retry
        assert attempts == [False] and graphs.enabled and graphs.num_captures == 1
    assert torch.equal(state, torch.full((3,), 1.0))  # the failed attempt's change put back, the capture's kept

    attempts.clear()
    broken = _graphs_failing(lambda on: True, attempts)(lambda *shape: steps.append(shape), [state], enabled=True)
    broken.run((2, 128))  # fails without PDL too: graphs off, the step eager
    assert attempts == [False] and not broken.enabled and steps == [(2, 128)]
    assert torch.equal(state, torch.full((3,), 1.0))


def test_a_capture_that_fails_once_under_pdl_keeps_pdl_when_the_second_passes(monkeypatch, caplog):
    monkeypatch.setattr(pdl, "_HAS_GDC", True)
    monkeypatch.setattr(pdl, "_capable", lambda index: True)
    monkeypatch.setattr(pdl, "_turned_off", False)
    monkeypatch.delenv(PDL_ENV, raising=False)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    attempts, state = [], torch.zeros(3)
    graphs = _graphs_failing(lambda on: len(attempts) == 1, attempts)(lambda *shape: None, [state], enabled=True)
    with caplog.at_level("WARNING", logger="dflash_ipc.decode.graphs"):
        graphs.run((1, 128))
    assert attempts == [True, True] and graphs.num_captures == 1 and pdl.enabled("cuda:0")
    assert "capturing it once more" in caplog.text and "plain launches" not in caplog.text
    assert torch.equal(state, torch.full((3,), 1.0))


@pytest.mark.parametrize("enabled_before", [True, False])
def test_the_garbage_collector_is_held_off_during_a_capture(monkeypatch, enabled_before):
    """A dead graph freed by the collector mid-capture breaks the capture (graphs.collector_held):
    the collector is off from before the capture begins to after it ends, and as it was after."""
    import contextlib
    import gc
    from dflash_ipc.decode.graphs import StepGraphs

    seen = []

    @contextlib.contextmanager
    def fake_capture(graph, **kwargs):
        seen.append(("begin", gc.isenabled()))
        yield
        seen.append(("end", gc.isenabled()))

    class FakeStream:
        def wait_stream(self, other):
            pass

    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: FakeStream())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _Graph)
    monkeypatch.setattr(torch.cuda, "graph", fake_capture)
    was = gc.isenabled()
    (gc.enable if enabled_before else gc.disable)()
    try:
        graphs = StepGraphs(lambda *shape: seen.append(("step", gc.isenabled())), [], enabled=True)
        graphs.run((1, 128))
        after = gc.isenabled()
    finally:
        (gc.enable if was else gc.disable)()
    # the warm-up step runs with the collector as it was; the captured one without it
    assert seen == [("step", enabled_before), ("begin", False), ("step", False), ("end", False)]
    assert after == enabled_before and graphs.num_captures == 1


def test_the_log_names_the_error_that_broke_the_capture(monkeypatch, caplog):
    """A call that fails inside a capture invalidates it; capture end then fails with "a previous
    error": the warning names the first (its context)."""
    from dflash_ipc.decode.graphs import StepGraphs

    monkeypatch.setattr(pdl, "_turned_off", True)  # no retry
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)

    class Graphs(StepGraphs):
        def _record(self, shape, saved):
            try:
                raise RuntimeError("Triton Error [CUDA]: operation not permitted when stream is capturing")
            finally:  # as torch.cuda.graph's exit, ending the capture
                raise RuntimeError("CUDA error: operation failed due to a previous error during capture")

    graphs = Graphs(lambda *shape: None, [], enabled=True)
    with caplog.at_level("WARNING", logger="dflash_ipc.decode.graphs"):
        graphs.run((3, 128))
    assert not graphs.enabled and "not permitted when stream is capturing" in caplog.text
    assert "previous error" not in caplog.text


class _Chain:
    """Every decode kernel, back to back, each on what the one before wrote: the few-row product with K
    split 8 ways, the norm launch and the GLU product after it, the one-row product with its add and
    norm prologue, q/k rotary and the cache write, the attention with its splits combined by the last
    one (a block of queries) and again with a combine launch, a K/V write. Their
    constant inputs (weights, tables, masks, indices) are made beforehand, so no torch kernel runs
    between two of them and each may start while the one before still runs."""

    def __init__(self, dev, dt):
        torch.manual_seed(0)
        self.weights = [(torch.randn(1024, 1024, device=dev, dtype=dt) / 32,
                         torch.randn(2048, 1024, device=dev, dtype=dt) / 32) for _ in range(4)]
        self.norm = torch.rand(1024, device=dev, dtype=dt) + 0.5
        self.add = torch.randn(16, 1024, device=dev, dtype=dt)
        self.q = 16
        self.cos, self.sin = (torch.linspace(-1, 1, 16 * 128, device=dev, dtype=dt).view(1, 16, 128) for _ in range(2))
        self.rows = torch.zeros(1, dtype=torch.long, device=dev)
        self.next_rows = self.rows + 1
        self.pos = torch.arange(16, device=dev).view(1, 16)
        self.mask = torch.ones(1, 1, 16, 512, dtype=torch.bool, device=dev).tril(diagonal=0)
        self.caches = [torch.zeros(2, 512, 2, 128, device=dev, dtype=dt) for _ in range(2)]  # 512 keys: 4 splits
        self.h = [torch.empty(16, 1024, device=dev, dtype=dt) for _ in self.weights]
        self.h_one = torch.empty(1, 1024, device=dev, dtype=dt)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        from dflash_ipc.decode import kv_write, matvec, qk_rope
        from dflash_ipc.decode.decode_attention import triton_decode_attention

        keys, values = self.caches
        for (w_split, w_glu), h in zip(self.weights, self.h):
            x = matvec.triton_rows(x, w_split)  # 1,024 x 1,024: K split (8 ways on 132 SMs)
            x = matvec.triton_rows(x, w_glu, glu=True, norm=self.norm, eps=1e-6, add=self.add, h=h)
        one = matvec.triton_matvec(x[:1], self.weights[0][0], norm=self.norm, eps=1e-6, add=self.add[:1],
                                   h=self.h_one)
        query = qk_rope.triton_qk_rope_write(x.view(1, self.q, -1), self.cos, self.sin, None, None, 1e-6, keys,
                                             values, self.rows, self.pos, 4, 2)  # q|k|v: 4 + 2 + 2 heads of 128
        attended = triton_decode_attention(query, keys[:1].transpose(1, 2), values[:1].transpose(1, 2), self.mask,
                                           splits=4)  # [1, q, 4, 128]
        launched = triton_decode_attention(query, keys[:1].transpose(1, 2), values[:1].transpose(1, 2), self.mask,
                                           splits=4, combine_last=False)
        kv_write.write(keys, values, self.next_rows, self.pos, attended[:, :, :2], attended[:, :, 2:])
        return torch.cat([attended.flatten(), launched.flatten(), keys[1, :self.q].flatten(),
                          values[1, :self.q].flatten(),
                          one.flatten(), self.h_one.flatten(), x.flatten(), torch.cat(self.h).flatten()])

    def reset(self):
        for c in self.caches:
            c.zero_()


@pytest.mark.gpu
@cuda
def test_a_chain_of_dependent_launches_gives_the_same_values_with_pdl_and_without(monkeypatch):
    dev, dt = torch.device("cuda:0"), torch.bfloat16
    if not pdl.enabled(dev):
        pytest.skip("PDL needs an NVIDIA GPU of compute capability 9.0 or more")
    chain = _Chain(dev, dt)
    inputs = [torch.randn(16, 1024, device=dev, dtype=dt, generator=torch.Generator(dev).manual_seed(i))
              for i in range(3)]
    results = {}
    for setting in ("off", "auto"):
        monkeypatch.setenv(PDL_ENV, setting)
        assert pdl.launch_args(dev)["launch_pdl"] == (setting == "auto")
        eager = []
        for x in inputs:
            chain.reset()
            eager.append(chain(x.clone()))
        static_x = inputs[0].clone()
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            chain(static_x)  # compiled and warmed up outside the capture
            with torch.cuda.graph(graph, stream=stream):
                out = chain(static_x)
        torch.cuda.current_stream().wait_stream(stream)
        replays = []
        for x in inputs:  # a new input each replay: a kernel that read before its wait would see the last one's
            chain.reset()
            static_x.copy_(x)
            graph.replay()
            replays.append(out.clone())
        torch.cuda.synchronize()
        results[setting] = (eager, replays)
    for i in range(len(inputs)):
        off = results["off"][0][i]
        assert torch.isfinite(off.float()).all() and off.float().abs().sum() > 0
        assert torch.equal(results["auto"][0][i], off)  # eager, PDL on
        assert torch.equal(results["auto"][1][i], off) and torch.equal(results["off"][1][i], off)  # replayed
    assert not torch.equal(results["off"][0][0], results["off"][0][1])


_PTX_MEMORY = re.compile(r"^(?:@!?%p\d+\s+)?(?:ld|st|atom|red|cp\.async|prefetch)\.[^;]*\bglobal\b")
"""A PTX line that loads, stores or reduces global memory (predicated or not)."""


@pytest.mark.skipif(pdl.triton is None or not pdl._HAS_GDC, reason="needs Triton with griddepcontrol")
def test_every_decode_kernel_waits_before_its_first_memory_access_under_pdl():
    """Each kernel compiled for sm_90 (no GPU needed) with PDL: launch_pdl in its metadata, and in its
    PTX griddepcontrol.wait before any load, store or atomic; without PDL no griddepcontrol at all.
    The attention kernel with PREFETCH asks L2 for its K/V lines before the wait, and does nothing
    else with memory there."""
    from triton.backends.compiler import GPUTarget

    from dflash_ipc.decode import accept, band_mask, decode_attention, kv_write, matvec, qk_rope, top2

    half = "*bf16"
    kernels = [
        (matvec._rows_kernel, dict(HAS_BIAS=False, SPLIT=4, BLOCK_N=64, BLOCK_K=128, EVEN_K=True, GLU=False,
                                   RESIDUAL=True), {"part_ptr": "*fp32", "count_ptr": "*i32"}, 4),
        (matvec._rows_kernel, dict(HAS_BIAS=False, SPLIT=1, BLOCK_N=32, BLOCK_K=128, EVEN_K=True, GLU=True,
                                   RESIDUAL=False), {"part_ptr": "*fp32", "count_ptr": "*i32"}, 4),
        (matvec._matvec_kernel, dict(HAS_BIAS=False, BLOCK_N=4, BLOCK_K=512, EVEN_K=True, ADD=True, NORM=True,
                                     GLU=True, RESIDUAL=False, RSTD_BLOCK=2048), {}, 4),
        (matvec._rows_norm_kernel, dict(ADD=True, BLOCK_K=2048), {}, 4),
        (decode_attention._attention_kernel, dict(HKV=8, REP=2, NQ=16, D=128, DV=128, BLOCK_M=32, BLOCK_T=64,
                                                  BLOCK_D=128, BLOCK_DV=128, SPLIT=True, SKIP_HIDDEN=False,
                                                  COMBINE_LAST=False, SPLIT_P2=1),
         {"mask_ptr": "*u8", "part_ptr": "*fp32", "stat_ptr": "*fp32"}, 4),
        (decode_attention._attention_kernel, dict(HKV=8, REP=2, NQ=16, D=128, DV=128, BLOCK_M=32, BLOCK_T=64,
                                                  BLOCK_D=128, BLOCK_DV=128, SPLIT=True, SKIP_HIDDEN=False,
                                                  COMBINE_LAST=True, SPLIT_P2=16),
         {"mask_ptr": "*u8", "part_ptr": "*fp32", "stat_ptr": "*fp32", "count_ptr": "*i32"}, 4),
        (decode_attention._attention_kernel, dict(HKV=8, REP=2, NQ=16, D=128, DV=128, BLOCK_M=32, BLOCK_T=64,
                                                  BLOCK_D=128, BLOCK_DV=128, SPLIT=True, SKIP_HIDDEN=False,
                                                  COMBINE_LAST=True, SPLIT_P2=16, PREFETCH=64, PREFETCH_LINES=2),
         {"mask_ptr": "*u8", "part_ptr": "*fp32", "stat_ptr": "*fp32", "count_ptr": "*i32"}, 4),
        (decode_attention._combine_kernel, dict(HKV=8, REP=2, NQ=16, DV=128, BLOCK_M=32, BLOCK_DV=128, SPLIT_P2=4),
         {"part_ptr": "*fp32", "stat_ptr": "*fp32"}, 4),
        (qk_rope._qk_rope_write_kernel, dict(D=128, QK_NORM=True), {"rows_ptr": "*i64", "pos_ptr": "*i64"}, 1),
        (kv_write._write_kernel, dict(H=8, D=128, BLOCK_H=8, BLOCK_D=128), {"rows_ptr": "*i64", "pos_ptr": "*i64"}, 4),
        (top2._chunk_kernel, dict(BLOCK=top2.BLOCK), {"part_ptr": "*fp32"}, 8),
        (top2._row_kernel, dict(BLOCK_C=64), {"part_ptr": "*fp32", "token_ptr": "*i64", "margin_ptr": "*fp32",
                                              "top_ptr": "*fp32"}, 1),
        (accept._accept_kernel, dict(BS=16, BLOCK=16), {n: "*i64" for n in ("drafted_ptr", "tokens_ptr", "starts_ptr",
                                                                            "anchors_ptr", "next_starts_ptr")}
         | {n: "*fp32" for n in ("margins_ptr", "tops_ptr", "packed_ptr")}, 1),
        (band_mask._band_kernel, dict(HAS_LO=True, HAS_WINDOW=True, BLOCK=band_mask.BLOCK),
         {"lo_ptr": "*i64", "hi_ptr": "*i64", "out_ptr": "*u8"}, 4),
    ]
    for fn, consts, types, warps in kernels:
        for on in (True, False):
            c = dict(consts, PDL=on)
            for name, param in inspect.signature(fn.fn).parameters.items():  # constexprs left at their defaults
                if param.default is not param.empty:
                    c.setdefault(name, param.default)
            sig = {n: "constexpr" if n in c else types.get(n, half if n.endswith("_ptr") else
                                                              "fp32" if n in ("eps", "scale") else "i32")
                   for n in fn.arg_names}
            compiled = triton.compile(triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=c),
                                      target=GPUTarget("cuda", 90, 128), options=dict(num_warps=warps, launch_pdl=on))
            lines = compiled.asm["ptx"].splitlines()
            waits = [i for i, line in enumerate(lines) if "griddepcontrol.wait" in line]
            prefetches = [i for i, line in enumerate(lines) if line.strip().startswith("prefetch.global.L2 ")]
            memory = [i for i, line in enumerate(lines) if _PTX_MEMORY.search(line.strip()) and i not in prefetches]
            assert compiled.metadata.launch_pdl == on, fn.__name__
            assert bool(prefetches) == bool(consts.get("PREFETCH", 0)), (fn.__name__, len(prefetches))
            if on:
                assert len(waits) == 1 and memory and waits[0] < memory[0], (fn.__name__, lines[memory[0]])
                assert all(i < waits[0] for i in prefetches), fn.__name__
            else:
                assert not waits and not any("griddepcontrol" in line for line in lines), fn.__name__


@pytest.mark.gpu
@cuda
def test_a_graph_freed_during_a_capture_breaks_it():
    """Why graphs.collector_held exists: a graph left in a reference cycle (an earlier decoder's
    graphs hold its bound step method) and freed by a collection inside another capture breaks
    that capture. The explicit collect stands for the automatic one the collector would run at
    an arbitrary allocation (collector_held stops only those)."""
    import gc

    x = torch.zeros(1024, device="cuda")

    class Holder:  # a decoder and its graph, in a cycle
        def __init__(self):
            self.me, self.graph = self, torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
                x.add_(1)

    was = gc.isenabled()
    gc.disable()  # nothing collects the cycle before the capture below
    try:
        Holder()
        graph = torch.cuda.CUDAGraph()
        with pytest.raises(RuntimeError):
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                x.add_(1)
                gc.collect()  # frees the dead graph: its executable graph destroyed mid-capture
                x.add_(1)
    finally:
        (gc.enable if was else gc.disable)()
    torch.cuda.synchronize()
