"""The decoding core's batch-1 step with one decode switch on and off, in one process.

    python3 -m benchmarks.decode_switch qwen3-1.7b                       # DFLASH_DECODE_ATTENTION
    python3 -m benchmarks.decode_switch qwen3-1.7b --env DFLASH_DECODE_GEMV --profile

For a random-weight target of a bench shape (bench/assets.py; built once into
$WORK/profile-decode-SHAPE), per setting of the switch (``auto``, then ``off``; the target is
built anew for each, since the switches are read when it is) the engine (decode/engine.py:
CUDA graphs, compiled decode layers) decodes at batch 1 two prompts of 64..256 random tokens
(benchmarks/profile_decode.py ``requests``) in three cases: 256 new tokens each, and 128 with
and without the greedy margins that eval's lossless check keeps. Each case runs twice (the
first captures its graphs) and the second is printed: tokens/s and wall ms per step, prefills
and harvests included. ``--profile``: the first case once more under the torch profiler,
kernel time per step by kind and the costliest kernels (bench/kernel_profile.py).
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from benchmarks.profile_decode import requests
from dflash_ipc.bench.assets import SHAPES, build_random_target
from dflash_ipc.bench.kernel_profile import profile_kernels, summarize
from dflash_ipc.decode.engine import DecodeEngine, EngineSettings
from dflash_ipc.decode.requests import RequestList
from dflash_ipc.decode.sampler import TokenChoice
from dflash_ipc.decode.target import BatchedTarget

CASES = ((256, False), (128, True), (128, False))
"""(new tokens per prompt, greedy margins kept)."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("--env", default="DFLASH_DECODE_ATTENTION", help="the switch (auto, then off)")
    parser.add_argument("--profile", action="store_true", help="kernel time of the first case, per setting")
    parser.add_argument("--top", type=int, default=30, help="kernels listed by --profile")
    args = parser.parse_args()
    path = os.path.join(os.environ.get("WORK", "/tmp"), f"profile-decode-{args.shape}")
    if not os.path.exists(os.path.join(path, "config.json")):
        build_random_target(path, shape=args.shape, dtype="bfloat16")
    for setting in ("auto", "off"):
        os.environ[args.env] = setting
        target = BatchedTarget(path, device="cuda:0", dtype="bfloat16")
        for new, margins in CASES:
            engine = DecodeEngine(target, TokenChoice(), EngineSettings(max_rows=1, keep_margins=margins))
            batch = requests(2, new, new)
            for _ in range(2):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                result = engine.run(RequestList(batch))
                torch.cuda.synchronize()
                wall = time.perf_counter() - t0
            s = result.stats
            print(f"{args.env}={setting}, {new} new tokens, margins {margins}: {result.num_generated} tokens in "
                  f"{wall:.3f} s = {result.num_generated / wall:.1f} tok/s, {1e3 * wall / s.steps:.3f} ms per step "
                  f"({s.steps} steps, {s.prefills} prefills, {s.harvests} harvests)", flush=True)
            if args.profile and (new, margins) == CASES[0]:
                summary = summarize(profile_kernels(lambda: engine.run(RequestList(batch)), 1), steps=s.steps,
                                    top=args.top)
                print(f"  kernel time per step {summary['total_ms']:.3f} ms: " + ", ".join(
                    f"{kind} {ms:.3f}" for kind, ms in summary["ms_per_step"].items()))
                for name, kind, ms, calls in summary["top"]:
                    print(f"  {1e3 * ms:8.1f} us {calls:6.1f}x {1e3 * ms / calls:6.2f} us each  {kind:<17} {name[:120]}")
            engine.release()
        del target
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
