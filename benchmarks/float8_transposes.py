"""The delayed recipe's step with the cast kernel's transposed weights against torch's, in one process.

    python3 -m benchmarks.float8_transposes                  # qwen3-8b, 6 timed steps each
    python3 -m benchmarks.float8_transposes --shape qwen3-1.7b --steps 10

drafter/float8_cast.py writes a float32 master weight's float8 copy in both layouts in one
kernel; where its first transposed output of a (device, source, format, K) does not match its
row-major one transposed, torch's copy of the row-major output takes over. Both are timed
here, with the bf16 step of the same run as the baseline: ``bench drafter``'s step
(bench/drafter.py) for bf16, fp8 delayed as it runs, then fp8 delayed with every float32
source's transpose forced to torch's. Printed: each run's report, then a table of the steps
(synchronised and pipelined) and their speedup over bf16.
"""

from __future__ import annotations

import argparse

import torch

from dflash_ipc.bench import drafter as bench
from dflash_ipc.drafter import float8_cast

DELAYED = {"precision": "fp8", "fp8_recipe": "delayed", "fp8_lm_head": "all"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen3-8b")
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    runs = {}

    def step(name: str, variant: dict) -> None:
        runs[name] = bench.run_drafter_bench(args.device, steps=args.steps, shape=args.shape,
                                             warmup=args.warmup, variant=variant)

    step("bf16", {"precision": "bf16"})
    step("fp8 delayed, kernel transposes", DELAYED)
    kernel_ok = dict(float8_cast._kernel_transposes_right)
    for key in kernel_ok:  # the same shapes run again: as if each weight's first-use check had failed
        if key[1] == torch.float32:
            float8_cast._kernel_transposes_right[key] = False
    step("fp8 delayed, torch transposes of float32", DELAYED)
    device = torch.device(args.device)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)
    print(f"\nfloat8 transposes at {args.shape} on {where}, one process; "
          f"the kernel's first-use checks: {_checks(kernel_ok)}")
    print(f"  {'variant':44s} {'step ms':>8s} {'pipelined':>9s} {'speedup':>8s}")
    base = runs["bf16"]["step_s_mean"]
    for name, figures in runs.items():
        print(f"  {name:44s} {figures['step_s_mean'] * 1e3:8.1f} {figures['pipelined_step_s_mean'] * 1e3:9.1f} "
              f"{base / figures['step_s_mean']:7.2f}x")


def _checks(checked: dict) -> str:
    return ", ".join(f"{str(src).removeprefix('torch.')} [*, {k}] -> {str(fmt).removeprefix('torch.')} "
                     f"{'right' if right else 'WRONG'}" for (_, src, fmt, k), right in checked.items()) or "none ran"


if __name__ == "__main__":
    main()
