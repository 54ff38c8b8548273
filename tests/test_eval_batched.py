"""Batched decoding on the tiny target (float32): per-row caches against full forwards, the cached
drafter against its training forward, and batched output equal to unbatched output token for token."""

import collections
import math

import numpy as np
import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from dflash_ipc.data.dataset import TokenDataset
from dflash_ipc.builtin.tiny import build_tiny_tokenizer
from dflash_ipc.eval.decoding import PlainDecoder, SpeculativeDecoder
from dflash_ipc.eval.drafter_context import DrafterContext
from dflash_ipc.eval.unbatched import DFlashProposer, TargetLM, speculative_generate
from dflash_ipc.eval.prompt_sets import held_out_prompts
from dflash_ipc.decode.graphs import StepGraphs
from dflash_ipc.decode.ragged_attention import band_mask, layer_masks
from dflash_ipc.decode.requests import Request, RequestList
from dflash_ipc.decode.target import BatchedTarget
from eval_helpers import LAYER_IDS, eval_data, memorising_drafter, random_drafter, reference_greedy

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def target(target_dir):
    return BatchedTarget(target_dir, layer_ids=LAYER_IDS, device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def requests(tiny_cache):
    """Ragged prompts and budgets: the 4 held-out-style prompts of the shared data (the
    memorising drafter knows their continuations) and random ones, a long one last (the
    caches must grow for it), budgets from 1 (prefill only) to 24."""
    data = held_out_prompts(TokenDataset(eval_data(str(tiny_cache))), num_prompts=4)
    rng = np.random.default_rng(7)
    prompts = [p for _, p in data] + [rng.integers(10, 1000, size=n) for n in (3, 11, 6, 40, 70)]
    budgets = [20, 24, 13, 16, 1, 12, 9, 18, 14]
    return [Request(key=(i, 0), prompt_ids=p, max_new_tokens=b) for i, (p, b) in enumerate(zip(prompts, budgets))]


def by_key(run):
    return {g.request.key: g for g in run.generations}


@torch.inference_mode()
def hf_forward(target, ids):
    """(logits [T, V], features [T, F]) of a plain cache-free HF forward (hidden_states[id + 1])."""
    out = target.model(input_ids=torch.tensor([ids]), output_hidden_states=True)
    return out.logits[0], torch.cat([out.hidden_states[i + 1][0] for i in LAYER_IDS], dim=-1)


def test_prefill_and_extend_equal_full_forwards(target):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(10, 1000, size=n) for n in (5, 12, 1)]
    more = torch.as_tensor(rng.integers(10, 1000, size=(3, 4)))
    target.reset(num_rows=4, capacity=40)
    out = target.prefill([2, 0, 3], prompts)  # rows out of order, row 1 left empty
    width = max(len(p) for p in prompts)
    for i, p in enumerate(prompts):
        logits, feats = hf_forward(target, p.tolist())
        torch.testing.assert_close(out.logits[i], logits[-1], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out.features[i, width - len(p):], feats, atol=1e-5, rtol=1e-5)
    lengths = torch.tensor([len(prompts[1]), 0, len(prompts[0]), len(prompts[2])])
    tokens = torch.zeros(4, 4, dtype=torch.long)
    tokens[[2, 0, 3]] = more
    logits, feats = target.extend(tokens, lengths, int(lengths.max()))
    for i, row in enumerate([2, 0, 3]):
        want_logits, want_feats = hf_forward(target, prompts[i].tolist() + more[i].tolist())
        torch.testing.assert_close(logits[row], want_logits[-4:], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(feats[row], want_feats[-4:], atol=1e-5, rtol=1e-5)


def test_sliding_window_layers_equal_transformers(tmp_path):
    """A target with sliding-window layers: the band masks reproduce transformers' own."""
    config = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, use_sliding_window=True,
                         sliding_window=4, max_window_layers=1, eos_token_id=None, bos_token_id=None)
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).save_pretrained(tmp_path)
    build_tiny_tokenizer().save_pretrained(tmp_path)
    target = BatchedTarget(str(tmp_path), layer_ids=[1], dtype="float32")
    assert "sliding_attention" in target.layer_types
    ids = [5, 9, 3, 22, 7, 1, 40, 11, 2, 30]
    target.reset(num_rows=1, capacity=32)
    first = target.prefill([0], [np.array(ids[:7])]).logits[0]
    logits, _ = target.extend(torch.tensor([ids[7:]]), torch.tensor([7]), 7)
    with torch.inference_mode():  # the same model through transformers' own masks
        want = target.model(input_ids=torch.tensor([ids])).logits[0]
    torch.testing.assert_close(first, want[6], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits[0], want[7:], atol=1e-5, rtol=1e-5)


