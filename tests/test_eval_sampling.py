"""Speculative sampling: the committed tokens are distributed as the target's own samples.

Statistical tests with fixed seeds and a tolerant bound: Pearson's chi-square against the
exact distribution, rejected at p < 1e-3 (cells with expected count < 5 merged). Each test
also shows its power: the same counts against a wrong distribution (the drafter's, i.e.
what accepting every draft would give) score far above the bound.
"""

import math

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from dflash_ipc.drafter.model import DFlashConfig, DFlashDraftModel
from dflash_ipc.errors import ConfigError
from dflash_ipc.eval.decoding import SpeculativeDecoder
from dflash_ipc.eval.drafter_context import DrafterContext
from dflash_ipc.decode.requests import Request, RequestList
from dflash_ipc.eval.sampling import Sampling, probabilities, sample, speculative_accept

torch.set_num_threads(1)

VOCAB = 16
PROMPT = [3, 1, 4]


def chi_square(counts: torch.Tensor, expected_probs: torch.Tensor) -> tuple[float, float]:
    """(statistic, the p = 1e-3 critical value), cells with expected count < 5 pooled into one;
    an infinite statistic for any count where the expected probability is 0."""
    counts, expected = counts.double().flatten(), expected_probs.double().flatten() * counts.sum()
    if bool((counts[expected == 0] > 0).any()):
        return math.inf, 0.0  # a token the target never samples (outside its nucleus)
    counts, expected = counts[expected > 0], expected[expected > 0]
    small = expected < 5
    if small.any():
        counts = torch.cat([counts[~small], counts[small].sum()[None]])
        expected = torch.cat([expected[~small], expected[small].sum()[None]])
    stat = float(((counts - expected) ** 2 / expected).sum())
    df = counts.numel() - 1  # Wilson-Hilferty: chi-square quantile from the normal one (z = 3.09)
    critical = df * (1 - 2 / (9 * df) + 3.0902 * math.sqrt(2 / (9 * df))) ** 3
    return stat, critical


def test_top_p_keeps_the_nucleus():
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    assert probabilities(logits, Sampling(temperature=1.0, top_p=0.8)).tolist() == pytest.approx([0.625, 0.375, 0, 0])
    assert probabilities(logits, Sampling(temperature=1.0, top_p=0.81))[2] > 0
    assert probabilities(logits, Sampling(temperature=1.0, top_p=0.1)).tolist() == pytest.approx([1, 0, 0, 0])
    hot = probabilities(logits, Sampling(temperature=2.0))
    torch.testing.assert_close(hot, torch.softmax(logits / 2, -1))


def test_sampling_options_are_checked():
    with pytest.raises(ConfigError, match="temperature=-1"):
        Sampling(temperature=-1)
    with pytest.raises(ConfigError, match="top_p=0"):
        Sampling(temperature=1, top_p=0)


def test_rejection_sampling_of_one_block_gives_the_target_distribution():
    """Fixed p and q per position (V=5, 2 drafts): the first committed token follows p_0 and,
    where the first draft was accepted, the second follows p_1, though drafts come from q."""
    gen = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.5, 0.2, 0.1, 0.1, 0.1], [0.05, 0.05, 0.3, 0.3, 0.3], [0.2] * 5])
    q = torch.tensor([[0.1, 0.1, 0.2, 0.3, 0.3], [0.6, 0.1, 0.1, 0.1, 0.1]])
    rows = 40000
    draft_probs, target_probs = q.expand(rows, 2, 5), p.expand(rows, 3, 5)
    drafted = sample(draft_probs, gen)
    accepted, tokens = speculative_accept(drafted, draft_probs, target_probs, gen)
    first = torch.bincount(tokens[:, 0], minlength=5)
    stat, critical = chi_square(first, p[0])
    assert stat < critical, (stat, critical)
    assert chi_square(first, q[0])[0] > 10 * critical  # the drafts alone would be caught
    second = torch.bincount(tokens[accepted >= 1, 1], minlength=5)
    stat, critical = chi_square(second, p[1])
    assert stat < critical, (stat, critical)
    assert 0.2 < (accepted >= 1).float().mean() < 0.8  # both accepting and the residual path ran


