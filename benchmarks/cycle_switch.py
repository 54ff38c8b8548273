"""The batch-1 speculative cycle and plain step with a decode switch at each of its values, in one process.

    python3 -m benchmarks.cycle_switch qwen3-1.7b                        # DFLASH_DECODE_FUSE_DRAFTER
    python3 -m benchmarks.cycle_switch qwen3-8b --env DFLASH_DECODE_KV_WRITE --rounds 7
    python3 -m benchmarks.cycle_switch qwen3-1.7b --env DFLASH_DECODE_PDL --values auto,off
    python3 -m benchmarks.cycle_switch qwen3-1.7b --env DFLASH_DECODE_TOP2,DFLASH_DECODE_FUSED_ACCEPT \
        --values auto/auto,auto/off,off/off                            # several switches: a/b per value

`bench eval`'s batch-1 rows (bench/eval.py) with what differs between processes held still: one
random-weight target of a bench shape (built once into $WORK/profile-spec-SHAPE, default /tmp), its
random drafter, 2 prompts of 64..256 random tokens and 128 new tokens each, greedy, CUDA graphs and
the compiled decode forward. A plain and a speculative decoder are built per value of the switch
(``--values``, default ``auto`` then ``off``), the environment set while each is built, warmed up
and run, so a switch read by the drafter's context or at a graph's capture applies to it alone.
Several switches (``--env A,B``) take a value each, ``a/b``, or one value for all.
Each round runs every decoder twice, the second run timed (the first captures the graphs again: the
decoders take turns over the target's cache); printed: ms per target forward (a plain step; a
cycle, draft + verify, prefills included as bench eval counts them) of every run, each one's
median over the rounds with its range, and each value's cycle in its own plain steps. Between processes
the same bench moves by more than the differences it is after (docs/benchmarks.md), within one it
does not. DEV=cpu runs it eagerly on the CPU in float32 (a smoke test, e.g. with the ``tiny`` shape).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from dflash_ipc.bench.assets import SHAPES, build_random_target
from dflash_ipc.bench.eval import bench_drafter, random_prompts
from dflash_ipc.decode.requests import Request, RequestList
from dflash_ipc.decode.target import BatchedTarget
from dflash_ipc.eval.decoding import PlainDecoder, SpeculativeDecoder
from dflash_ipc.eval.drafter_context import FUSE_DRAFTER_ENV, DrafterContext


def ms_per_forward(decoder, requests, device: torch.device) -> float:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    result = decoder.run(RequestList(requests))
    sync()
    return 1e3 * (time.perf_counter() - t0) / max(1, result.num_target_forwards)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("--env", default=FUSE_DRAFTER_ENV, help="the switch (several: comma-separated)")
    parser.add_argument("--values", default="auto,off", help="its values, comma-separated")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=128)
    args = parser.parse_args()
    path = os.path.join(os.environ.get("WORK", "/tmp"), f"profile-spec-{args.shape}")
    if not os.path.exists(os.path.join(path, "config.json")):
        build_random_target(path, shape=args.shape, dtype="bfloat16")
    device = torch.device(os.environ.get("DEV", "cuda:0"))
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    model = bench_drafter(path, args.shape, device=device, dtype=dtype, seed=0)
    target = BatchedTarget(path, layer_ids=model.config.target_layer_ids, device=device,
                           dtype=str(dtype).removeprefix("torch."))
    graphs = "on" if cuda else "off"
    requests = [Request(key=(i, 0), prompt_ids=p, max_new_tokens=args.new_tokens)
                for i, p in enumerate(random_prompts(2, (64, 256), 0))]
    envs, values = args.env.split(","), args.values.split(",")

    def parts(value: str) -> list[str]:  # one switch takes the value whole (a path, say)
        return value.split("/") if len(envs) > 1 else [value]

    if len(set(values)) != len(values) or not all(values) or any(
            len(parts(v)) not in (1, len(envs)) or not all(parts(v)) for v in values):
        parser.error(f"--values {args.values!r}: distinct, non-empty values, comma-separated; with several "
                     f"switches (--env {args.env}) one value each, joined by '/', or one for all")

    def switch(value: str) -> None:
        each = parts(value)
        for env, part in zip(envs, each * len(envs) if len(each) == 1 else each):
            os.environ[env] = part

    decoders = {}  # (kind, value) -> decoder
    for value in values:
        switch(value)
        decoders["plain", value] = PlainDecoder(target, batch_size=1, keep_cache=True, graphs=graphs, compile="auto")
        decoders["cycle", value] = SpeculativeDecoder(target, DrafterContext(model, target.head), batch_size=1,
                                                      graphs=graphs, compile="auto")
        for kind in ("plain", "cycle"):  # warm-up: compiles and captures every shape of the timed runs
            decoders[kind, value].run(RequestList(requests))
    times: dict[tuple[str, str], list[float]] = {key: [] for key in decoders}
    for _ in range(args.rounds):
        for (kind, value), decoder in decoders.items():
            switch(value)
            # The decoders share the target, whose cache each run takes over: a decoder's graphs,
            # captured over the cache of its own last run, are captured again in this untimed run.
            decoder.run(RequestList(requests))
            times[kind, value].append(ms_per_forward(decoder, requests, device))
    print(f"== {args.shape}, batch 1, {args.env} = {' then '.join(values)}, {args.rounds} rounds of 2 prompts x "
          f"{args.new_tokens} new tokens ({torch.cuda.get_device_name(device) if cuda else device})")
    for (kind, value), runs in times.items():
        ms = statistics.median(runs)
        steps = f", {ms / statistics.median(times['plain', value]):.3f} plain steps" if kind == "cycle" else ""
        print(f"  {kind} {value:8s} median {ms:.3f} ms per forward (range {min(runs):.3f}-{max(runs):.3f}){steps}; "
              f"runs: " + " ".join(f"{v:.3f}" for v in runs), flush=True)


if __name__ == "__main__":
    main()
