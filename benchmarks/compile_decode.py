"""What torch.compile of the decode forward costs (compile seconds) and gives (ms per step), one run.

    python3 -m benchmarks.compile_decode qwen3-1.7b            # cases rows:prompts:new_tokens, default 1:4:128 256:256:64

For each case: the engine with compile off (a warm-up run, then a timed run), then compile on
(the first run, which compiles, timed as the compile's cost; then a timed run). The target is
random-weight (bench/assets.py), built once in $WORK/compile-decode-SHAPE (default /tmp).
DFLASH_DECODE_TUNE=1 adds Inductor's coordinate-descent tuning (decode/compiled.py).
"""

from __future__ import annotations

import os
import sys
import time

import torch

from benchmarks.profile_decode import requests
from dflash_ipc.bench.assets import build_random_target
from dflash_ipc.decode.engine import DecodeEngine, EngineSettings
from dflash_ipc.decode.requests import RequestList
from dflash_ipc.decode.target import BatchedTarget


def main() -> None:
    shape, cases = sys.argv[1], sys.argv[2:] or ["1:4:128", "256:256:64"]
    path = os.path.join(os.environ.get("WORK", "/tmp"), f"compile-decode-{shape}")
    if not os.path.exists(os.path.join(path, "config.json")):
        build_random_target(path, shape=shape, dtype="bfloat16")
    target = BatchedTarget(path, device="cuda:0", dtype="bfloat16")
    for case in cases:
        rows, n, new = (int(x) for x in case.split(":"))
        batch = requests(n, new, new)
        for setting in ("off", "on"):
            engine = DecodeEngine(target, settings=EngineSettings(max_rows=rows, compile=setting))
            times = []
            for _ in range(2):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                run = engine.run(RequestList(batch))
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            steps = run.stats.steps
            print(f"rows {rows} prompts {n} new {new} compile {setting}: first run {times[0]:.1f} s, timed run "
                  f"{times[1]:.3f} s, {run.num_generated / times[1]:,.0f} tok/s, {steps} steps, "
                  f"{1e3 * times[1] / max(steps, 1):.2f} ms/step (prefills included)", flush=True)
            engine.release()


if __name__ == "__main__":
    main()
