"""torch.compile of the target's decode forward (decode/compiled.py), in both scopes.

On CPU the forward is traced with ``aot_eager``: Dynamo over the transformers model (or one
decoder layer), our cache and masks, and AOTAutograd's functionalisation of the in-place K/V
writes, without code generation (Inductor's kernels are the GPU test's business). One- to
four-layer random targets keep each compile to seconds. What must hold: the same tokens (and
captured features) as the eager forward (float32), one graph with no break, no recompile for
other rows buckets, key spans or layers, and a compiler that fails costs one warning and
nothing else."""

import logging
import os

import numpy as np
import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from dflash_ipc.bench.assets import build_random_target
from dflash_ipc.decode import compiled
from dflash_ipc.decode.compiled import SCOPE_ENV, SCOPES, compile_enabled, compile_scope
from dflash_ipc.decode.engine import DecodeEngine, EngineSettings
from dflash_ipc.decode.requests import RequestList
from dflash_ipc.decode.target import BatchedTarget
from dflash_ipc.errors import ConfigError
from decode_switch_helpers import make_requests

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("one-layer") / "target")
    build_random_target(path, shape="tiny", dtype="float32", num_layers=1, seed=5)
    return path


@pytest.fixture(scope="module", params=SCOPES)
def target(target_dir, request):
    return BatchedTarget(target_dir, device="cpu", dtype="float32", compile_scope=request.param)


@pytest.fixture(scope="module")
def layered_dirs(tmp_path_factory):
    """Random targets of 2 and 4 layers: {layers: path}."""
    paths = {}
    for num_layers in (2, 4):
        paths[num_layers] = str(tmp_path_factory.mktemp(f"layers-{num_layers}") / "target")
        build_random_target(paths[num_layers], shape="tiny", dtype="float32", num_layers=num_layers, seed=5)
    return paths


@pytest.fixture()
def counter(monkeypatch):
    """The compile backend for this test: aot_eager, counting the graphs it is given."""
    torch._dynamo.reset()
    count = CompileCounterWithBackend("aot_eager")
    monkeypatch.setattr(compiled, "BACKEND", count)
    yield count
    torch._dynamo.reset()