def assert_prefill_and_extend_equal_transformers(target: BatchedTarget, target_dir: str) -> None:
    """Two rows prefilled (9 and 4 tokens) then extended (3 each) give the logits of transformers'
    own eager forward over the whole sequence."""
    from dflash_ipc.hf.text_stack import load_causal_lm

    plain = load_causal_lm(target_dir, dtype=torch.float32, attn_implementation="eager").eval()
    ids = [5, 9, 3, 22, 7, 1, 40, 11, 2, 30, 17, 8]
    target.reset(num_rows=2, capacity=32)
    first = target.prefill([0, 1], [np.array(ids[:9]), np.array(ids[:4])]).logits
    logits, _ = target.extend(torch.tensor([ids[9:], ids[4:7]]), torch.tensor([9, 4]), 9)
    with torch.inference_mode():
        want = plain(input_ids=torch.tensor([ids])).logits[0]
    torch.testing.assert_close(first[0], want[8], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(first[1], want[3], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits[0], want[9:12], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits[1], want[4:7], atol=1e-5, rtol=1e-5)


def test_attention_sinks_equal_transformers(tmp_path):
    """gpt-oss: learned attention sinks and alternating sliding/full layers, through the explicit
    attention path, reproduce transformers' own forward in prefill and extend."""
    from architectures import ARCHITECTURES, build_tiny_target_of, missing_reason

    arch = ARCHITECTURES["gpt_oss"]
    if missing_reason(arch):
        pytest.skip(missing_reason(arch))
    target_dir = build_tiny_target_of(arch, str(tmp_path))
    target = BatchedTarget(target_dir, layer_ids=[1], dtype="float32")
    assert {"sliding_attention", "full_attention"} <= set(target.layer_types)
    assert_prefill_and_extend_equal_transformers(target, target_dir)  # eager attention: sinks, by the book


def test_a_window_in_every_layer_equals_transformers(tmp_path):
    """Mistral: a sliding_window and no layer_types slides in every layer, as transformers runs it;
    prompts and extends longer than the window."""
    import dataclasses

    from architectures import ARCHITECTURES, build_tiny_target_of, missing_reason

    arch = ARCHITECTURES["mistral"]
    if missing_reason(arch):
        pytest.skip(missing_reason(arch))
    target_dir = build_tiny_target_of(dataclasses.replace(arch, text={"sliding_window": 3}), str(tmp_path))
    target = BatchedTarget(target_dir, dtype="float32")
    assert set(target.layer_types) == {"sliding_attention"} and target.sliding_window == 3
    assert_prefill_and_extend_equal_transformers(target, target_dir)


def test_recurrent_target_truncate_re_runs_the_kept_prefix(tmp_path, caplog):
    """A linear-attention target in the unbatched decoder: after a rejected draft is cut off, the
    next forward equals a full forward of the kept tokens (the batched target refuses it, and
    eval takes the unbatched one, greedy only)."""
    from dflash_ipc.errors import ConfigError
    from dflash_ipc.eval.sampling import Sampling
    from dflash_ipc.eval.speculative import EvalOptions, load_target
    from architectures import ARCHITECTURES, build_tiny_target_of, missing_reason

    arch = ARCHITECTURES["qwen3_next"]
    if missing_reason(arch):
        pytest.skip(missing_reason(arch))
    target_dir = build_tiny_target_of(arch, str(tmp_path))
    with pytest.raises(ConfigError, match="linear-attention"):
        BatchedTarget(target_dir, layer_ids=[1], dtype="float32")
    with pytest.raises(ConfigError, match="one prompt at a time, greedy only; got temperature=0.7"):
        load_target(target_dir, [1], device="cpu", dtype="float32",
                    options=EvalOptions(sampling=Sampling(temperature=0.7)))
    lm = load_target(target_dir, [1], device="cpu", dtype="float32", options=EvalOptions())
    assert isinstance(lm, TargetLM) and "--batch-size is not used" in caplog.text
    ids = [5, 9, 3, 22, 7, 1, 40, 11]
    lm.prefill(torch.tensor(ids[:5]))
    lm.extend(torch.tensor([50, 51, 52]))  # a draft, rejected
    lm.truncate(5)
    got, feats = lm.extend(torch.tensor(ids[5:]))
    with torch.inference_mode():
        want = lm.model(input_ids=torch.tensor([ids])).logits[0, 5:].argmax(-1)
    assert lm.cached_length == len(ids) and feats.shape[0] == 3
    assert got.tolist() == want.tolist()


def test_band_masks():
    lo, hi = torch.tensor([[0, 2]]), torch.tensor([[3, 5]])
    assert band_mask(lo, hi, 6)[0, 0].int().tolist() == [[1, 1, 1, 0, 0, 0], [0, 0, 1, 1, 1, 0]]
    sliding = layer_masks(["sliding_attention"], 2, lo, hi, 6)["sliding_attention"][0, 0]
    assert sliding.int().tolist() == [[0, 1, 1, 0, 0, 0], [0, 0, 0, 1, 1, 0]]


@pytest.mark.parametrize("window,fused", [(None, False), (6, False), (11, False), (None, True), (6, True)])
def test_drafter_context_equals_the_training_forward(target_dir, legacy, window, fused):
    """Context appended in pieces (a prefill, then verified blocks), blocks drafted for several
    rows at once: the block's hidden states are those of the model's own (training) forward;
    also with a sliding_attention layer (windows below and above the block size), and with each
    layer's products over its concatenated weights (what CUDA runs; here through F.linear)."""
    from dflash_ipc.eval.drafter_projections import FusedProjections, layer_projections

    kinds = None if window is None else ["sliding_attention", "full_attention"]
    model = random_drafter(target_dir, seed=3, block_size=8, layer_types=kinds, sliding_window=window)
    context = DrafterContext(model, legacy.head)
    if fused:
        context.projections = layer_projections(model.layers, kernels=True)
        assert all(type(p) is FusedProjections for p in context.projections)
        attn = model.layers[0].self_attn  # its weights now rows of one tensor
        assert attn.k_proj.weight.data_ptr() == context.projections[0].w_kv.data_ptr()
    proposer = DFlashProposer(model, legacy.head)
    rng = np.random.default_rng(1)
    seqs = [torch.as_tensor(rng.integers(10, 1000, size=n)) for n in (12, 30, 7)]
    feats = [legacy.prefill(s)[1] for s in seqs]
    context.reset(num_rows=3, capacity=48)
    for row, f in enumerate(feats):
        first = min(len(f), 5)
        pos = torch.arange(first)[None]
        context.append(torch.tensor([row]), f[None, :first], pos, pos)
        for lo in range(first, len(f), 8):  # the rest as verify passes of up to 8 positions
            pos = torch.arange(lo, min(lo + 8, len(f)))[None]
            context.append(torch.tensor([row]), f[None, lo: lo + 8], pos, pos)
    starts, anchors = torch.tensor([5, 29, 7]), torch.tensor([int(seqs[0][5]), int(seqs[1][29]), 77])
    got = context.draft_hidden(anchors, starts, max_start=29)
    for row in range(3):
        want = proposer.block_hidden(feats[row][: starts[row]], int(anchors[row]))
        torch.testing.assert_close(got[row], want, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("trained", [False, True])
def test_batched_equals_unbatched_token_for_token(tiny_cache, target_dir, target, legacy, requests, trained):
    """Every batch size gives the same tokens and the same acceptance counters per prompt, equal to
    the unbatched reference decoder (unbatched.py) and to greedy decoding by full recomputation."""
    model = memorising_drafter(str(tiny_cache)) if trained else random_drafter(target_dir, seed=1, num_layers=1)
    runs = {}
    for batch_size in (1, 3, 8):
        decoder = SpeculativeDecoder(target, DrafterContext(model, target.head), batch_size=batch_size)
        runs[batch_size] = by_key(decoder.run(RequestList(requests)))
        if batch_size == 8:
            assert len(decoder.slots) < 8  # the tail ran on compacted caches
    plain = by_key(PlainDecoder(target, batch_size=4).run(RequestList(requests)))
    proposer = DFlashProposer(model, legacy.head)
    accepted = 0
    for r in requests:
        want = reference_greedy(target, r.prompt_ids, r.max_new_tokens)
        unbatched = speculative_generate(legacy, proposer, r.prompt_ids, max_new_tokens=r.max_new_tokens)
        assert unbatched.output_ids == plain[r.key].tokens == want, r.key
        for batch_size, gens in runs.items():
            assert gens[r.key].tokens == want, (batch_size, r.key)
            assert gens[r.key].stats == unbatched.stats, (batch_size, r.key)
        accepted += unbatched.stats.num_committed - unbatched.stats.num_cycles
    assert (accepted > 20) == trained  # the trained drafter's blocks commit several tokens


class OracleDrafter:
    """Stands in for DrafterContext: drafts each row's true greedy continuation for the first
    ``num_correct`` block positions and a wrong token after them (it reads the row's request
    from the decoder, so it follows rows through refills and compaction)."""

    class _NoCache:
        capacity = 1 << 30  # no context of its own: the target's cache bounds the cycles

        def grow(self, capacity):
            pass

        def select_rows(self, keep):
            pass

    def __init__(self, truth: dict, *, block_size: int, num_correct: int, vocab_size: int) -> None:
        self.truth, self.block_size, self.num_correct, self.vocab_size = truth, block_size, num_correct, vocab_size
        self.kv, self.decoder = self._NoCache(), None

    def reset(self, num_rows, capacity):
        pass

    def append(self, rows, features, write_pos, positions):
        pass

    def draft_logits(self, anchors, starts, max_start):
        bs = self.block_size
        out = torch.zeros(len(anchors), bs - 1, self.vocab_size)
        for row, gen in enumerate(self.decoder.slots):
            if gen is None:
                continue
            full, s = self.truth[gen.request.key], int(starts[row])
            for k in range(bs - 1):
                tok = full[s + 1 + k] if s + 1 + k < len(full) else 7
                out[row, k, tok if k < self.num_correct else (tok + 1) % self.vocab_size] = 10.0
        return out


@pytest.mark.parametrize("num_correct", [15, 4])
def test_oracle_blocks_commit_in_a_batch(target, requests, num_correct):
    """A drafter right on its first ``num_correct`` positions: in a batch of ragged rows every
    cycle of a row accepts exactly those and commits one more, and the output stays greedy."""
    truth = {r.key: r.prompt_ids.tolist() + reference_greedy(target, r.prompt_ids, r.max_new_tokens)
             for r in requests}
    oracle = OracleDrafter(truth, block_size=16, num_correct=num_correct, vocab_size=target.head.vocab_size)
    decoder = SpeculativeDecoder(target, oracle, batch_size=4)
    oracle.decoder = decoder
    forwards = target.num_forwards
    run = decoder.run(RequestList(requests))
    assert run.num_target_forwards == target.num_forwards - forwards
    for gen in run.generations:
        r, s = gen.request, gen.stats
        assert gen.tokens == truth[r.key][r.prompt_ids.size:]
        if not gen.stopped:
            assert s.num_cycles == math.ceil((len(gen.tokens) - 1) / (num_correct + 1))
            drafted = [k for k, d in enumerate(s.drafted_at) if d]
            assert all(s.acceptance_per_position[k] == (1.0 if k < num_correct else 0.0) for k in drafted)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graphed_speculative_cycles_equal_eager_ones_and_plain_decoding(target_dir, requests):
    """float32 on CUDA: the speculative cycle as CUDA graphs gives the tokens and acceptance
    counters of the eager cycle, batch 1 and batched, and the tokens of plain decoding. The
    graphs read a bucketed key span (the eager cycle: the span rounded up to 16), so a GPU
    reduction may split a near-tie; the lossless rule (lossless.compare) tells one apart."""
    from dflash_ipc.eval.lossless import compare

    cuda = BatchedTarget(target_dir, layer_ids=LAYER_IDS, device="cuda:0", dtype="float32")
    model = random_drafter(target_dir, seed=1, num_layers=1).to("cuda:0")
    plain = by_key(PlainDecoder(cuda, batch_size=4).run(RequestList(requests)))
    for batch_size in (1, 3):
        runs = {}
        for graphs in ("off", "on"):
            decoder = SpeculativeDecoder(cuda, DrafterContext(model, cuda.head), batch_size=batch_size, graphs=graphs)
            runs[graphs] = by_key(decoder.run(RequestList(requests)))
            if graphs == "on":
                assert decoder.graphs.enabled and decoder.graphs.num_captures >= 1
        identical = 0
        for r in requests:
            on, off = runs["on"][r.key], runs["off"][r.key]
            for other in (off, plain[r.key]):
                assert compare(on, other, dtype=torch.float32).verdict in ("identical", "near_tie"), (batch_size, r.key)
            if on.tokens == off.tokens:
                identical += 1
                assert on.stats == off.stats, (batch_size, r.key)
        assert identical >= len(requests) - 1


@pytest.mark.parametrize("batch_size", [1, 3])
def test_cycles_run_ahead_give_the_tokens_of_one_cycle_at_a_time(target_dir, target, batch_size):
    """Greedy cycles queued one ahead of the host's commit (the next inputs left on the device)
    give the tokens, margins and acceptance counters of cycles committed one at a time, through
    rows that stop (their share of the cycle ahead discarded), refills and budget ends."""
    model = random_drafter(target_dir, seed=1, num_layers=1)
    rng = np.random.default_rng(3)
    requests = [Request(key=(i, 0), prompt_ids=rng.integers(10, 1000, size=int(n)), max_new_tokens=int(b))
                for i, (n, b) in enumerate(zip(rng.integers(3, 40, size=7), rng.integers(30, 90, size=7)))]

    def run(run_ahead, stops=None):
        decoder = SpeculativeDecoder(target, DrafterContext(model, target.head), batch_size=batch_size,
                                     run_ahead=run_ahead)
        if stops is not None:
            decoder.stops = stops
        return decoder, by_key(decoder.run(RequestList(requests)))

    _, free = run(False)
    counts = collections.Counter(t for g in free.values() for t in g.tokens[5:])
    stops = {counts.most_common(1)[0][0]}  # a token the target makes often: some rows stop early
    for stop_set in (set(target.stop_token_ids), stops):
        one_at_a_time = run(False, stop_set)[1]
        decoder, ahead = run(True, stop_set)
        assert decoder.num_ahead > 0
        for key, gen in one_at_a_time.items():
            assert ahead[key].tokens == gen.tokens and ahead[key].stats == gen.stats, key
            assert ahead[key].margins == gen.margins and ahead[key].stopped == gen.stopped
    assert any(g.stopped for g in one_at_a_time.values())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graphed_cycles_run_ahead_match_one_cycle_at_a_time(target_dir):
    """float32 on CUDA, the cycle a CUDA graph: queued one ahead (its inputs the last replay's
    outputs, its results through a pinned buffer) against committed one at a time. The cycle
    ahead may read a larger key span bucket, so a near-tie may split (lossless.compare)."""
    from dflash_ipc.eval.lossless import compare

    cuda = BatchedTarget(target_dir, layer_ids=LAYER_IDS, device="cuda:0", dtype="float32")
    model = random_drafter(target_dir, seed=1, num_layers=1).to("cuda:0")
    rng = np.random.default_rng(3)
    requests = [Request(key=(i, 0), prompt_ids=rng.integers(10, 1000, size=int(n)), max_new_tokens=int(b))
                for i, (n, b) in enumerate(zip(rng.integers(3, 40, size=7), rng.integers(30, 90, size=7)))]
    for batch_size in (1, 3):
        runs = {}
        for run_ahead in (False, True):
            decoder = SpeculativeDecoder(cuda, DrafterContext(model, cuda.head), batch_size=batch_size, graphs="on",
                                         run_ahead=run_ahead)
            runs[run_ahead] = by_key(decoder.run(RequestList(requests)))
            assert decoder.graphs.enabled and (decoder.num_ahead > 0) == run_ahead
        verdicts = [compare(runs[True][r.key], runs[False][r.key], dtype=torch.float32).verdict for r in requests]
        assert all(v in ("identical", "near_tie") for v in verdicts), (batch_size, verdicts)
        assert verdicts.count("identical") >= len(requests) - 1


class _EagerReplay:
    def __init__(self, step, shape):
        self.step, self.shape = step, shape

    def replay(self):
        self.step(*self.shape)


class EagerGraphs(StepGraphs):
    """StepGraphs' bookkeeping on the CPU: a shape is 'captured' as a capture does it (the step
    run once with the state saved and put back), a 'replay' runs the step again."""

    def __init__(self, step):
        super().__init__(step, [], enabled=True)

    def _capture(self, shape):
        saved = [t.clone() for t in self.state]
        self.step(*shape)
        for t, v in zip(self.state, saved):
            t.copy_(v)
        self.graphs[shape] = _EagerReplay(self.step, shape)
        self.num_captures += 1
        return self.graphs[shape]


def test_the_graph_path_runs_ahead_through_stops_and_a_growing_cache(target_dir, target):
    """The graphed cycle's bookkeeping (static inputs the cycle rewrites, restored around a
    capture's warm-up; a cycle ahead from them; graphs dropped when the caches grow for a long
    prompt admitted while a cycle is ahead) with the replays run eagerly: the tokens and
    counters of one cycle at a time."""
    model = random_drafter(target_dir, seed=1, num_layers=1)
    rng = np.random.default_rng(5)
    requests = [Request(key=(0, 0), prompt_ids=rng.integers(10, 1000, size=5), max_new_tokens=80),
                Request(key=(1, 0), prompt_ids=rng.integers(10, 1000, size=6), max_new_tokens=120),
                Request(key=(2, 0), prompt_ids=rng.integers(10, 1000, size=300), max_new_tokens=1),
                Request(key=(3, 0), prompt_ids=rng.integers(10, 1000, size=9), max_new_tokens=60)]

    grew_while_ahead = []

    def run(run_ahead, stops=None):
        decoder = SpeculativeDecoder(target, DrafterContext(model, target.head), batch_size=2, run_ahead=run_ahead)
        decoder.graphs = EagerGraphs(decoder._graphed_cycle)
        if stops is not None:
            decoder.stops = stops
        grow = decoder._grow

        def watched_grow(capacity):
            grew_while_ahead.append(decoder._ahead is not None)
            grow(capacity)
        decoder._grow = watched_grow
        return decoder, by_key(decoder.run(RequestList(requests)))

    _, free = run(False)
    counts = collections.Counter(t for g in free.values() for t in g.tokens[5:])
    stops = {counts.most_common(1)[0][0]}
    one_at_a_time = run(False, stops)[1]
    grew_while_ahead.clear()
    decoder, ahead = run(True, stops)
    assert decoder.num_ahead > 0 and any(grew_while_ahead)  # the caches grew with a cycle ahead in flight
    assert any(g.stopped for g in one_at_a_time.values())
    for key, gen in one_at_a_time.items():
        assert ahead[key].tokens == gen.tokens and ahead[key].stats == gen.stats, key


def test_release_frees_the_graphs_and_caches_at_once_and_the_next_run_builds_them_again(target_dir, target):
    """A released speculative decoder gives up its graphs without the garbage collector (a graph
    the collector frees inside another capture breaks it), its caches and static buffers too,
    and runs again as a fresh decoder does; one merely dropped keeps its graphs in a cycle."""
    import gc
    import weakref

    model = random_drafter(target_dir, seed=1, num_layers=1)
    rng = np.random.default_rng(11)
    requests = [Request(key=(i, 0), prompt_ids=rng.integers(10, 1000, size=n), max_new_tokens=40)
                for i, n in enumerate((5, 9, 14))]

    def decoder():
        made = SpeculativeDecoder(target, DrafterContext(model, target.head), batch_size=2)
        made.graphs = EagerGraphs(made._graphed_cycle)
        return made

    gc.disable()
    try:
        released = decoder()
        first = by_key(released.run(RequestList(requests)))
        graphs = [weakref.ref(g) for g in released.graphs.graphs.values()]
        assert graphs and released.target.cache is not None and released.drafter.kv is not None
        released.release()
        assert all(g() is None for g in graphs)  # freed at once, no collection
        assert released.target.cache is None and released.drafter.kv is None and not released._static
        again = by_key(released.run(RequestList(requests)))
        assert {k: g.tokens for k, g in again.items()} == {k: g.tokens for k, g in first.items()}

        dropped = decoder()
        dropped.run(RequestList(requests))
        kept = [weakref.ref(g) for g in dropped.graphs.graphs.values()]
        del dropped
        assert all(g() is not None for g in kept)  # alive until the collector runs
    finally:
        gc.enable()
    gc.collect()
    assert all(g() is None for g in kept)
