"""The lossless check: identical, numerical near-tie or mismatch, on constructed cases and a real target."""

import copy
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash_ipc.eval.acceptance import AcceptanceStats
from dflash_ipc.eval.decoding import DecodeRun, PlainDecoder
from dflash_ipc.eval.lossless import LosslessCheck, compare, ulp
from dflash_ipc.eval.prompt_sets import PromptCase, PromptSet
from dflash_ipc.decode.requests import Generation, Request, RequestList
from dflash_ipc.eval.speculative import EvalOptions, build_report, evaluate
from dflash_ipc.decode.target import BatchedTarget
from dflash_ipc.eval.unbatched import DFlashProposer, TargetLM, UnbatchedDecoder
from eval_helpers import LAYER_IDS, eval_data, random_drafter

torch.set_num_threads(1)


def gen(tokens, margins, tops=None, key=(0, 0)):
    request = Request(key=key, prompt_ids=[1, 2, 3], max_new_tokens=8)
    return Generation(request=request, tokens=list(tokens), margins=list(margins),
                      top_logits=list(tops or [10.0] * len(tokens)))


def test_ulp():
    assert ulp(1.0, torch.float32) == 2.0**-23
    assert ulp(20.0, torch.bfloat16) == 2.0**-7 * 16
    assert ulp(-20.0, torch.bfloat16) == ulp(16.0, torch.bfloat16)
    assert ulp(0.3, torch.bfloat16) == 2.0**-7  # below 1: the spacing at 1


@pytest.mark.parametrize("spec_margin, plain_margin, verdict", [
    (0.01, 0.02, "near_tie"),  # both passes saw a tie within 4 ulps (0.25 at logits ~10 in bf16)
    (0.01, 1.5, "mismatch"),  # the plain pass had a clear winner that speculative decoding did not choose
    (2.0, 0.0, "mismatch"),
])
def test_verdicts_on_constructed_generations(spec_margin, plain_margin, verdict):
    spec = gen([5, 6, 8, 9], [1.0, 1.0, spec_margin, 1.0])
    plain = gen([5, 6, 7, 9], [1.0, 1.0, plain_margin, 1.0])
    check = compare(spec, plain, dtype=torch.bfloat16)
    assert check.verdict == verdict and check.position == 2
    assert (check.speculative_token, check.plain_token) == (8, 7)
    assert check.tolerance == pytest.approx(4 * 2.0**-7 * 8)
    assert compare(spec, plain, dtype=torch.float32).verdict == "mismatch"  # float32 resolves 0.01 at 10
    assert compare(plain, plain, dtype=torch.bfloat16) == LosslessCheck(verdict="identical")
    assert compare(gen([5, 6], [1, 1]), gen([5, 6, 7], [1, 1, 1]), dtype=torch.bfloat16).verdict == "mismatch"


@pytest.fixture(scope="module")
def tied_target(tiny_cache, tmp_path_factory):
    """The tiny target with two LM-head rows made equal: an exact tie between its first greedy
    token A and another token B wherever A wins (argmax keeps the lower id, A)."""
    source = os.path.join(tiny_cache, "tiny-target")
    target = BatchedTarget(source, layer_ids=LAYER_IDS, dtype="float32")
    prompt = [5, 17, 40, 9, 300]
    first = PlainDecoder(target, batch_size=1).run(RequestList([Request(key=(0, 0), prompt_ids=prompt,
                                                                       max_new_tokens=1)]))
    a = first.generations[0].tokens[0]
    b = a + 1 + (a + 1 in target.stop_token_ids)
    out = str(tmp_path_factory.mktemp("tied-target"))
    for name in os.listdir(source):
        if name != "model.safetensors":
            os.symlink(os.path.join(source, name), os.path.join(out, name))
    weights = load_file(os.path.join(source, "model.safetensors"))
    weights["lm_head.weight"][b] = weights["lm_head.weight"][a]
    save_file(weights, os.path.join(out, "model.safetensors"))
    return BatchedTarget(out, layer_ids=LAYER_IDS, dtype="float32"), prompt, a, b, out


