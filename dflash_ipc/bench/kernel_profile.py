"""Where a step's GPU time goes: kernel time per step by kind, from the torch profiler.

`bench drafter --profile N` runs N more steps under ``torch.profiler`` (CUDA kernels only) and
prints, per variant, the kernel time of one step split into kinds, and the costliest kernels
by name. The kinds come from kernel names (`kernel_kind`): cuBLAS/CUTLASS GEMMs, told apart
as float8 or not by the type tags in their names; flex attention (inductor's templates);
kernels inductor generated for the fused element-wise parts and the float8 scaling (amax and
casts); and everything else (eager ATen kernels, copies, optimizer). It answers "what did fp8
make faster, and what did it add" from one run of each variant, where a step's wall time
alone cannot.

Kernel time is summed over the GPU's kernels: overlapping kernels (other streams) count
twice, and idle gaps between kernels (launch latency, the CPU) do not count at all, so the
total may differ from the step's wall time; the report prints both.
"""

from __future__ import annotations

import collections
import re
import typing

KINDS = ("matmul fp8", "matmul", "attention", "fp8 scaling", "fused elementwise", "other")

_GEMM = re.compile(r"gemm|cutlass|xmma|nvjet|cublas|wgmma", re.IGNORECASE)
# The type tags of float8 GEMMs: CUTLASS/xmma spell the types (e4m3); cuBLAS's Hopper nvjet
# kernels put a letter per operand type first (measured on H200: nvjet_sm90_tst_* for bf16,
# nvjet_sm90_qqtst_* / _qrtst_* for the float8 GEMMs of torch._scaled_mm).
_FP8 = re.compile(r"e4m3|e5m2|f8f8|fp8|float8|nvjet_(?:sm\d+_)?[qr]{2}", re.IGNORECASE)
_ATTENTION = re.compile(r"flex_attention|flex_decoding|flash|fmha", re.IGNORECASE)
# inductor names a kernel after the ops it fused: torchao's float8 casts take an amax, clamp
# to the format's range and convert (measured on H200: triton_red_fused_abs_max_*, or abs and
# max with the ops they fused between them, and triton_poi_fused__scaled_mm__to_copy_clamp_*)
_SCALING = re.compile(r"amax|abs_(?:\w+_)?max|clamp|_scaled_mm|float8|fp8|e4m3|e5m2", re.IGNORECASE)


def kernel_kind(name: str) -> str:
    """One of KINDS for a CUDA kernel's name (a heuristic on the names cuBLAS, CUTLASS and
    inductor give their kernels: "matmul" is a GEMM without a float8 type tag in its name)."""
    if name.startswith("triton_tem") or _ATTENTION.search(name):  # inductor's templates: flex attention
        return "attention"
    if name.startswith("_float8_cast"):  # the delayed recipe's own cast (drafter/float8_cast.py)
        return "fp8 scaling"
    if name.startswith("triton_"):
        return "fp8 scaling" if _SCALING.search(name) else "fused elementwise"
    if _GEMM.search(name):
        return "matmul fp8" if _FP8.search(name) else "matmul"
    return "other"


def summarize(kernels: typing.Iterable[tuple[str, float]], *, steps: int, top: int = 8) -> dict:
    """``kernels``: (name, microseconds) of every kernel run over ``steps`` steps. Returns
    ms per step by kind (every kind of KINDS, in order), the total, and the ``top`` kernels by
    time as (name, kind, ms per step, launches per step)."""
    if steps < 1:
        raise ValueError(f"steps={steps} must be >= 1")
    by_kind = dict.fromkeys(KINDS, 0.0)
    by_name: collections.Counter = collections.Counter()
    launches: collections.Counter = collections.Counter()
    for name, us in kernels:
        by_kind[kernel_kind(name)] += us
        by_name[name] += us
        launches[name] += 1
    per_step = {kind: us / 1e3 / steps for kind, us in by_kind.items()}
    costliest = [(name, kernel_kind(name), us / 1e3 / steps, launches[name] / steps)
                 for name, us in by_name.most_common(top)]
    return {"steps": steps, "ms_per_step": per_step, "total_ms": sum(per_step.values()), "top": costliest}


def profile_kernels(run_step: typing.Callable[[], None], steps: int) -> list[tuple[str, float]]:
    """(name, microseconds) of every CUDA kernel of ``steps`` calls of ``run_step``."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            run_step()
        torch.cuda.synchronize()
    out = []
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            us = getattr(event, "device_time", None)
            out.append((event.name, float(us if us is not None else event.cuda_time)))
    return out


def format_profile(summary: dict, *, label: str, wall_ms: float | None = None) -> str:
    # A step of a few ms (a decode cycle) is made of kernels of microseconds: three decimals there.
    digits = 3 if max(summary["total_ms"], wall_ms or 0.0) < 10 else 1
    wall = f", step wall time {wall_ms:.{digits}f} ms" if wall_ms is not None else ""
    lines = [f"kernel time per step ({label}, {summary['steps']} profiled steps): {summary['total_ms']:.{digits}f} ms{wall}"]
    total = summary["total_ms"] or 1.0
    for kind, ms in summary["ms_per_step"].items():
        lines.append(f"  {kind:<18} {ms:8.{digits}f} ms  {100 * ms / total:5.1f}%")
    lines.append("  costliest kernels (ms per step, launches per step):")
    for name, kind, ms, calls in summary["top"]:
        lines.append(f"    {ms:8.{digits}f} ms {calls:5.0f}x  {kind:<18} {name[:100]}")
    return "\n".join(lines)
