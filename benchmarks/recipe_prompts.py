"""A varied chat prompt set for the recipe table (benchmarks/recipe_table.sh): JSONL of prompt-only rows.

Kinds, crossed with a topic list: explanations, lists, comparisons, summaries, creative writing,
advice; arithmetic and word problems with random numbers; code tasks in three languages; and
two-turn conversations (a follow-up after the target's own first reply: `dflash-ipc regenerate`
answers both turns). The finite kinds run out first (900 topic tasks, 180 code tasks, 1,200
two-turn openings), so arithmetic, which never runs out, fills more of a large set. The finished
rows are shuffled with the seed, so `prepare --held-out N` (the last N usable rows, none sharing
its prompt with a training row) holds out the kinds in the proportions of the whole set.

    python -m benchmarks.recipe_prompts OUT.jsonl [--rows 2400] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import random

TOPICS = [
    "volcanoes", "the French Revolution", "photosynthesis", "black holes", "machine learning", "coffee",
    "the stock market", "honeybees", "the Roman Empire", "climate change", "the human heart", "electric cars",
    "the internet", "chess", "the Moon landing", "vaccines", "rainforests", "the printing press", "jazz music",
    "plate tectonics", "the immune system", "solar panels", "ancient Egypt", "octopuses", "the water cycle",
    "cryptocurrency", "the Renaissance", "earthquakes", "sleep", "the Great Wall of China", "recycling",
    "quantum computers", "the Olympic Games", "bread baking", "the Silk Road", "glaciers", "democracy",
    "antibiotics", "the theory of evolution", "wind turbines", "Shakespeare", "dinosaurs", "the ocean tides",
    "meditation", "the Industrial Revolution", "smartphones", "the solar system", "coral reefs", "inflation",
    "the Amazon river", "origami", "nuclear energy", "the piano", "bicycles", "tea ceremonies", "comets",
    "public libraries", "the microscope", "marathon running", "volunteering",
]
TASKS = [
    "Explain {t} to a ten-year-old.", "Give me three interesting facts about {t}.",
    "What are the pros and cons of {t}?", "Summarize the history of {t} in one paragraph.",
    "Write a short poem about {t}.", "Write a tweet about {t}.", "Describe {t} in two sentences.",
    "List five questions a student might ask about {t}.", "Write a short story that involves {t}.",
    "What is a common misconception about {t}?", "How would you teach {t} to beginners?",
    "Compare {t} and {u}.", "Write a friendly email inviting a friend to a talk about {t}.",
    "Why does {t} matter today?", "Give me a step-by-step plan to learn about {t} in a week.",
]
CODE_TASKS = [
    "reverses a string", "checks whether a number is prime", "computes the factorial of n",
    "counts the vowels in a string", "returns the largest element of a list", "merges two sorted lists",
    "removes duplicates from a list", "checks whether a string is a palindrome", "computes Fibonacci numbers",
    "converts Celsius to Fahrenheit", "sums the digits of an integer", "finds the second smallest number in a list",
    "counts the words in a sentence", "flattens a nested list", "sorts a list of names by length",
    "returns the greatest common divisor of two numbers", "capitalizes every word in a sentence",
    "checks whether two strings are anagrams", "computes the average of a list of numbers",
    "finds all even numbers in a list",
]
CODE_FORMS = ["Write a {lang} function that {task}.", "How do I write code that {task} in {lang}?",
              "Write a {lang} function that {task}, with a short explanation."]
LANGS = ["Python", "JavaScript", "C"]
FIRST_TURNS = ["Tell me about {t}.", "What should I know about {t}?", "Teach me something new about {t}.",
               "I'm curious about {t}. Where do I start?"]  # never single-turn prompts: each can be held out
FOLLOW_UPS = ["Can you make it shorter?", "Now explain it more simply.", "Give me one concrete example.",
              "Can you summarize that in one sentence?", "What is the most important point?"]


def math_prompt(rng: random.Random) -> str:
    a, b, c = rng.randint(2, 99), rng.randint(2, 99), rng.randint(2, 20)
    return rng.choice([
        f"What is {a} + {b}?", f"What is {a} times {c}?", f"What is {a * c} divided by {c}?",
        f"Solve for x: {c}x + {a} = {c * b + a}.",
        f"A shop sells pencils for {c} cents each. How much do {a} pencils cost?",
        f"A train travels at {a} km per hour for {c} hours. How far does it go?",
        f"Tom has {a} apples and gives {min(a - 1, b)} away. How many are left?",
        f"What is {c} squared plus {b}?", f"Is {a * b + 1} an even or an odd number? Explain.",
        f"A rectangle is {a} cm long and {c} cm wide. What are its area and perimeter?",
    ])


def rows(num_rows: int, seed: int) -> list[dict]:
    """``num_rows`` distinct prompt-only rows ({"messages": [...]}) of every kind, shuffled
    (greedy replies to a repeated prompt would repeat too: no new data)."""
    rng = random.Random(seed)
    general = [task.format(t=t, u=rng.choice([x for x in TOPICS if x != t])) for t in TOPICS for task in TASKS]
    code = [form.format(lang=lang, task=task) for task in CODE_TASKS for lang in LANGS for form in CODE_FORMS]
    rng.shuffle(general)
    rng.shuffle(code)
    out, seen, g, k = [], set(), iter(general), iter(code)
    for _ in range(100 * num_rows):
        if len(out) == num_rows:
            break
        kind = rng.random()
        if kind < 0.5:
            text = next(g, None) or rng.choice(TASKS).format(t=rng.choice(TOPICS), u=rng.choice(TOPICS))
            messages = [{"role": "user", "content": text}]
        elif kind < 0.7:
            messages = [{"role": "user", "content": math_prompt(rng)}]
        elif kind < 0.85:
            text = next(k, None) or rng.choice(CODE_FORMS).format(lang=rng.choice(LANGS), task=rng.choice(CODE_TASKS))
            messages = [{"role": "user", "content": text}]
        else:  # two turns: regenerate replaces the placeholder reply with the target's own
            first = rng.choice(FIRST_TURNS).format(t=rng.choice(TOPICS))
            messages = [{"role": "user", "content": first}, {"role": "assistant", "content": "(regenerated)"},
                        {"role": "user", "content": rng.choice(FOLLOW_UPS)}]
        key = json.dumps(messages)
        if key not in seen:
            seen.add(key)
            out.append({"messages": messages})
    if len(out) < num_rows:
        raise SystemExit(f"only {len(out)} distinct rows can be made, {num_rows} asked")
    # Generation order is not the mix: the late rows are those the exhausted kinds left to
    # arithmetic, and the held-out rows are the last ones.
    rng.shuffle(out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out")
    parser.add_argument("--rows", type=int, default=2400)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.rows < 1:
        parser.error("--rows must be >= 1")
    with open(args.out, "w", encoding="utf-8") as f:
        for row in rows(args.rows, args.seed):
            f.write(json.dumps(row) + "\n")
    print(f"{args.rows} rows -> {args.out}")


if __name__ == "__main__":
    main()
