"""Where a speculative cycle's time goes at batch 1: wall time per cycle against kernel time by kind.

    python3 -m benchmarks.profile_speculative qwen3-1.7b            # 2 prompts of 128 new tokens
    python3 -m benchmarks.profile_speculative qwen3-1.7b 4 256      # prompts, new tokens
    TOP=40 python3 -m benchmarks.profile_speculative qwen3-1.7b     # the 40 costliest kernels (16)
    TIMELINE=1 python3 -m benchmarks.profile_speculative qwen3-1.7b # and one cycle kernel by kernel

The random-weight target and drafter of `bench eval` (bench/eval.py: built once in
$WORK/profile-spec-SHAPE, default /tmp), the greedy SpeculativeDecoder at batch 1 with its cycle
captured as a CUDA graph and the target's forward compiled (`bench eval`'s batch-1 speculative
row), with its cycles committed one at a time and then run one ahead of the host
(eval/decoding.py): per mode an untimed warm-up run and a timed run (wall ms per cycle), then a
run of the second under the torch profiler, whose kernel time per cycle is printed by kind with the costliest kernels
(bench/kernel_profile.py; prefill kernels counted in). Wall minus kernel time is the GPU
waiting on the host: the cycle's read of the accepted tokens and the Python around it. Before
the profile, one more run of the first mode with its stages synchronised and timed (STAGES: the
admission, and within it the target's prefill and the drafter's context; the cycles): how much
of the wall per cycle each prompt's start costs (on CUDA a captured cycle appends the drafter's
context inside its graph, so every append counted there is an admission's).
TIMELINE=1 then traces one more run and prints its cycle of median length kernel by kernel, each
with what it added to the cycle's length (bench/kernel_timeline.py: meaningful with PDL on, where
kernel times overlap), and those additions by kernel and grid, median and mean over the run's cycles.
DEV=cpu runs it eagerly on the CPU (no profile), e.g. with the `tiny` shape.
"""

from __future__ import annotations

import functools
import os
import statistics
import sys
import time

import torch

from dflash_ipc.bench.assets import build_random_target
from dflash_ipc.bench.eval import bench_drafter, random_prompts
from dflash_ipc.bench.kernel_profile import format_profile, profile_kernels, summarize
from dflash_ipc.bench.kernel_timeline import format_slice, group_added, slices, trace_kernels
from dflash_ipc.decode.requests import Request, RequestList
from dflash_ipc.decode.target import BatchedTarget
from dflash_ipc.eval.decoding import BatchedDecoder, SpeculativeDecoder
from dflash_ipc.eval.drafter_context import DrafterContext

STAGES = ((BatchedDecoder, "_admit"), (BatchedTarget, "prefill"), (DrafterContext, "append"),
          (SpeculativeDecoder, "_step"))
"""(class, method) timed synchronised in the staged run; prefill and append run within _admit."""


