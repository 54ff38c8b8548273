"""TokenRate: the status rates over a window that always spans work, stepped on a scripted clock."""

import pytest

from dflash_ipc.obs.token_rate import TokenRate

WINDOW_S = 10.0


def _run(rate: TokenRate, growths: dict[float, float], until: float, tick: float = 0.5) -> list[tuple[float, float]]:
    """Ticks every `tick` s from 0 to `until` (the dispatcher's loop); `growths[t]` tokens arrive
    at t. Returns (time, value) after each tick."""
    total, out = 0.0, []
    for i in range(int(until / tick) + 1):
        now = i * tick
        total += growths.get(now, 0.0)
        rate.add(now, total)
        out.append((now, rate.value()))
    return out


def test_batches_slower_than_the_window_give_a_steady_rate():
    # One 2,400-token batch every 15 s (a real model on CPU): a plain 10 s window printed 0 and
    # 240 tok/s on alternate status lines; this one holds 2400 / 15 = 160 between batches.
    values = _run(TokenRate(WINDOW_S), {15.0 * k: 2400.0 for k in range(1, 9)}, until=120.0)
    steady = [v for t, v in values if 31.0 <= t <= 120.0]
    assert steady == [pytest.approx(160.0)] * len(steady)
    assert all(v > 0 for t, v in values if t >= 15.0)  # never back to 0 while batches keep coming


def test_fast_growth_is_averaged_over_the_window():
    values = _run(TokenRate(WINDOW_S), {0.5 * k: 50.0 for k in range(1, 121)}, until=60.0)
    assert [v for t, v in values if t >= 12.0] == [pytest.approx(100.0)] * len([t for t, _ in values if t >= 12.0])


def test_a_stall_falls_gradually_and_never_jumps():
    growths = {5.0 * k: 500.0 for k in range(1, 7)}  # 100 tok/s until 30 s, then nothing
    values = dict(_run(TokenRate(WINDOW_S), growths, until=120.0))
    assert values[30.0] == pytest.approx(100.0) and values[35.0] == pytest.approx(100.0)  # one usual gap
    falling = [values[t] for t in sorted(values) if t >= 35.0]
    assert all(b <= a for a, b in zip(falling, falling[1:])) and 0 < falling[-1] < 15.0
    assert all(abs(b - a) < 10.0 for a, b in zip(falling, falling[1:]))


def test_nothing_before_the_first_growth_and_a_restarted_counter_starts_over():
    rate = TokenRate(WINDOW_S)
    assert rate.value() == 0.0
    rate.add(0.0, 0.0)
    rate.add(5.0, 0.0)
    assert rate.value() == 0.0
    rate.add(10.0, 1000.0)
    assert rate.value() == pytest.approx(100.0)  # since the first tick: start-up included
    rate.add(11.0, 200.0)  # a new drafter group counts from 0 again: no negative rate
    assert rate.value() == 0.0
    rate.add(13.0, 600.0)
    assert rate.value() == pytest.approx(200.0)
