"""Where the decoding core's step time goes: wall time per stage and kernel time per step by kind.

For a random-weight target of a bench shape (bench/assets.py; built once into $WORK/profile-decode-SHAPE),
each case runs the engine (decode/engine.py, CUDA graphs) on random prompts: an untimed warm-up
run (captures its graphs), a timed run (tokens/s, steps, prefills, wall ms per step), a run with
every stage (_admit, _harvest, _compact_if_sparse, _steps) synchronised and timed, and a run
under the torch profiler whose kernel time is printed per decode step by kind
(bench/kernel_profile.py; prefill kernels are counted in, spread over the steps).

    python3 -m benchmarks.profile_decode qwen3-1.7b                  # cases: batch 1; 256 rows, 128 new tokens
    python3 -m benchmarks.profile_decode qwen3-1.7b 256:1024:32:256:1  # rows:prompts:min_new:max_new:continuous

DEV=cpu runs it eagerly on the CPU (no kernel profile), e.g. with the `tiny` shape; WORK: where the
target is built (default /tmp).
"""

from __future__ import annotations

import functools
import os
import sys
import time

import numpy as np
import torch

from dflash_ipc.bench.assets import build_random_target
from dflash_ipc.bench.kernel_profile import format_profile, profile_kernels, summarize
from dflash_ipc.decode.engine import DecodeEngine, EngineSettings
from dflash_ipc.decode.requests import Request, RequestList
from dflash_ipc.decode.sampler import TokenChoice
from dflash_ipc.decode.target import BatchedTarget

DEFAULT_CASES = ("1:4:256:256:1", "256:256:128:128:0")
STAGES = ("_admit", "_harvest", "_compact_if_sparse", "_steps")


def requests(n: int, min_new: int, max_new: int, seed: int = 0) -> list[Request]:
    """Prompts of 64..256 random ids (log-uniform), budgets log-uniform in min_new..max_new."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        prompt = rng.integers(10, 1000, size=int(np.exp(rng.uniform(np.log(64), np.log(256)))))
        new = max_new if min_new == max_new else int(np.exp(rng.uniform(np.log(min_new), np.log(max_new))))
        out.append(Request(key=i, prompt_ids=prompt, max_new_tokens=new))
    return out


def main() -> None:
    shape, cases = sys.argv[1], sys.argv[2:] or list(DEFAULT_CASES)
    device = os.environ.get("DEV", "cuda:0")
    cuda = device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    path = os.path.join(os.environ.get("WORK", "/tmp"), f"profile-decode-{shape}")
    if not os.path.exists(os.path.join(path, "config.json")):
        build_random_target(path, shape=shape, dtype="bfloat16")
    target = BatchedTarget(path, device=device, dtype="bfloat16" if cuda else "float32")
    spent: dict[str, float] = {}

    def timed_stage(name, fn):
        @functools.wraps(fn)
        def wrapper(self, *args, **kwargs):
            sync()
            t0 = time.perf_counter()
            result = fn(self, *args, **kwargs)
            sync()
            spent[name] = spent.get(name, 0.0) + time.perf_counter() - t0
            return result
        return wrapper

    for case in cases:
        rows, n, min_new, max_new, continuous = (int(x) for x in case.split(":"))
        engine = DecodeEngine(target, TokenChoice(), EngineSettings(max_rows=rows, continuous=bool(continuous)))
        batch = requests(n, min_new, max_new)

        def run():
            sync()
            t0 = time.perf_counter()
            result = engine.run(RequestList(batch))
            sync()
            return result, time.perf_counter() - t0

        run()  # warm-up: every graph captured
        result, wall = run()
        s = result.stats
        ms_per_step = 1e3 * wall / max(1, s.steps)
        print(f"== {shape}: rows {rows}, {n} prompts, replies of {min_new}..{max_new} tokens, continuous "
              f"{bool(continuous)}: {result.num_generated:,} tokens in {wall:.2f} s = {result.num_generated / wall:,.0f} "
              f"tok/s; {s.steps} steps, {s.prefills} prefills, {s.harvests} harvests, {s.mean_rows:.1f} rows/step, "
              f"{ms_per_step:.2f} ms wall per step, {s.kv_positions_read / max(1, s.steps):,.0f} cached positions "
              f"read per step")
        originals = {name: getattr(DecodeEngine, name) for name in STAGES}
        spent.clear()
        for name, fn in originals.items():
            setattr(DecodeEngine, name, timed_stage(name, fn))
        try:
            _, wall_synced = run()
        finally:
            for name, fn in originals.items():
                setattr(DecodeEngine, name, fn)
        print("   synchronised stages (s): " + ", ".join(f"{k} {v:.3f}" for k, v in spent.items())
              + f"; wall {wall_synced:.2f}")
        if cuda:
            kernels = profile_kernels(lambda: engine.run(RequestList(batch)), 1)
            print(format_profile(summarize(kernels, steps=max(1, s.steps), top=12),
                                 label=f"per decode step, prefills included", wall_ms=ms_per_step))
        engine.release()


if __name__ == "__main__":
    main()