def test_a_flip_at_an_exact_tie_is_a_near_tie_and_elsewhere_a_mismatch(tied_target):
    target, prompt, a, b, _ = tied_target
    request = Request(key=(0, 0), prompt_ids=prompt, max_new_tokens=12)
    plain = PlainDecoder(target, batch_size=1).run(RequestList([request]))
    reference = plain.generations[0]
    assert reference.tokens[0] == a and reference.margins[0] == 0.0  # the two rows tie exactly
    prompt_set = PromptSet(name="tie", cases=[PromptCase(sample_id=0, turns=[""], prompt_ids=prompt)], source="-")
    options = EvalOptions(max_new_tokens=12, check_lossless=True)

    def verdict_if_token(position: int, token: int):
        spec = copy.deepcopy(reference)
        spec.tokens[position] = token  # what a pass that rounded the other way would have chosen
        spec.stats = AcceptanceStats(block_size=16)
        run = DecodeRun(generations=[spec], wall_s=1.0, num_target_forwards=1)
        return build_report("spec", prompt_set, run, plain, options, dtype=torch.float32, block_size=16)

    tie = verdict_if_token(0, b)
    assert tie.samples[0].check.verdict == "near_tie" and tie.near_ties == [0] and tie.lossless_mismatches == []
    assert "1 numerical near-ties in float32" in tie.format()
    clear = max(range(1, 12), key=lambda i: reference.margins[i])
    bug = verdict_if_token(clear, (reference.tokens[clear] + 1) % 1000)
    assert bug.samples[0].check.verdict == "mismatch" and bug.lossless_mismatches == [0]
    assert bug.samples[0].check.plain_margin == pytest.approx(reference.margins[clear])


def test_the_unbatched_decoder_keeps_the_margins_that_tell_a_near_tie(tied_target):
    """Targets with recurrent layers run the unbatched decoder: its generations, plain and
    speculative, carry the target's margin at every token, as the batched decoder's do."""
    batched, prompt, a, b, target_dir = tied_target
    request = Request(key=(0, 0), prompt_ids=prompt, max_new_tokens=12)
    plain = PlainDecoder(batched, batch_size=1).run(RequestList([request])).generations[0]
    target = TargetLM(target_dir, layer_ids=LAYER_IDS, dtype="float32")
    proposer = DFlashProposer(random_drafter(target_dir, num_layers=1, block_size=8), target.head)
    for decoder in (UnbatchedDecoder(target), UnbatchedDecoder(target, proposer)):
        generation = decoder.run(RequestList([request])).generations[0]
        assert generation.tokens == plain.tokens and generation.margins[0] == 0.0  # the exact tie
        assert generation.margins == pytest.approx(plain.margins, abs=1e-4)
        assert generation.top_logits == pytest.approx(plain.top_logits, abs=1e-4)
        flipped = copy.deepcopy(generation)
        flipped.tokens[0] = b
        assert compare(flipped, generation, dtype=torch.float32).verdict == "near_tie"


def test_bf16_outputs_are_identical_or_near_ties(tiny_cache):
    """bfloat16 on CPU: whatever differs from plain greedy decoding does so at a near-tie."""
    target_dir = os.path.join(tiny_cache, "tiny-target")
    report = evaluate(target_dir, random_drafter(target_dir, num_layers=1, block_size=8), eval_data(str(tiny_cache)),
                      num_prompts=4, max_new_tokens=16, dtype="bfloat16", check_lossless=True)
    assert report.dtype == "bfloat16" and report.num_lossless_checked == 4
    assert report.lossless_mismatches == [], report.to_dict()["lossless"]


@pytest.mark.parametrize("verdict, code", [("near_tie", 0), ("mismatch", 1), ("identical", 0)])
def test_eval_exits_nonzero_only_on_a_mismatch(monkeypatch, tiny_cache, tmp_path, verdict, code):
    from click.testing import CliRunner

    import dflash_ipc.eval.speculative as speculative
    from dflash_ipc.cli import main
    from dflash_ipc.eval.report import EvalReport, SampleResult

    check = LosslessCheck(verdict=verdict, position=None if verdict == "identical" else 2, speculative_margin=0.0,
                          plain_margin=0.0, tolerance=0.1)
    sample = SampleResult(sample_id=0, prompt_len=3, output_ids=[1], stats=AcceptanceStats(block_size=4),
                          stopped=False, check=check)
    report = EvalReport(label="d", stats=AcceptanceStats(block_size=4), samples=[sample], max_new_tokens=4, wall_s=1)
    monkeypatch.setattr(speculative, "evaluate_sets", lambda *a, **k: [report])
    target = os.path.join(tiny_cache, "tiny-target")
    result = CliRunner().invoke(main, ["eval", "--target", target, "--drafter", str(tmp_path), "--data", target,
                                       "--check-lossless"], catch_exceptions=False)
    assert result.exit_code == code, result.output


@pytest.mark.parametrize("device, message", [("gpu", "'gpu'; allowed: cpu or cuda:N"),
                                             ("cuda:64", "cuda:64")])
def test_eval_names_a_bad_device_in_one_line(tiny_cache, tmp_path, monkeypatch, capsys, device, message):
    import sys

    from dflash_ipc.cli import run
    target = os.path.join(tiny_cache, "tiny-target")
    monkeypatch.setattr(sys, "argv", ["dflash-ipc", "eval", "--target", target, "--drafter", str(tmp_path),
                                      "--device", device])
    with pytest.raises(SystemExit) as exited:
        run()
    err = capsys.readouterr().err
    assert exited.value.code == 78 and f"error: --device: {message}" in err and "Traceback" not in err, err