def step_graphs(target) -> int:
    """Graphs dynamo holds for the compiled steps (the layer scope's layer_step, the forward
    scope's extend), prefills' apart."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    code = compiled.layer_step.__code__ if target.compile_scope == "layer" else BatchedTarget._extend.__code__
    return len(_debug_get_cache_entry_list(code))


def tokens(run):
    return {g.request.key: g.tokens for g in run.generations}


def run_engine(target, compile, rows=4, requests=None):
    engine = DecodeEngine(target, settings=EngineSettings(max_rows=rows, check_every=3, compile=compile))
    return engine, engine.run(RequestList(requests or make_requests()))


def test_compiled_steps_give_the_eager_tokens_without_recompiling(target, counter):
    target._compiled_extend = None  # built with this test's backend
    _, eager = run_engine(target, "off")
    engine, run = run_engine(target, "on")
    assert engine.use_compile and not target._compiled_extend.failed
    assert tokens(run) == tokens(eager)
    # rows buckets 4, 2 and 1 and several key spans ran: one step program for 2+ rows, one for 1 row
    steps = step_graphs(target)
    assert 1 <= steps <= 2
    _, again = run_engine(target, "on", rows=3)  # another cache size, other buckets: no more step programs
    assert tokens(again) == tokens(eager)
    assert step_graphs(target) == steps


def test_the_decode_forward_is_one_graph(target_dir):
    """The forward scope's graph (the layer scope's: test_layer_scope_compiles_once_for_every_layer)."""
    target = BatchedTarget(target_dir, device="cpu", dtype="float32", compile_scope="forward")
    target.reset(4, 64)
    target.prefill([0, 1, 2, 3], [np.arange(10, 20)] * 4, features=False)
    with torch.inference_mode():
        explained = torch._dynamo.explain(target._extend)(torch.ones(4, 1, dtype=torch.long),
                                                          torch.full((4,), 10), 64, False)
    torch._dynamo.reset()
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons


def test_a_failing_compiler_falls_back_to_eager_once(target, monkeypatch, caplog):
    calls = []

    def broken_backend(gm, example_inputs):
        calls.append(1)
        raise RuntimeError("no kernel for this op")

    torch._dynamo.reset()
    monkeypatch.setattr(compiled, "BACKEND", broken_backend)
    target._compiled_extend = None
    _, eager = run_engine(target, "off")
    with caplog.at_level(logging.WARNING, logger="dflash_ipc.decode.compiled"):
        _, run = run_engine(target, "on")
    torch._dynamo.reset()
    assert tokens(run) == tokens(eager)
    # layer scope: the steps' layer, the prefills', the final norm's and the rotary table's
    compiled_functions = 4 if target.compile_scope == "layer" else 1
    assert target._compiled_extend.failed and len(calls) == compiled_functions
    warnings = [r for r in caplog.records if "torch.compile of the target's decode forward" in r.message]
    assert len(warnings) == compiled_functions and all("no kernel for this op" in w.message for w in warnings)
    target._compiled_extend = None


def test_a_layer_that_fails_on_layer_kv_too_runs_the_class_forward(layered_dirs, monkeypatch):
    """Layer scope: when the compile fails and layer_step's eager run fails as well (a layer
    that needs more of the Cache API than LayerKV has), the layers run their own forward."""
    def broken_backend(gm, example_inputs):
        raise RuntimeError("no kernel for this op")

    def broken_update(self, *args, **kwargs):
        raise AttributeError("LayerKV has no get_seq_length")

    target = BatchedTarget(layered_dirs[2], dtype="float32", compile_scope="layer")
    _, eager = run_engine(target, "off")
    torch._dynamo.reset()
    monkeypatch.setattr(compiled, "BACKEND", broken_backend)
    monkeypatch.setattr(compiled.LayerKV, "update", broken_update)
    _, run = run_engine(target, "on")
    torch._dynamo.reset()
    assert tokens(run) == tokens(eager) and target._compiled_extend.failed


def test_speculative_verify_compiled_equals_eager(target_dir, counter):
    from transformers import AutoConfig, AutoTokenizer

    from dflash_ipc.drafter.model import DFlashConfig, DFlashDraftModel
    from dflash_ipc.eval.decoding import SpeculativeDecoder
    from dflash_ipc.eval.drafter_context import DrafterContext

    config = DFlashConfig.from_target_config(AutoConfig.from_pretrained(target_dir), num_draft_layers=1, block_size=8,
                                             mask_token_id=AutoTokenizer.from_pretrained(target_dir).mask_token_id,
                                             target_layer_ids=[0])
    torch.manual_seed(2)
    model = DFlashDraftModel(config).eval()
    target = BatchedTarget(target_dir, layer_ids=model.config.target_layer_ids, device="cpu", dtype="float32")
    runs = {}
    for setting in ("off", "on"):
        decoder = SpeculativeDecoder(target, DrafterContext(model, target.head), batch_size=3, compile=setting)
        assert decoder.use_compile == (setting == "on")
        runs[setting] = {g.request.key: (g.tokens, g.stats) for g in decoder.run(RequestList(make_requests(6))).generations}
    assert runs["on"] == runs["off"]
    assert counter.frame_count >= 1


@pytest.mark.parametrize("num_layers", [2, 4])
def test_layer_scope_compiles_once_for_every_layer(layered_dirs, num_layers, counter):
    """Every layer runs the one compiled layer: as many graphs for 4 layers as for 2 (steps, and
    the one-row prefills of the refills; the first prefill allocates the storage eagerly), no
    recompile per layer index, no graph break."""
    target = BatchedTarget(layered_dirs[num_layers], device="cpu", dtype="float32", compile_scope="layer")
    torch._dynamo.utils.counters.clear()
    eager = run_engine(target, "off", rows=2, requests=make_requests(5))[1]
    run = run_engine(target, "on", rows=2, requests=make_requests(5))[1]
    assert not target._compiled_extend.failed
    assert tokens(run) == tokens(eager)
    # 3 layer graphs, and the final norm's and the rotary table's: one row, more rows
    assert counter.frame_count == 3 + 2 * 2
    assert not torch._dynamo.utils.counters["graph_break"]


def test_the_final_norm_and_rotary_table_compile_apart_from_the_layers(layered_dirs, counter, monkeypatch):
    """Layer scope: the stack's final norm and rotary table run compiled (EdgeForward) while a
    compiled forward runs, each a graph for one row and one for more, whatever the rows and
    tokens per row; $DFLASH_DECODE_COMPILE_EDGES=off runs them eagerly; a typo is an error."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    target = BatchedTarget(layered_dirs[2], device="cpu", dtype="float32", compile_scope="layer")
    eager = run_engine(target, "off", rows=2, requests=make_requests(5))[1]
    assert [e.name for e in target._compiled().edges] == ["norm", "rotary_emb"]
    monkeypatch.setenv(compiled.EDGES_ENV, "off")
    assert tokens(run_engine(target, "on", rows=2, requests=make_requests(5))[1]) == tokens(eager)
    edge_graphs = lambda: [len(_debug_get_cache_entry_list(f.__code__))  # noqa: E731
                           for f in (compiled.norm_step, compiled.rotary_step)]
    assert counter.frame_count == 3 and edge_graphs() == [0, 0]
    monkeypatch.setenv(compiled.EDGES_ENV, "auto")
    assert tokens(run_engine(target, "on", rows=4, requests=make_requests(9, seed=2))[1]) == tokens(
        run_engine(target, "off", rows=4, requests=make_requests(9, seed=2))[1])
    assert edge_graphs() == [2, 2]  # each: one row, more rows
    monkeypatch.setenv(compiled.EDGES_ENV, "sometimes")
    with pytest.raises(ConfigError, match="DFLASH_DECODE_COMPILE_EDGES='sometimes'; allowed"):
        run_engine(target, "on", rows=2, requests=make_requests(3))


