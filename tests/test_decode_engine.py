"""The decoding core on the tiny target (float32, CPU): greedy equals transformers' generate token
for token whatever the rows, refills and checks; continuous batching saves steps; sampling is
per request, not per batch; CUDA graphs replay the eager step exactly (GPU)."""

import numpy as np
import pytest
import torch

from dflash_ipc.decode.engine import DecodeEngine, EngineSettings, rows_bucket, span_bucket
from dflash_ipc.decode.sampler import TokenChoice
from dflash_ipc.errors import ConfigError
from dflash_ipc.decode.requests import Request, RequestList
from dflash_ipc.decode.target import BatchedTarget
from decode_switch_helpers import make_requests

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def target(target_dir):
    return BatchedTarget(target_dir, device="cpu", dtype="float32")


@torch.inference_mode()
def hf_generate(target, request):
    """transformers' generate on one prompt (no padding), greedy, cut after its first stop token."""
    ids = torch.as_tensor(request.prompt_ids)[None]
    out = target.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                max_new_tokens=request.max_new_tokens, eos_token_id=sorted(target.stop_token_ids),
                                pad_token_id=0)
    new = out[0, ids.shape[1]:].tolist()
    cut = next((k for k, t in enumerate(new) if t in target.stop_token_ids), None)
    return new if cut is None else new[: cut + 1]


@pytest.fixture(scope="module")
def reference(target):
    return {r.key: hf_generate(target, r) for r in make_requests()}


def tokens(run):
    return {g.request.key: g.tokens for g in run.generations}


@pytest.mark.parametrize("max_rows,check_every,continuous", [(4, 3, True), (1, 1, True), (16, 16, True), (3, 5, False)])
def test_greedy_equals_generate_whatever_the_batching(target, reference, max_rows, check_every, continuous):
    engine = DecodeEngine(target, settings=EngineSettings(max_rows=max_rows, check_every=check_every,
                                                          continuous=continuous))
    run = engine.run(RequestList(make_requests()))
    assert tokens(run) == reference
    for g in run.generations:
        assert g.stopped == (g.tokens[-1] in target.stop_token_ids)
        assert g.stopped or len(g.tokens) == g.request.max_new_tokens
    assert run.stats.new_tokens == sum(map(len, reference.values())) and run.stats.rebuilds == 1
    if max_rows == 4:
        assert run.stats.compactions >= 1  # the tail ran on fewer rows, moved to the front


def test_continuous_batching_refills_rows_and_takes_fewer_steps(target):
    """One long reply beside many short ones: refilled rows finish the short ones beside it."""
    rng = np.random.default_rng(3)
    requests = [Request(key=(i, 0), prompt_ids=rng.integers(10, 1000, size=8), max_new_tokens=b)
                for i, b in enumerate([24] + [3] * 9)]
    steps = {}
    for continuous in (True, False):
        engine = DecodeEngine(target, settings=EngineSettings(max_rows=2, check_every=4, continuous=continuous))
        run = engine.run(RequestList(requests))
        steps[continuous] = run.stats.steps
        assert tokens(run) == {r.key: hf_generate(target, r) for r in requests}
    assert steps[True] < steps[False]


def test_a_refill_waits_for_refill_rows_free_rows(target):
    """Each refill is one prefill forward: with refill_rows=4 the 16 requests beyond the first 8
    rows come in refills of at least 4 prompts (at most 4 refills), where refilling every free
    row at once runs more prefills; both answer every request as generate does."""
    requests = make_requests(n=24, seed=7, max_len=12, max_new=14)
    expected = {r.key: hf_generate(target, r) for r in requests}
    prefills = {}
    for refill in (1, 4):
        engine = DecodeEngine(target, settings=EngineSettings(max_rows=8, check_every=16, refill_rows=refill))
        run = engine.run(RequestList(requests))
        assert tokens(run) == expected
        prefills[refill] = run.stats.prefills
    assert prefills[4] <= 1 + 4 < prefills[1]
    with pytest.raises(ConfigError, match="refill_rows=0"):
        EngineSettings(refill_rows=0)


def test_samples_of_one_prompt_share_its_prefill(target):
    """Three sampled requests per prompt (regenerate's --samples-per-prompt): each prompt is
    prefilled once and its K/V copied into the other rows, and every request's tokens are the
    ones it draws alone, one row, nothing shared."""
    choice = TokenChoice(temperature=1.0, seed=3)
    prompts = [r.prompt_ids for r in make_requests(n=4, seed=11, max_len=16)]
    requests = [Request(key=(i, 0, k), prompt_ids=p, max_new_tokens=10) for i, p in enumerate(prompts)
                for k in range(3)]
    shared = DecodeEngine(target, choice, EngineSettings(max_rows=12)).run(RequestList(requests))
    alone = DecodeEngine(target, choice, EngineSettings(max_rows=1)).run(RequestList(requests))
    assert tokens(shared) == tokens(alone)
    assert len({tuple(t) for t in tokens(shared).values()}) > 4  # the samples of a prompt differ
    assert shared.stats.shared_prompts == 8 and alone.stats.shared_prompts == 0
    assert shared.stats.prompt_tokens == sum(p.size for p in prompts)  # each prompt computed once
    assert alone.stats.prompt_tokens == 3 * shared.stats.prompt_tokens


