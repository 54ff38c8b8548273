"""Prefills replayed as CUDA graphs (decode/prefill_graphs.py).

On the CPU: the width buckets; a prefill padded to a bucket (pad tokens on the left, pad rows of
length 0) writes and returns what the unpadded one does; and the decoders' bookkeeping around
the graphs, with each "graph" run eagerly (EagerGraphs): the same tokens and acceptance counters
as without, the shapes it captured, the prefills it leaves uncaptured. On a GPU: a replay
against the uncaptured forward of the same inputs, bit for bit, and whole decodes with the
switch on and off."""

import numpy as np
import pytest
import torch

from dflash_ipc.decode import engine as engine_module
from dflash_ipc.decode import prefill_graphs
from dflash_ipc.decode.engine import DecodeEngine, EngineSettings
from dflash_ipc.decode.prefill_graphs import PREFILL_GRAPHS_ENV, PrefillGraphs, rows_bucket, width_bucket
from dflash_ipc.decode.requests import RequestList
from dflash_ipc.decode.target import BatchedTarget, pack_prompts, unpack_prompts
from dflash_ipc.eval.decoding import PlainDecoder, SpeculativeDecoder
from dflash_ipc.eval.drafter_context import DrafterContext
from dflash_ipc.data.dataset import TokenDataset
from dflash_ipc.decode.requests import Request
from dflash_ipc.eval.prompt_sets import held_out_prompts
from decode_switch_helpers import check_switch_setting, make_requests
from eval_helpers import LAYER_IDS, eval_data, memorising_drafter, random_drafter

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def target(target_dir):
    return BatchedTarget(target_dir, layer_ids=LAYER_IDS, device="cpu", dtype="float32")


class EagerGraphs:
    """decode/graphs.py StepGraphs' interface with every run eager: a shape counts as captured
    the first time it runs."""

    def __init__(self, step, state, *, enabled, name="step"):
        self.step, self.enabled, self.shapes, self.num_captures = step, enabled, [], 0

    def run(self, shape):
        if shape not in self.shapes:
            self.shapes.append(shape)
            self.num_captures += 1
        self.step(*shape)

    def clear(self):
        self.shapes = []


@pytest.fixture()
def eager_graphs(monkeypatch):
    monkeypatch.setattr(prefill_graphs, "StepGraphs", EagerGraphs)
    monkeypatch.setattr(engine_module, "prefill_graphs_enabled", lambda device: True)
    monkeypatch.setattr(engine_module, "StepGraphs", EagerGraphs)