def test_layer_scope_features_equal_eager(layered_dirs, counter):
    """The capture hooks run around the compiled layers: extend's features (and logits) as
    eager's; a prefill not asked to compile runs the same layers uncompiled."""
    target = BatchedTarget(layered_dirs[2], layer_ids=[0, 1], device="cpu", dtype="float32", compile_scope="layer")
    target.reset(3, 64)
    target.prefill([0, 1, 2], [np.arange(10, 10 + n) for n in (5, 9, 12)])
    lengths = torch.tensor([5, 9, 12])
    block = torch.arange(30, 42).reshape(3, 4)  # a verify pass's shape: q = 4 tokens per row
    eager = target.extend(block, lengths, 12, features=True)
    fused = target.extend(block, lengths, 12, features=True, compiled=True)
    assert fused[1].shape == (3, 4, 2 * target.hidden_size)
    torch.testing.assert_close(fused, eager)
    assert not target._compiled_extend.failed and counter.frame_count == 3  # the layer, the norm, the rotary table
    target.prefill([1], [np.arange(50, 57)])  # the same layers, eagerly: nothing compiled
    assert counter.frame_count == 3


def test_a_compiled_prefill_writes_and_returns_what_the_eager_one_does(layered_dirs, counter):
    """Under the layer scope a prefill runs the compiled layer: the logits, features and K/V
    writes of the eager prefill, left padding included; one graph for prompts of any width and
    rows, one more for a single row, none per layer."""
    targets = [BatchedTarget(layered_dirs[4], layer_ids=[1, 3], device="cpu", dtype="float32", compile_scope="layer")
               for _ in range(2)]
    eager, compiled_ = targets
    for target in targets:
        target.reset(3, 64)
        target.prefill([0, 1, 2], [np.arange(10, 10 + n) for n in (5, 9, 12)])  # allocates the storage: eager
    assert counter.frame_count == 0
    batches = [([0, 2], (7, 11)), ([1], (4,)), ([2, 0, 1], (13, 6, 20)), ([0], (17,))]
    for rows, widths in batches:
        prompts = [np.arange(30 + w, 30 + 2 * w) for w in widths]
        want = eager.prefill(rows, prompts)
        got = compiled_.prefill(rows, prompts, compiled=True)
        torch.testing.assert_close(got.logits, want.logits)
        torch.testing.assert_close(got.features, want.features)
    kv_eager, kv_compiled = eager.cache.kv, compiled_.cache.kv
    capacity = kv_eager.capacity  # the column past it is the pads' scratch slot, written in any order
    for layer in range(eager.num_layers):
        torch.testing.assert_close(kv_compiled.keys[layer][:, :capacity], kv_eager.keys[layer][:, :capacity])
        torch.testing.assert_close(kv_compiled.values[layer][:, :capacity], kv_eager.values[layer][:, :capacity])
    assert not compiled_._compiled_extend.failed
    assert counter.frame_count == 2 + 2  # the layer for rows 2+ of any width and for one row; the norm, the rotary
    assert not torch._dynamo.utils.counters["graph_break"]