@pytest.fixture(scope="module")
def small_target(tmp_path_factory):
    """A 16-token target with peaked distributions (large init): few categories, so a few
    thousand draws test the exact distribution."""
    from dflash_ipc.decode.target import BatchedTarget

    path = tmp_path_factory.mktemp("small-target")
    config = Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, initializer_range=0.4,
                         eos_token_id=None, bos_token_id=None, pad_token_id=None, tie_word_embeddings=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        Qwen3ForCausalLM(config).save_pretrained(path)
    return BatchedTarget(str(path), layer_ids=[0, 1], dtype="float32")


@torch.inference_mode()
def exact_joint(target, sampling: Sampling) -> torch.Tensor:
    """``[V, V, V]``: P(t1, t2, t3) of the target's own sampling after PROMPT."""
    logits = target.model
    p1 = probabilities(logits(input_ids=torch.tensor([PROMPT])).logits[0, -1], sampling)  # [V]
    t1 = torch.arange(VOCAB)
    p2 = probabilities(logits(input_ids=torch.cat([torch.tensor(PROMPT).expand(VOCAB, 3), t1[:, None]], 1)
                              ).logits[:, -1], sampling)  # [V, V]
    pairs = torch.cartesian_prod(t1, t1)  # [V*V, 2]
    p3 = probabilities(logits(input_ids=torch.cat([torch.tensor(PROMPT).expand(VOCAB * VOCAB, 3), pairs], 1)
                              ).logits[:, -1], sampling).view(VOCAB, VOCAB, VOCAB)
    return p1[:, None, None] * p2[:, :, None] * p3


@torch.inference_mode()
def drafter_joint12(target, model, sampling: Sampling, p1: torch.Tensor) -> torch.Tensor:
    """``[V, V]``: P(t1) q(t2 | t1): what always accepting the first draft would give."""
    context = DrafterContext(model, target.head)
    target.reset(num_rows=VOCAB, capacity=16)
    out = target.prefill(list(range(VOCAB)), [torch.tensor(PROMPT).numpy()] * VOCAB)
    context.reset(num_rows=VOCAB, capacity=16)
    context.append(torch.arange(VOCAB), out.features, out.write_pos, out.positions)
    q2 = probabilities(context.draft_logits(torch.arange(VOCAB), torch.full((VOCAB,), 3), 3)[:, 0], sampling)
    return p1[:, None] * q2


@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_speculative_sampling_matches_the_target_distribution(small_target, temperature, top_p):
    """6,000 generations of 3 tokens after one prompt (block 4): the joint of the first two tokens
    and the marginal of the third, which drafts, acceptance and residual samples produce,
    follow the target's exact distribution."""
    sampling = Sampling(temperature=temperature, top_p=top_p, seed=1)
    config = DFlashConfig.from_target_config(small_target.model.config, num_draft_layers=1, block_size=4,
                                             mask_token_id=VOCAB - 1, target_layer_ids=[0, 1])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        drafter = DFlashDraftModel(config).eval()
    requests = [Request(key=(i, 0), prompt_ids=PROMPT, max_new_tokens=3) for i in range(6000)]
    decoder = SpeculativeDecoder(small_target, DrafterContext(drafter, small_target.head), batch_size=1500,
                                 sampling=sampling)
    decoder.stops = frozenset()  # every token id is a category here, none ends a generation
    run = decoder.run(RequestList(requests))
    tokens = torch.tensor([g.tokens for g in run.generations])  # [N, 3]
    joint = exact_joint(small_target, sampling)
    joint12 = torch.bincount(tokens[:, 0] * VOCAB + tokens[:, 1], minlength=VOCAB * VOCAB)
    stat, critical = chi_square(joint12, joint.sum(2))
    assert stat < critical, (stat, critical)
    stat, critical = chi_square(torch.bincount(tokens[:, 2], minlength=VOCAB), joint.sum((0, 1)))
    assert stat < critical, (stat, critical)
    wrong = drafter_joint12(small_target, drafter, sampling, joint.sum((1, 2)))
    assert chi_square(joint12, wrong)[0] > 10 * chi_square(joint12, joint.sum(2))[1]
    accepted_first = sum(g.stats.accepted_at[0] for g in run.generations) / sum(g.stats.drafted_at[0]
                                                                              for g in run.generations)
    assert 0.1 < accepted_first < 0.95, accepted_first  # acceptances and residual samples both occur
