"""The whole-tensor amax a tensorwise float8 scale needs, eager and compiled, rows dynamic or
static: why `drafter/precision.py` gives repeating row counts graphs of their own.

    python -m benchmarks.amax_reduction            # CUDA only

Prints, for bf16 tensors of 40,960 rows by 4,096 and 12,288 columns (a Qwen3-8B drafter's
activations), the time of ``x.abs().max()`` and the bandwidth it implies: eager, compiled with
the row count dynamic or static, and the same with the 16-row padding inside the graph.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

ROWS = 40960
COLUMNS = (4096, 12288)


def amax(t: torch.Tensor) -> torch.Tensor:
    return t.abs().max()


def padded_amax(t: torch.Tensor) -> torch.Tensor:
    return F.pad(t, (0, 0, 0, -t.shape[0] % 16)).abs().max()


def _ms(fn, t: torch.Tensor, repeats: int = 20) -> float:
    for _ in range(3):  # compiles, then warm
        fn(t)
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(repeats):
        fn(t)
    torch.cuda.synchronize()
    return (time.perf_counter() - started) / repeats * 1e3


def measure(cols: int) -> dict[str, float]:
    """ms per amax of a [ROWS, cols] bf16 tensor, by variant."""
    x = torch.randn(ROWS, cols, device="cuda", dtype=torch.bfloat16)
    out = {"eager": _ms(amax, x)}
    for name, fn in (("compiled", amax), ("compiled, padding in the graph", padded_amax)):
        for dynamic in (True, False):
            torch._dynamo.reset()
            y = x.clone()
            if dynamic:
                torch._dynamo.mark_dynamic(y, 0)
            out[f"{name}, rows {'dynamic' if dynamic else 'static'}"] = _ms(torch.compile(fn, dynamic=dynamic), y)
    return out


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("amax_reduction: needs a CUDA GPU")
    print(f"whole-tensor amax on {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    for cols in COLUMNS:
        gb = ROWS * cols * 2 / 1e9
        print(f"  [{ROWS}, {cols}] bf16, {gb:.2f} GB")
        for name, ms in measure(cols).items():
            print(f"    {name:<45} {ms:7.3f} ms  {gb / ms:5.2f} TB/s")


if __name__ == "__main__":
    main()
