"""CPU cost of the dispatcher's and prepare's bookkeeping: epoch planning, ledger save/load,
and `prepare_dataset` throughput.

    python -m benchmarks.bookkeeping [--samples 1450000] [--epochs 2] [--rows 4000] [--json PATH]

1. Planning: ``--samples`` log-normal lengths (median 400, sigma 0.9, clipped to 8..2048, a
   fixed seed) planned by `plan_epoch` under a 16,384-token budget, buckets 128..2048; the
   plan of one epoch is timed ``--repeats`` times. Padding is 1 - tokens / padded tokens, with
   the within-window length sort and without it (``sort_window=1``: windows of one sample
   keep the shuffled order).
2. Ledger: the plan of ``--epochs`` epochs of those samples, every batch driven through the
   ledger to a commit (50 commits per checkpoint step), saved with `save_ledger` and read
   back with `load_ledger` (the dispatcher's restart path), each ``--repeats`` times.
3. Prepare: ``--rows`` multi-turn chats (OpenAI messages, 1-4 user/assistant pairs of words of
   the tiny vocabulary) written as JSONL, prepared with the tiny tokenizer once per
   ``--workers`` count; the outputs are compared byte for byte (meta.json without its date).
   Samples/s are of the whole call, so a pool's start (seconds) weighs on the figures of
   several workers at small ``--rows``; 20,000 rows (~55 MB) show the steady rate.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import tempfile
import time

import numpy as np

from dflash_ipc.bench.dispatch import LengthModel
from benchmarks.status_cost import commit_every_batch
from dflash_ipc.data.dataset import INDEX_FILE, MASK_FILE, META_FILE, TOKENS_FILE
from dflash_ipc.data.prepare import REJECTS_FILE, prepare_dataset
from dflash_ipc.builtin.tiny import TINY_VOCAB_WORDS, build_tiny_tokenizer
from dflash_ipc.dispatch.buckets import BucketSpec, plan_epoch, plan_epochs, plan_stats
from dflash_ipc.dispatch.dispatcher import Dispatcher
from dflash_ipc.dispatch.ledger_file import load_ledger, save_ledger
from dflash_ipc.run.json_files import write_json_atomic

LENGTHS = LengthModel(median=400.0, sigma=0.9, min_len=8, max_len=2048)
SPEC = BucketSpec(boundaries=(128, 256, 512, 1024, 2048), token_budget=16384)
SEED = 0
USER_WORDS, ASSISTANT_WORDS = (10, 100), (50, 250)  # words per message, drawn uniformly
DATA_FILES = (TOKENS_FILE, MASK_FILE, INDEX_FILE, REJECTS_FILE)


def _timed(fn, repeats: int) -> tuple[list[float], object]:
    """Seconds of each of ``repeats`` calls of ``fn``, and the last call's result."""
    seconds, result = [], None
    for _ in range(repeats):
        started = time.perf_counter()
        result = fn()
        seconds.append(time.perf_counter() - started)
    return seconds, result


def _summary(seconds: list[float]) -> dict:
    return {"min_s": min(seconds), "median_s": statistics.median(seconds), "max_s": max(seconds)}


def bench_plan(num_samples: int, repeats: int) -> dict:
    """Time one epoch's plan; padding with and without the within-window length sort."""
    lengths = LENGTHS.sample(num_samples, seed=SEED)
    seconds, batches = _timed(lambda: plan_epoch(lengths, SPEC, seed=SEED, epoch=0), repeats)
    unsorted = dataclasses.replace(SPEC, sort_window=1)
    stats = plan_stats(batches, token_budget=SPEC.token_budget)
    return {"num_samples": num_samples, "num_batches": stats["num_batches"], "repeats": repeats,
            **_summary(seconds), "padding_fraction": stats["padding_fraction"],
            "padding_fraction_unsorted": plan_stats(plan_epoch(lengths, unsorted, seed=SEED, epoch=0))[
                "padding_fraction"]}


def bench_ledger(num_samples: int, num_epochs: int, repeats: int, work_dir: str) -> dict:
    """Save and load the ledger of a job whose every batch is committed."""
    epochs = plan_epochs(LENGTHS.sample(num_samples, seed=SEED), SPEC, seed=SEED, num_epochs=num_epochs)
    ledger = Dispatcher(epochs, policy="pull", num_targets=1, num_drafters=1).ledger
    commits = commit_every_batch(ledger)
    path = os.path.join(work_dir, "ledger.npz")
    save_s, _ = _timed(lambda: save_ledger(ledger, path), repeats)
    load_s, loaded = _timed(lambda: load_ledger(path), repeats)
    num_ids = sum(len(e.batch.sample_ids) for e in ledger.entries())
    return {"num_samples": num_samples, "num_epochs": num_epochs, "num_batches": len(ledger),
            "num_sample_ids": num_ids, "num_commit_records": commits, "repeats": repeats,
            "file_bytes": os.path.getsize(path), "save": _summary(save_s), "load": _summary(load_s),
            "loaded_same_counts": loaded.counts() == ledger.counts() and len(loaded) == len(ledger)
            and len(loaded.history()) == len(ledger.history())}


def write_chats(path: str, num_rows: int, seed: int = SEED) -> int:
    """``num_rows`` multi-turn chats of tiny-vocabulary words as JSONL; returns the bytes written."""
    rng = np.random.default_rng(seed)
    words = np.asarray(TINY_VOCAB_WORDS)

    def text(bounds: tuple[int, int]) -> str:
        return " ".join(words[rng.integers(0, words.size, int(rng.integers(*bounds)))])

    with open(path, "w", encoding="utf-8") as f:
        for _ in range(num_rows):
            turns = []
            for _ in range(int(rng.integers(1, 5))):
                turns += [{"role": "user", "content": text(USER_WORDS)},
                          {"role": "assistant", "content": text(ASSISTANT_WORDS)}]
            f.write(json.dumps({"messages": turns}) + "\n")
    return os.path.getsize(path)


