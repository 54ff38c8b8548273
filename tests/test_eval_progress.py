"""The evaluation progress line: rate limited, tokens/s and ETA from a stepped clock."""

from dflash_ipc.eval.progress import EvalProgress


def test_progress_line_is_rate_limited_and_estimates_the_rest():
    now, lines = [100.0], []
    progress = EvalProgress("[gsm8k] plain", 10, lines.append, interval_s=5.0, clock=lambda: now[0])
    now[0] = 102.0
    progress.update(2, 400)  # 2 s after the start: too soon
    now[0] = 105.0
    progress.update(3, 600)
    assert lines == ["[gsm8k] plain: 3/10 prompts, 600 tokens, 120 tok/s, ETA 11s"]  # 5 s x 7/3 left
    now[0] = 106.0
    progress.update(10, 2000)  # the last one always prints
    assert lines[-1] == "[gsm8k] plain: 10/10 prompts, 2,000 tokens, 333 tok/s, ETA 0s"
    turns = EvalProgress("[mt] spec", 4, lines.append, unit="turns", clock=lambda: now[0])
    assert turns.line(0, 0).endswith("0/4 turns, 0 tokens, 0 tok/s, ETA --")  # unknown, as on every line
