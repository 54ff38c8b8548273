"""Host CPU ops while inductor's compile-worker pool starts: why run/compile_workers.py keeps
torch.compile in the training process.

    python -m benchmarks.compile_pool [--seconds 15]     # needs Triton (the pool is Triton's)

Times a small batch of the CPU tensor ops a drafter step builds its batch with (a 32,768-row
broadcast sum, a ``repeat_interleave``, a copy into a fresh buffer) before anything compiles,
then wakes the pool as torch.compile's inductor backend does on its first call
(``maybe_warm_pool``: ``min(32, cores)`` worker processes, each importing torch and Triton) and
times the same batch every 0.5 s. With ``TORCHINDUCTOR_COMPILE_THREADS=1`` no pool starts.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

ROWS = 32768


def cpu_ops() -> None:
    x = torch.arange(ROWS)
    (x[:, None] + torch.arange(16)[None, :]).reshape(-1)
    z = torch.repeat_interleave(x, 4)
    torch.empty(z.numel() * 8, dtype=torch.uint8).copy_(z.view(torch.uint8))


def ms_per_batch(repeats: int = 40) -> float:
    started = time.perf_counter()
    for _ in range(repeats):
        cpu_ops()
    return (time.perf_counter() - started) / repeats * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=15.0, help="how long to time after the wake-up")
    args = parser.parse_args()
    from torch._inductor.async_compile import get_compile_threads, maybe_warm_pool
    print(f"{torch.get_num_threads()} intra-op threads, {get_compile_threads()} compile threads "
          f"(TORCHINDUCTOR_COMPILE_THREADS={os.environ.get('TORCHINDUCTOR_COMPILE_THREADS', 'unset')})")
    print(f"before the pool: {ms_per_batch():.3f} ms per batch of CPU ops")
    maybe_warm_pool()
    woken = time.perf_counter()
    while (since := time.perf_counter() - woken) < args.seconds:
        print(f"{since:5.1f} s after the wake-up: {ms_per_batch():.3f} ms", flush=True)
        time.sleep(0.5)


if __name__ == "__main__":
    main()
