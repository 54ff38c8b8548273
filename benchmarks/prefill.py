"""A prefill's time at prompt widths it has not seen and at widths it has: eager, per SDPA
setting, through the compiled layers, and those replayed as CUDA graphs.

For a random-weight target of a bench shape (bench/assets.py; built once into
$WORK/profile-decode-SHAPE, shared with profile_decode.py), BatchedTarget.prefill of ``--rows``
random prompts of one width, timed synchronised: first at ``--widths`` widths new to the
process, then at the same widths again. The cases (CASES): eager with each setting of
$DFLASH_DECODE_PREFILL_SDPA (decode/prefill_sdpa.py), then ``compiled=True`` (the layer scope's
compiled layers, decode/compiled.py; its first call, which compiles, is not timed) with the
default setting, then through decode/prefill_graphs.py (the compiled layers captured per width
bucket: a fresh width of a new bucket captures, a repeated one replays); each case gets widths
of its own, so each sees fresh ones. Printed per case:
median ms of a fresh width and of a repeated one, the host's part of each (the call's return,
before the GPU finishes), then one more fresh width under the torch profiler: the host ops of
most self time and the attention kernels that ran.

    python3 -m benchmarks.prefill qwen3-1.7b                  # 1 row, 8 widths from 97
    python3 -m benchmarks.prefill qwen3-1.7b --rows 16 --widths 6 --start 300

DEV=cpu runs it on the CPU (no profile; the setting then changes nothing).
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time

import numpy as np
import torch

from dflash_ipc.bench.assets import build_random_target
from dflash_ipc.decode.cache import static_cache
from dflash_ipc.decode.prefill_graphs import PrefillGraphs
from dflash_ipc.decode.prefill_sdpa import PREFILL_SDPA_ENV
from dflash_ipc.decode.target import BatchedTarget

CASES = (("eager", "off"), ("eager", "auto"), ("compiled", "auto"), ("graphed", "auto"))
"""(forward, $DFLASH_DECODE_PREFILL_SDPA): a compiled graph keeps the kernels it was traced with,
so the compiled and graphed cases run the default setting only."""
ATTENTION_WORDS = ("attention", "fmha", "cudnn", "sdpa", "flash")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shape")
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--widths", type=int, default=8, help="fresh widths per setting")
    parser.add_argument("--start", type=int, default=97, help="the first width")
    args = parser.parse_args()
    device = os.environ.get("DEV", "cuda:0")
    cuda = device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    path = os.path.join(os.environ.get("WORK", "/tmp"), f"profile-decode-{args.shape}")
    if not os.path.exists(os.path.join(path, "config.json")):
        build_random_target(path, shape=args.shape, dtype="bfloat16")
    target = BatchedTarget(path, device=device, dtype="bfloat16" if cuda else "float32")
    top_width = args.start + 16 * (args.widths + 1) + len(CASES)
    target.cache = static_cache(target.num_layers, args.rows, -(-top_width // 256) * 256)
    rng = np.random.default_rng(0)
    rows = list(range(args.rows))

    def body(ids, lengths, rows_):
        return target.prefill_packed(ids, lengths, rows_, features=False, compiled=True).logits

    graphs = PrefillGraphs(target, body, lambda: True, enabled=cuda)

    def prefill(width: int, forward: str = "eager") -> tuple[float, float]:
        prompts = [rng.integers(10, 1000, size=width) for _ in rows]
        sync()
        t0 = time.perf_counter()
        with torch.inference_mode():  # as the decoders run (Dynamo's guards include it)
            if forward != "graphed" or graphs(rows, prompts) is None:
                target.prefill(rows, prompts, features=False, compiled=forward != "eager")
        host = time.perf_counter() - t0
        sync()
        return 1e3 * (time.perf_counter() - t0), 1e3 * host

    prefill(args.start - 1)  # the process's first forward (cuBLAS handles, allocator) counted nowhere
    print(f"== prefill, {args.shape}, {args.rows} row(s), {target.num_layers} layers, {device}")
    for index, (forward, setting) in enumerate(CASES):
        os.environ[PREFILL_SDPA_ENV] = setting
        if forward == "compiled":
            t0 = time.perf_counter()
            prefill(args.start - 2, forward)
            print(f"  compiled: first call (compiles) {time.perf_counter() - t0:.1f} s", flush=True)
        # widths of this case's own: 16 apart, offset by the case's index
        widths = [args.start + 16 * i + index for i in range(args.widths)]
        fresh = [prefill(w, forward) for w in widths]
        again = [prefill(w, forward) for w in widths]
        med = lambda xs, k: statistics.median(x[k] for x in xs)  # noqa: E731
        captured = f", {graphs.num_captures} graphs captured" if forward == "graphed" else ""
        print(f"  {forward}, ${PREFILL_SDPA_ENV}={setting}: widths {widths[0]}..{widths[-1]}: fresh width "
              f"{med(fresh, 0):.2f} ms (host {med(fresh, 1):.2f}; each: "
              f"{', '.join(f'{x[0]:.1f}' for x in fresh)}), repeated width {med(again, 0):.2f} ms "
              f"(host {med(again, 1):.2f}){captured}", flush=True)
        if cuda:
            profile_one(functools.partial(prefill, forward=forward), widths[-1] + 8)
    os.environ.pop(PREFILL_SDPA_ENV, None)


def profile_one(prefill, width: int) -> None:
    """One fresh-width prefill under the profiler: host ops by self time, attention kernels."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        ms, _ = prefill(width)
    averages = prof.key_averages()
    host = sorted(averages, key=lambda e: e.self_cpu_time_total, reverse=True)[:6]
    print(f"    profiled fresh width {width}: {ms:.1f} ms; host ops by self time: "
          + "; ".join(f"{e.key} {e.self_cpu_time_total / 1e3:.2f} ms x{e.count}" for e in host))
    kernels = [e for e in averages if getattr(e, "self_device_time_total", 0) > 0
               and any(w in e.key.lower() for w in ATTENTION_WORDS)]
    print("    attention kernels: " + ("; ".join(f"{e.key[:80]} {e.self_device_time_total / 1e3:.3f} ms x{e.count}"
                                         for e in kernels) or "none named so"))


if __name__ == "__main__":
    main()
