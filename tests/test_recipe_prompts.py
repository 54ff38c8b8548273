"""benchmarks/recipe_prompts.py: distinct rows, and a held-out tail with the whole set's mix of kinds."""

import json

import pytest

from benchmarks.recipe_prompts import CODE_TASKS, TOPICS, rows


def kind(messages: list[dict]) -> str:
    text = messages[0]["content"]
    if len(messages) > 1:
        return "two-turn"
    if any(task in text for task in CODE_TASKS):
        return "code"
    if any(topic in text for topic in TOPICS):
        return "general"
    return "math"


def share(rows_: list[dict], name: str) -> float:
    return sum(kind(r["messages"]) == name for r in rows_) / len(rows_)


def test_rows_are_distinct_and_seeded():
    made = rows(3000, seed=0)
    assert len(made) == 3000
    assert len({json.dumps(r["messages"]) for r in made}) == 3000
    assert made == rows(3000, seed=0)
    assert made != rows(3000, seed=1)


@pytest.mark.parametrize("num_rows", [2400, 6000])
def test_the_tail_prepare_holds_out_has_the_mix_of_the_whole_set(num_rows):
    # Unshuffled, arithmetic filled the tail once the finite kinds ran out: 54 of the last 64
    # rows of 6,000 were arithmetic against 55 % of the whole set.
    made = rows(num_rows, seed=0)
    tail = made[-600:]
    for name in ("math", "general", "two-turn"):
        assert abs(share(tail, name) - share(made, name)) < 0.08, name