def _same_output(a: str, b: str) -> bool:
    """Byte-identical data files, and the same meta.json but for its creation date."""
    def read(d: str, name: str) -> bytes:
        with open(os.path.join(d, name), "rb") as f:
            return f.read()

    metas = [json.loads(read(d, META_FILE)) for d in (a, b)]
    for meta in metas:
        meta.pop("created_at", None)
    return metas[0] == metas[1] and all(read(a, n) == read(b, n) for n in DATA_FILES)


def bench_prepare(num_rows: int, workers: list[int], work_dir: str) -> dict:
    """Prepare the same chats once per worker count; samples/s of each whole call."""
    model_dir = os.path.join(work_dir, "tiny-tokenizer")
    build_tiny_tokenizer().save_pretrained(model_dir)  # prepare needs only the target's tokenizer
    input_path = os.path.join(work_dir, "chats.jsonl")
    input_bytes = write_chats(input_path, num_rows)
    runs, outs = [], []
    for i, n in enumerate(workers):
        out = os.path.join(work_dir, f"prepared-{i}-workers-{n}")
        started = time.perf_counter()
        report = prepare_dataset(model_dir, input_path, out, num_workers=n, progress=False)
        seconds = time.perf_counter() - started
        runs.append({"workers": n, "num_samples": report.num_samples, "num_rejected": report.num_rejected,
                     "seconds": seconds, "samples_per_s": report.num_samples / seconds})
        outs.append(out)
    identical = all(_same_output(outs[0], o) for o in outs[1:]) if len(outs) > 1 else None
    return {"num_rows": num_rows, "input_bytes": input_bytes, "runs": runs, "identical": identical}


def run(args: argparse.Namespace, print_fn=print) -> dict:
    """Every figure, printed with its setup; returned as plain data (what ``--json`` writes)."""
    spec = f"buckets {list(SPEC.boundaries)}, token budget {SPEC.token_budget:,}, pad to {SPEC.pad_multiple}"
    print_fn(f"lengths: log-normal median {LENGTHS.median:.0f}, sigma {LENGTHS.sigma}, clipped to "
             f"{LENGTHS.min_len}..{LENGTHS.max_len}, seed {SEED}; {spec}")
    plan = bench_plan(args.samples, args.repeats)
    print_fn(f"plan of one epoch of {plan['num_samples']:,} samples ({plan['num_batches']:,} batches): "
             f"min {plan['min_s']:.2f} s, median {plan['median_s']:.2f} s of {plan['repeats']}; padding "
             f"{plan['padding_fraction']:.1%} ({plan['padding_fraction_unsorted']:.1%} without the "
             "within-window length sort)")
    with tempfile.TemporaryDirectory(prefix="dflash-bookkeeping-") as work_dir:
        ledger = bench_ledger(args.samples, args.epochs, args.repeats, work_dir)
        print_fn(f"ledger of {ledger['num_epochs']} epochs: {ledger['num_batches']:,} batches, "
                 f"{ledger['num_sample_ids']:,} sample ids, {ledger['num_commit_records']:,} commit records: "
                 f"save min {ledger['save']['min_s'] * 1e3:.0f} ms, median {ledger['save']['median_s'] * 1e3:.0f} "
                 f"ms ({ledger['file_bytes'] / 1e6:.1f} MB); load min {ledger['load']['min_s']:.2f} s, median "
                 f"{ledger['load']['median_s']:.2f} s of {ledger['repeats']}; loaded counts "
                 f"{'match' if ledger['loaded_same_counts'] else 'DIFFER'}")
        prepare = bench_prepare(args.rows, args.workers, work_dir)
    rates = ", ".join(f"{r['samples_per_s']:,.0f} samples/s with {r['workers']} worker{'s' * (r['workers'] > 1)}"
                      for r in prepare["runs"])
    same = {True: "identical output", False: "OUTPUTS DIFFER", None: "one run"}[prepare["identical"]]
    print_fn(f"prepare_dataset of {prepare['num_rows']:,} multi-turn rows ({prepare['input_bytes'] / 1e6:.1f} MB) "
             f"with the tiny tokenizer: {rates} ({same})")
    result = {"plan": plan, "ledger": ledger, "prepare": prepare, "lengths": {
        "median": LENGTHS.median, "sigma": LENGTHS.sigma, "min_len": LENGTHS.min_len, "max_len": LENGTHS.max_len,
        "seed": SEED}, "spec": {"boundaries": list(SPEC.boundaries), "token_budget": SPEC.token_budget,
                                "pad_multiple": SPEC.pad_multiple}}
    if args.json:
        write_json_atomic(args.json, result)
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=1_450_000, help="samples planned (and per ledger epoch)")
    parser.add_argument("--epochs", type=int, default=2, help="epochs in the ledger")
    parser.add_argument("--rows", type=int, default=4000, help="chat rows prepared")
    parser.add_argument("--workers", type=lambda s: [int(w) for w in s.split(",")], default=[1, 2],
                        help="prepare worker counts, comma-separated")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats of the plan, save and load")
    parser.add_argument("--json", default=None, help="also write every figure to this file")
    args = parser.parse_args(argv)
    for name in ("samples", "epochs", "rows", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if not args.workers or min(args.workers) < 1:
        parser.error(f"--workers must be worker counts >= 1, got {args.workers}")
    return args


if __name__ == "__main__":
    run(parse_args())