def test_a_longer_request_later_rebuilds_the_cache(target):
    """A multi-turn source hands out a request longer than the cache after a reply: the rows
    drain, the cache is rebuilt bigger, and the request is answered like the others."""
    rng = np.random.default_rng(5)
    first = Request(key=(0, 0), prompt_ids=rng.integers(10, 1000, size=5), max_new_tokens=4)
    long = Request(key=(0, 1), prompt_ids=rng.integers(10, 1000, size=300), max_new_tokens=6)

    class TwoTurns(RequestList):
        def finished(self, generation):
            if generation.request.key == (0, 0):
                self._ready.append(long)

    engine = DecodeEngine(target, settings=EngineSettings(max_rows=2))
    run = engine.run(TwoTurns([first]))
    assert tokens(run) == {r.key: hf_generate(target, r) for r in (first, long)}
    assert run.stats.rebuilds == 2 and engine.kv.capacity >= 306


def test_a_token_budget_below_one_request_runs_it_alone_and_says_so(target, caplog):
    """kv_tokens (--token-budget) sizes the rows; a budget smaller than one request's cache
    still answers it, in one row, with one warning for the run, not one per request."""
    requests = make_requests(n=3, seed=2, max_len=8, max_new=6)
    engine = DecodeEngine(target, settings=EngineSettings(max_rows=4, kv_tokens=1))
    with caplog.at_level("WARNING", logger="dflash_ipc.decode.engine"):
        run = engine.run(RequestList(requests))
    assert tokens(run) == {r.key: hf_generate(target, r) for r in requests}
    assert engine.kv.max_rows == 1
    said = [r.getMessage() for r in caplog.records if "above the token budget of 1" in r.getMessage()]
    assert len(said) == 1 and "runs alone in one row" in said[0], caplog.text


def test_margins_are_the_logits_of_the_chosen_tokens(target):
    request = make_requests(1, seed=9, max_new=12)[0]
    run = DecodeEngine(target, settings=EngineSettings(keep_margins=True)).run(RequestList([request]))
    (gen,) = run.generations
    ids = torch.as_tensor(np.concatenate([request.prompt_ids, gen.tokens[:-1]]))[None]
    with torch.inference_mode():
        top = target.model(input_ids=ids).logits[0, request.prompt_ids.size - 1:].topk(2, dim=-1).values
    assert np.allclose(gen.top_logits, top[:, 0].numpy(), atol=1e-4)
    assert np.allclose(gen.margins, (top[:, 0] - top[:, 1]).numpy(), atol=1e-4)


def test_sampling_depends_on_the_request_not_on_the_batch(target):
    choice = TokenChoice(temperature=1.0, top_p=0.95, top_k=50, seed=11)
    runs = [tokens(DecodeEngine(target, choice, EngineSettings(max_rows=rows, check_every=c)).run(
        RequestList(make_requests()))) for rows, c in ((4, 3), (11, 1), (1, 7))]
    assert runs[0] == runs[1] == runs[2]
    other = tokens(DecodeEngine(target, TokenChoice(temperature=1.0, top_p=0.95, top_k=50, seed=12)).run(
        RequestList(make_requests())))
    assert other != runs[0]


def test_buckets_and_settings():
    assert [rows_bucket(n, 12) for n in (1, 2, 3, 5, 9, 12)] == [1, 2, 4, 8, 12, 12]
    assert [span_bucket(n, 4096) for n in (1, 128, 129, 193, 300, 5000)] == [128, 128, 192, 256, 384, 4096]
    for s in range(1, 3000):
        assert span_bucket(s, 1 << 20) >= s and span_bucket(s, 1 << 20) % 16 == 0
    with pytest.raises(ConfigError, match="graphs"):
        EngineSettings(graphs="yes")
    with pytest.raises(ConfigError, match="check_every"):
        EngineSettings(check_every=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_cuda_graphs_replay_the_eager_step(target_dir, temperature):
    """float32 on CUDA: graph and eager steps give the same tokens (greedy and sampled: the same
    kernels on the same shapes), and the graphs were really used (captures counted, none failed).
    Against transformers' generate the engine is checked on CPU (above), where no GPU
    reduction order can split a near-tie."""
    target = BatchedTarget(target_dir, device="cuda:0", dtype="float32")
    choice = TokenChoice(temperature=temperature, top_p=0.9, seed=3)
    runs = {}
    for graphs in ("off", "on"):
        # Not compiled: the graphs replay the very kernels of the eager step (compiled steps have
        # their own test, tests/test_decode_compiled.py).
        engine = DecodeEngine(target, choice, EngineSettings(max_rows=4, check_every=5, graphs=graphs,
                                                             compile="off"))
        runs[graphs] = tokens(engine.run(RequestList(make_requests())))
        if graphs == "on":
            assert engine.graphs.enabled and engine.graphs.num_captures >= 2
    assert runs["on"] == runs["off"]
