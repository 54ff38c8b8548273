"""eval's speedup: interleaved, repeated (plain, speculative) pairs, the median and its range,
and the device named beside it; stepped with fake decoders whose wall times are scripted."""

import types

import torch

import dflash_ipc.eval.speculative as spec
from dflash_ipc.eval.acceptance import AcceptanceStats
from dflash_ipc.eval.decoding import DecodeRun
from dflash_ipc.eval.prompt_sets import PromptCase, PromptSet
from dflash_ipc.eval.report import EvalReport, PlainFigures


class _ScriptedDecoder:
    """Runs in the order they are made: each returns 100 tokens in the next scripted wall time."""

    def __init__(self, walls: list[float], order: list[str], kind: str):
        self.walls, self.order, self.kind = walls, order, kind

    def run(self, source):
        self.order.append(self.kind)
        gen = types.SimpleNamespace(tokens=[0] * 100, request=types.SimpleNamespace(key=(0, 0)))
        return DecodeRun(generations=[gen], wall_s=self.walls.pop(0), num_target_forwards=1)


def test_the_speedup_is_the_median_of_interleaved_pairs(monkeypatch):
    # The first pair gives the outputs (its plain run caught on a slow clock, or capturing graphs:
    # ratio 4.0); two more pairs, on the same decoders, back to back: ratios 2.0 and 2.4.
    plain_walls, spec_walls, order = [4.0, 2.0, 2.4], [1.0, 1.0, 1.0], []
    monkeypatch.setattr(spec, "_warm_up", lambda *a, **k: None)
    monkeypatch.setattr(spec, "plain_decoder", lambda target, **kw: _ScriptedDecoder(plain_walls, order, "plain"))
    monkeypatch.setattr(spec, "speculative_decoder",
                        lambda target, model, **kw: _ScriptedDecoder(spec_walls, order, "spec"))
    monkeypatch.setattr(spec, "build_report", lambda label, ps, run, plain, options, **kw: EvalReport(
        label=label, stats=AcceptanceStats(block_size=4), samples=[], max_new_tokens=8, wall_s=run.wall_s,
        device=kw["device"], plain=PlainFigures(num_generated=plain.num_generated, wall_s=plain.wall_s)))
    target = types.SimpleNamespace(device=torch.device("cpu"), dtype=torch.float32, stop_token_ids=[1])
    model = types.SimpleNamespace(config=types.SimpleNamespace(block_size=4))
    prompt_set = PromptSet(name="p", cases=[PromptCase(sample_id=0, turns=[""], prompt_ids=[5, 6])], source="-")
    options = spec.EvalOptions(max_new_tokens=8, timing_repeats=3)
    monkeypatch.setattr(spec, "Conversations", lambda *a, **k: types.SimpleNamespace(next_request=lambda: None))
    [report] = spec.run_set(target, [("trained", model)], prompt_set, renderer=None, options=options)
    assert order == ["plain", "spec", "plain", "spec", "plain", "spec"]  # each pair back to back
    assert report.speedups == [2.0, 2.4] and report.speedup == 2.2  # the first pair's 4.0 is not timed
    line = report.format()
    assert "speedup 2.20x (median of 2 interleaved pairs, 2.00-2.40x)" in line
    assert report.device.startswith("cpu (") and report.device in line
    assert report.to_dict()["speedups"] == [2.0, 2.4] and report.to_dict()["device"] == report.device


def test_one_pair_keeps_the_single_ratio_and_repeats_are_checked():
    report = EvalReport(label="x", stats=AcceptanceStats(block_size=4), samples=[], max_new_tokens=8, wall_s=1.0,
                        plain=PlainFigures(num_generated=0, wall_s=1.0), speedups=[1.5])
    assert report.speedup == 1.5 and "interleaved" not in report.format()
    try:
        spec.EvalOptions(timing_repeats=0)
    except Exception as exc:
        assert "timing_repeats=0 must be >= 1" in str(exc)
    else:
        raise AssertionError("timing_repeats=0 accepted")
