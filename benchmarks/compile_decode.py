"""What torch.compile of the decode forward costs (compile seconds) and gives (ms per step), one run.

    python3 -m benchmarks.compile_decode qwen3-1.7b            # cases rows:prompts:new_tokens, default 1:4:128 256:256:64
    python3 -m benchmarks.compile_decode qwen3-1.7b 1:4:128 --scope layer,forward

For each case: the engine with compile off (a warm-up run, then a timed run), then compile on in
each ``--scope`` (decode/compiled.py SCOPES; default layer): the first run, which compiles, timed
as the compile's cost, then a timed run. The target is random-weight (bench/assets.py), built
once in $WORK/compile-decode-SHAPE (default /tmp), loaded once per scope. Inductor keeps what it
compiled on disk and reuses it in later processes: a fresh $TORCHINDUCTOR_CACHE_DIR measures the
cold compile. DFLASH_DECODE_TUNE=1 adds Inductor's coordinate-descent tuning (decode/compiled.py).
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from benchmarks.profile_decode import requests
from dflash_ipc.bench.assets import build_random_target
from dflash_ipc.decode.compiled import SCOPES
from dflash_ipc.decode.engine import DecodeEngine, EngineSettings
from dflash_ipc.decode.requests import RequestList
from dflash_ipc.decode.target import BatchedTarget


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shape", help="bench/assets.py SHAPES name")
    parser.add_argument("cases", nargs="*", default=["1:4:128", "256:256:64"], help="rows:prompts:new_tokens")
    parser.add_argument("--scope", default="layer", help=f"comma-separated compile scopes, of {list(SCOPES)}")
    args = parser.parse_args()
    args.scopes = args.scope.split(",")
    if not set(args.scopes) <= set(SCOPES):
        parser.error(f"--scope {args.scope}: allowed {list(SCOPES)}")
    return args


def timed_runs(engine: DecodeEngine, batch) -> tuple[list[float], object]:
    """Two runs of ``batch``: their seconds, and the second run."""
    times = []
    for _ in range(2):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        run = engine.run(RequestList(batch))
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return times, run


def main() -> None:
    args = parse_args()
    path = os.path.join(os.environ.get("WORK", "/tmp"), f"compile-decode-{args.shape}")
    if not os.path.exists(os.path.join(path, "config.json")):
        build_random_target(path, shape=args.shape, dtype="bfloat16")
    for i, scope in enumerate(args.scopes):
        target = BatchedTarget(path, device="cuda:0", dtype="bfloat16", compile_scope=scope)
        for case in args.cases:
            rows, n, new = (int(x) for x in case.split(":"))
            batch = requests(n, new, new)
            for setting in ("off", "on") if i == 0 else ("on",):
                engine = DecodeEngine(target, settings=EngineSettings(max_rows=rows, compile=setting))
                times, run = timed_runs(engine, batch)
                steps = run.stats.steps
                label = f"compile {setting}" + (f" scope {scope}" if setting == "on" else "")
                print(f"rows {rows} prompts {n} new {new} {label}: first run {times[0]:.1f} s, timed run "
                      f"{times[1]:.3f} s, {run.num_generated / times[1]:,.0f} tok/s, {steps} steps, "
                      f"{1e3 * times[1] / max(steps, 1):.2f} ms/step (prefills included)", flush=True)
                engine.release()
        del target
        torch._dynamo.reset()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