def test_buckets():
    widths = [width_bucket(n) for n in range(1, 3000)]
    assert widths[:65:16] == [16, 32, 48, 64, 96]
    assert sorted(set(widths))[:12] == [16, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024]
    for n, w in enumerate(widths, start=1):
        assert n <= w <= max(16 * -(-n // 16), 3 * n // 2 + 1), n  # at most 16 tokens or half again
    assert widths == sorted(widths)
    assert [rows_bucket(n) for n in (1, 2, 3, 4, 5, 9)] == [1, 2, 4, 4, 8, 16]


def test_the_switch(monkeypatch):
    check_switch_setting(monkeypatch, PREFILL_GRAPHS_ENV, prefill_graphs.enabled)


def test_a_prefill_padded_to_a_bucket_writes_and_returns_the_unpadded_one(target):
    """Left pads up to the bucket and a pad row of length 0 (its cache row the first one's):
    the real rows' logits, features and K/V are the unpadded prefill's; the pad row writes only
    the scratch slot."""
    rng = np.random.default_rng(3)
    prompts = [rng.integers(10, 1000, size=n) for n in (5, 12)]
    target.reset(num_rows=4, capacity=48)
    want = target.prefill([2, 0], prompts)
    kv = target.cache.kv
    want_kv = [t[:, : kv.capacity].clone() for t in kv.keys + kv.values]
    target.reset(num_rows=4, capacity=48)
    width = width_bucket(12)
    packed = torch.from_numpy(pack_prompts(prompts, width, [2, 0, 2, 2]))
    ids, lengths, rows = unpack_prompts(packed, 4, width)
    assert ids.is_contiguous() and lengths.tolist() == [5, 12, 0, 0] and rows.tolist() == [2, 0, 2, 2]
    assert ids[0, -5:].tolist() == prompts[0].tolist() and not ids[0, :-5].any() and not ids[2:].any()
    got = target.prefill_packed(ids, lengths, rows)
    torch.testing.assert_close(got.logits[:2], want.logits, atol=1e-5, rtol=1e-5)
    for i, p in enumerate(prompts):
        torch.testing.assert_close(got.features[i, -len(p):], want.features[i, -len(p):], atol=1e-5, rtol=1e-5)
    assert torch.isfinite(got.logits).all()  # the pad rows see themselves: no all-masked NaN
    kv = target.cache.kv
    for got_t, want_t in zip(kv.keys + kv.values, want_kv):
        torch.testing.assert_close(got_t[:, : kv.capacity], want_t, atol=1e-5, rtol=1e-5)


def test_shapes_past_the_limits_are_not_captured(target):
    graphs = PrefillGraphs(target, lambda *a: None, lambda: True, enabled=True, max_tokens=256, max_graphs=2)
    assert graphs.shape(1, 200) == (1, 256) and graphs.shape(3, 40) == (4, 48)
    assert graphs.shape(2, 200) is None  # 2 x 256 padded tokens
    graphs._inputs = {(1, 256): None, (4, 48): None}
    assert graphs.shape(1, 250) == (1, 256) and graphs.shape(1, 20) is None  # a third shape
    assert PrefillGraphs(target, lambda *a: None, lambda: True, enabled=False).shape(1, 20) is None


def engine_tokens(target, requests, *, prefill_graphs_on: bool):
    engine = DecodeEngine(target, settings=EngineSettings(max_rows=4, check_every=3, refill_rows=2, graphs="off"))
    if prefill_graphs_on:
        engine.use_graphs = True  # EagerGraphs for the steps and the prefills
    run = engine.run(RequestList(requests))
    return engine, run, {g.request.key: g.tokens for g in run.generations}


def test_the_engine_through_prefill_graphs(target_dir, eager_graphs, monkeypatch):
    """The engine with its prefills through PrefillGraphs (run eagerly): the same tokens; the
    first prefill of a cache runs once before its capture (it allocates the storage), and one of
    more padded tokens than the limit runs uncaptured."""
    target = BatchedTarget(target_dir, device="cpu", dtype="float32")
    requests = make_requests(11, max_len=40, max_new=12)  # the first 4 rows: 4 x 48 padded tokens
    requests[-1].prompt_ids = np.arange(10, 210)  # 1 x 256
    _, _, want = engine_tokens(target, requests, prefill_graphs_on=False)
    monkeypatch.setattr(prefill_graphs, "GRAPH_TOKENS", 192)
    orig_body = DecodeEngine._prefill_body
    bodies = []
    monkeypatch.setattr(DecodeEngine, "_prefill_body", lambda self, *a: bodies.append(
        (self.prefill_graphs.graphs.num_captures, self.kv.keys[-1] is not None)) or orig_body(self, *a))
    engine, run, got = engine_tokens(target, requests, prefill_graphs_on=True)
    assert got == want
    graphs = engine.prefill_graphs
    shapes = graphs.graphs.shapes
    assert shapes and all(r * w <= 192 and w == width_bucket(w) and r == rows_bucket(r) for r, w in shapes)
    assert 0 < graphs.num_replays == run.stats.prefills - 1  # the widest prefill: uncaptured
    assert run.stats.captures >= len(shapes)
    assert bodies[:2] == [(0, False), (1, True)]  # the first: once to allocate, then in its "capture"


def test_the_speculative_decoder_through_prefill_graphs(tiny_cache, target, eager_graphs):
    """Its prefills and their drafter context through PrefillGraphs (run eagerly; every prefill,
    the first admission of 3 rows as 4 too), with a drafter that knows the prompts'
    continuations: the tokens and acceptance counters of the decoder without, the forwards
    counted alike."""
    model = memorising_drafter(str(tiny_cache))
    data = held_out_prompts(TokenDataset(eval_data(str(tiny_cache))), num_prompts=4)
    requests = [Request(key=(i, 0), prompt_ids=p, max_new_tokens=b) for i, ((_, p), b) in enumerate(zip(data, (20, 24, 13, 16)))]
    requests += [Request(key=(10 + i, 0), prompt_ids=r.prompt_ids, max_new_tokens=r.max_new_tokens)
                 for i, r in enumerate(make_requests(3, seed=4, max_len=30, max_new=12))]
    plain = {g.request.key: g.tokens for g in PlainDecoder(target, batch_size=3).run(RequestList(requests)).generations}
    runs, graphs = {}, None
    for on in (False, True):
        decoder = SpeculativeDecoder(target, DrafterContext(model, target.head), batch_size=3)
        if on:
            graphs = decoder.prefill_graphs = PrefillGraphs(target, decoder._prefill_body, lambda: True, enabled=True)
        run = decoder.run(RequestList(requests))
        runs[on] = ({g.request.key: (g.tokens, g.stats) for g in run.generations}, run.num_target_forwards)
    assert runs[True] == runs[False]
    assert {k: tokens for k, (tokens, _) in runs[True][0].items()} == plain
    committed = sum(s.num_committed - s.num_cycles for _, s in runs[True][0].values())
    assert committed > 20  # the drafter's blocks were accepted: its context was right
    assert graphs.num_replays >= 5 and graphs.graphs.num_captures >= 2


def test_a_speculative_cache_that_grows_drops_the_prefill_graphs(target_dir, target, eager_graphs):
    """A prompt longer than the caches makes them grow (reallocate): the graphs that held the old
    ones are forgotten."""
    model = random_drafter(target_dir, seed=1, num_layers=1)
    decoder = SpeculativeDecoder(target, DrafterContext(model, target.head), batch_size=1)
    checks = []  # _caches_allocated's answers
    decoder.prefill_graphs = PrefillGraphs(target, decoder._prefill_body,
                                           lambda: checks.append(decoder._caches_allocated()) or checks[-1],
                                           enabled=True)
    cleared = []  # the target's cache capacity at each clear
    decoder.prefill_graphs.clear = lambda: cleared.append(target.capacity)
    requests = make_requests(3, max_len=12, max_new=4)
    requests[-1].prompt_ids = np.arange(10, 110)
    decoder.run(RequestList(requests))
    assert cleared[0] < 100 <= cleared[-1]  # the first cache's, then the grown one's
    # the first prefill of each cache found it unallocated (and ran once before its capture); the grown
    # caches keep their storage (RowKV.grow copies it), so the prefill that grew them found it allocated
    assert checks == [False, True, True]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_replayed_prefill_equals_the_uncaptured_one(tmp_path):
    """bf16, the compiled layers: each replay gives the logits and K/V of the same inputs run
    uncaptured, bit for bit, for prompts new to the graph (its inputs are copied in each time)."""
    from dflash_ipc.bench.assets import build_random_target

    path = str(tmp_path / "target")
    build_random_target(path, shape="tiny", dtype="bfloat16", num_layers=2, seed=5)
    target = BatchedTarget(path, device="cuda:0", dtype="bfloat16")
    target.reset(num_rows=4, capacity=256)
    rng = np.random.default_rng(0)
    target.prefill([0], [rng.integers(10, 1000, size=9)], compiled=True)  # allocates the storage

    def body(ids, lengths, rows):
        return target.prefill_packed(ids, lengths, rows, features=False, compiled=True).logits

    graphs = PrefillGraphs(target, body, lambda: True, enabled=True)
    kv = target.cache.kv
    for rows, sizes in (([1], (70,)), ([2], (90,)), ([3, 0], (20, 33)), ([1], (65,))):  # widths 96, 96, 48, 96
        prompts = [rng.integers(10, 1000, size=n) for n in sizes]
        shape = graphs.shape(len(rows), max(sizes))
        packed = torch.from_numpy(pack_prompts(prompts, shape[1], [*rows, *[rows[0]] * (shape[0] - len(rows))]))
        with torch.inference_mode():  # as the decoders run (the cache holds inference tensors)
            got = graphs(rows, prompts)
            got_kv = [t.clone() for t in kv.keys + kv.values]
            want = body(*unpack_prompts(packed.cuda(), *shape))[: len(rows)]
        torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)  # not another prompt's logits
        assert torch.equal(got, want), (rows, sizes)
        for got_t, want_t in zip(got_kv, kv.keys + kv.values):
            assert torch.equal(got_t[:, : kv.capacity], want_t[:, : kv.capacity])
    assert not target._compiled_extend.failed
    assert graphs.graphs.enabled and graphs.num_captures == 2 and graphs.num_replays == 4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("decoder", ["plain", "speculative"])
def test_decodes_with_prefill_graphs_equal_those_without(target_dir, monkeypatch, decoder):
    """float32 on CUDA, graphs and the compiled layers: the switch on against off gives the same
    tokens (or a near-tie, eval/lossless.py's rule: a padded prefill's products are of other shapes)."""
    from dflash_ipc.eval.lossless import compare

    requests = make_requests(9, max_len=60, max_new=24)
    runs = {}
    for setting in ("off", "auto"):
        monkeypatch.setenv(PREFILL_GRAPHS_ENV, setting)
        torch._dynamo.reset()
        cuda = BatchedTarget(target_dir, layer_ids=LAYER_IDS, device="cuda:0", dtype="float32")
        if decoder == "plain":
            dec = PlainDecoder(cuda, batch_size=3, keep_cache=True)
            runs[setting] = {g.request.key: g for g in dec.run(RequestList(requests)).generations}
            graphs = dec.engine.prefill_graphs
        else:
            model = random_drafter(target_dir, seed=1, num_layers=1).to("cuda:0")
            dec = SpeculativeDecoder(cuda, DrafterContext(model, cuda.head), batch_size=3)
            runs[setting] = {g.request.key: g for g in dec.run(RequestList(requests)).generations}
            graphs = dec.prefill_graphs
        assert (graphs.num_captures > 0) == (setting == "auto")
    verdicts = [compare(runs["auto"][k], runs["off"][k], dtype=torch.float32).verdict for k in runs["off"]]
    assert all(v in ("identical", "near_tie") for v in verdicts), verdicts
    assert verdicts.count("identical") >= len(verdicts) - 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_decoders_taking_turns_on_one_target_keep_their_graphs_right(target_dir):
    """A plain decoder that keeps its cache and a speculative one, in turns on one target (what
    bench eval and benchmarks/cycle_switch.py do): each run's prefills write the cache it runs on,
    so every run gives the first run's tokens."""
    requests = make_requests(5, max_len=60, max_new=16)
    cuda = BatchedTarget(target_dir, layer_ids=LAYER_IDS, device="cuda:0", dtype="float32")
    model = random_drafter(target_dir, seed=1, num_layers=1).to("cuda:0")
    plain = PlainDecoder(cuda, batch_size=1, keep_cache=True)
    speculative = SpeculativeDecoder(cuda, DrafterContext(model, cuda.head), batch_size=1)
    runs = {"plain": [], "speculative": []}
    for _ in range(2):
        for name, decoder in (("speculative", speculative), ("plain", plain)):
            runs[name].append({g.request.key: g.tokens for g in decoder.run(RequestList(requests)).generations})
    assert runs["plain"][0] == runs["plain"][1] and runs["speculative"][0] == runs["speculative"][1]
    assert plain.engine.prefill_graphs.num_captures > 0 and speculative.prefill_graphs.num_captures > 0
    plain.release()