def timed_stages(run, sync) -> dict[str, float]:
    """Seconds spent in each of STAGES during ``run()``, every call synchronised before and after."""
    spent: dict[str, float] = {}

    def timed(name, fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            sync()
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                sync()
                spent[name] = spent.get(name, 0.0) + time.perf_counter() - t0
        return wrapper

    originals = [(cls, name, cls.__dict__[name]) for cls, name in STAGES]
    for cls, name, fn in originals:
        setattr(cls, name, timed(f"{cls.__name__}.{name}", fn))
    try:
        sync()
        t0 = time.perf_counter()
        run()
        sync()
        spent["wall"] = time.perf_counter() - t0
    finally:
        for cls, name, fn in originals:
            setattr(cls, name, fn)
    return spent


def main() -> None:
    shape = sys.argv[1]
    num_prompts, new_tokens = (int(a) for a in (sys.argv[2:4] + ["2", "128"][len(sys.argv[2:4]):]))
    path = os.path.join(os.environ.get("WORK", "/tmp"), f"profile-spec-{shape}")
    if not os.path.exists(os.path.join(path, "config.json")):
        build_random_target(path, shape=shape, dtype="bfloat16")
    device = torch.device(os.environ.get("DEV", "cuda:0"))
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    dtype = torch.bfloat16 if cuda else torch.float32
    model = bench_drafter(path, shape, device=device, dtype=dtype, seed=0)
    target = BatchedTarget(path, layer_ids=model.config.target_layer_ids, device=device,
                           dtype=str(dtype).removeprefix("torch."))
    prompts = random_prompts(num_prompts, (64, 256), 0)
    for run_ahead in (False, True):
        decoder = SpeculativeDecoder(target, DrafterContext(model, target.head), batch_size=1,
                                     graphs="on" if cuda else "off", compile="auto", run_ahead=run_ahead)

        def run():
            return decoder.run(RequestList(Request(key=(i, 0), prompt_ids=p, max_new_tokens=new_tokens)
                                           for i, p in enumerate(prompts)))

        run()  # warm-up: compiles and captures every shape of the timed run
        sync()
        t0 = time.perf_counter()
        result = run()
        sync()
        wall = time.perf_counter() - t0
        cycles = sum(g.stats.num_cycles for g in result.generations)
        ms = 1e3 * wall / max(1, cycles)
        print(f"== {shape}: batch 1, {num_prompts} prompts of {new_tokens} new tokens, run ahead {run_ahead}, "
              f"fused groups {target.num_fused_groups}, matvec linears {target.num_matvec_linears}, kernel "
              f"attention layers {target.num_kernel_attention}: "
              f"{result.num_generated} tokens in {wall:.3f} s, {cycles} cycles ({decoder.num_ahead} queued ahead "
              f"over both runs), {ms:.2f} ms wall per cycle (prefills included)", flush=True)
        if not run_ahead:  # a staged run breaks the run-ahead anyway: measured where it is off
            spent = timed_stages(run, sync)
            print(f"   synchronised stages, ms per cycle ({cycles} cycles, {num_prompts} prompts): "
                  + ", ".join(f"{k} {1e3 * v / max(1, cycles):.3f}" for k, v in spent.items())
                  + "; ms per prompt: " + ", ".join(f"{k} {1e3 * v / num_prompts:.1f}" for k, v in spent.items()
                                                   if k != "wall" and "_step" not in k), flush=True)
    if not cuda:
        return
    kernels = profile_kernels(run, 1)
    top = int(os.environ.get("TOP", "16"))
    print(format_profile(summarize(kernels, steps=max(1, cycles), top=top), label="per cycle, prefills included",
                         wall_ms=ms))
    if os.environ.get("TIMELINE", "0") not in ("", "0"):
        print_timeline(trace_kernels(run), top)


CYCLE_END = "_accept_kernel"
"""The name of a greedy cycle's last kernel (decode/accept.py)."""


def print_timeline(kernels, top: int) -> None:
    """The cycle of median length in the traced run kernel by kernel (a cycle with a prompt's
    admission, or one the host kept waiting, is longer than most), then the time each kernel (by
    name and grid) added to a cycle: the median over the run's cycles, and the mean beside it."""
    cycles = slices(kernels, CYCLE_END)
    if len(cycles) < 3:
        print(f"timeline: {len(cycles)} cycles ended by {CYCLE_END} in the trace", flush=True)
        return
    ends = [max(k.end_us for k in c) for c in cycles]
    spans = [(ends[i] - ends[i - 1], i) for i in range(1, len(cycles))]
    span, mid = sorted(spans)[len(spans) // 2]
    print(f"== the cycle of median length ({span:.1f} us; number {mid} of {len(cycles)}), kernel by kernel:\n"
          + format_slice(cycles[mid], ends[mid - 1]), flush=True)
    per_cycle: dict[str, list[float]] = {}
    counts: dict[str, int] = {}
    for i in range(1, len(cycles)):
        for key, (us, n) in group_added(cycles[i], ends[i - 1], key=lambda k: f"{k.name[:60]} grid {k.grid}").items():
            per_cycle.setdefault(key, [0.0] * (len(cycles) - 1))[i - 1] = us
            counts[key] = counts.get(key, 0) + n
    per = len(cycles) - 1
    rows = sorted(((statistics.median(v), sum(v) / per, counts[k] / per, k) for k, v in per_cycle.items()),
                  reverse=True)
    print(f"== added time per cycle by kernel and grid over {per} cycles (median, mean us; launches a cycle):",
          flush=True)
    for median, mean, n, key in rows[:top]:
        print(f"  {median:8.2f} {mean:8.2f} us {n:6.2f}x  {key}", flush=True)


if __name__ == "__main__":
    main()