def test_the_prefill_compile_switch(layered_dirs, counter, monkeypatch):
    """$DFLASH_DECODE_COMPILE_PREFILL=off keeps a compiled target's prefills eager; a typo is an error."""
    target = BatchedTarget(layered_dirs[2], device="cpu", dtype="float32", compile_scope="layer")
    target.reset(2, 64)
    target.prefill([0, 1], [np.arange(10, 15), np.arange(20, 29)])  # allocates the storage
    monkeypatch.setenv(compiled.PREFILL_ENV, "off")
    target.prefill([0], [np.arange(30, 41)], compiled=True)
    assert counter.frame_count == 0
    monkeypatch.setenv(compiled.PREFILL_ENV, "sometimes")
    with pytest.raises(ConfigError, match="DFLASH_DECODE_COMPILE_PREFILL='sometimes'; allowed"):
        target.prefill([0], [np.arange(30, 41)], compiled=True)
    monkeypatch.setenv(compiled.PREFILL_ENV, "auto")
    target.prefill([0], [np.arange(30, 41)], compiled=True)
    assert counter.frame_count == 3  # the layer, the final norm, the rotary table
    assert not compiled.prefill_compiled("forward")


def test_settings():
    assert not compile_enabled("auto", "cpu", graphs=False)
    assert compile_enabled("auto", "cuda:0", graphs=True) and not compile_enabled("auto", "cuda:0", graphs=False)
    assert compile_enabled("on", "cpu", graphs=False) and not compile_enabled("off", "cuda:0", graphs=True)
    with pytest.raises(ConfigError, match="compile='yes'; allowed"):
        EngineSettings(compile="yes")
    with pytest.raises(ConfigError, match="allowed"):
        compile_enabled("always", "cpu", graphs=False)
    assert compile_scope(None) == os.environ.get(SCOPE_ENV, "layer") and compile_scope("forward") == "forward"
    with pytest.raises(ConfigError, match="scope='model'"):
        compile_scope("model")
    assert os.environ.get("TORCHDYNAMO_DISABLE") != "1"  # the tests above would pass vacuously


def test_a_compiled_layer_writes_the_cache_slot_its_attention_names(layered_dirs):
    """The eager forward writes the slot of ``self_attn.layer_idx`` (HF attention passes it to
    Cache.update); the compiled layer must write the same one, not its list position."""
    from types import SimpleNamespace

    assert compiled.cache_index(SimpleNamespace(self_attn=SimpleNamespace(layer_idx=5)), 2) == 5
    assert compiled.cache_index(SimpleNamespace(), 2) == 2  # no attention index: the position
    target = BatchedTarget(layered_dirs[2], device="cpu", dtype="float32")
    layers = list(reversed(target.model.model.layers))  # list positions 0, 1 hold layer_idx 1, 0
    compiled.CompiledLayers(lambda *a: None, layers, torch.device("cpu"))
    assert [layer.forward.index for layer in layers] == [1, 0]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("scope", SCOPES)
def test_inductor_steps_in_cuda_graphs_match_eager(target_dir, dtype, scope):
    """CUDA: the compiled forward (Inductor, coordinate-descent-tuned) inside the captured steps
    against eager uncaptured steps; Inductor's reductions round differently, so a first
    difference must be a near-tie of both runs (eval/lossless.py's rule)."""
    from dflash_ipc.eval.lossless import compare

    torch._dynamo.reset()
    cuda = BatchedTarget(target_dir, device="cuda:0", dtype=dtype, compile_scope=scope)
    runs = {}
    for graphs, setting in (("off", "off"), ("on", "on")):
        engine = DecodeEngine(cuda, settings=EngineSettings(max_rows=4, check_every=3, graphs=graphs,
                                                            compile=setting, keep_margins=True))
        runs[setting] = {g.request.key: g for g in engine.run(RequestList(make_requests())).generations}
        if setting == "on":
            assert engine.graphs.enabled and engine.graphs.num_captures >= 2
            assert not cuda._compiled_extend.failed
    verdicts = [compare(runs["on"][k], runs["off"][k], dtype=getattr(torch, dtype)).verdict for k in runs["off"]]
    assert all(v in ("identical", "near_tie") for v in verdicts), verdicts
    assert verdicts.count("identical") >= len(verdicts) - 2
