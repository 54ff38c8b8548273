"""Opt-in GPU profile of a worker, to show (not claim) that hidden states never touch the host.

With `DFLASH_IPC_PROFILE_DIR` set, a target or drafter profiles iterations
[skip, skip + count) with the PyTorch profiler, exports the trace and writes
`<dir>/<role>-memcpy.json`: every device<->host copy the GPU did, by direction, with its
count and largest size. A hidden-state batch is megabytes; token ids and control values are
kilobytes, so the largest host copy tells at once whether features went through the host.
"""

from __future__ import annotations

import json
import logging
import os

import torch

log = logging.getLogger(__name__)

ENV_DIR = "DFLASH_IPC_PROFILE_DIR"
ENV_SKIP = "DFLASH_IPC_PROFILE_SKIP"
ENV_COUNT = "DFLASH_IPC_PROFILE_COUNT"


def summarize_memcpy(trace_path: str) -> dict:
    """{direction: {count, total_bytes, max_bytes}} from a Chrome trace of the profiler."""
    with open(trace_path) as f:
        events = json.load(f).get("traceEvents", [])
    summary: dict = {}
    for event in events:
        if event.get("cat") != "gpu_memcpy":
            continue
        name = event.get("name", "")
        direction = ("DtoH" if "DtoH" in name else "HtoD" if "HtoD" in name
                     else "PtoP" if "PtoP" in name else "DtoD" if "DtoD" in name else name)
        size = int(event.get("args", {}).get("bytes", 0))
        entry = summary.setdefault(direction, {"count": 0, "total_bytes": 0, "max_bytes": 0})
        entry["count"] += 1
        entry["total_bytes"] += size
        entry["max_bytes"] = max(entry["max_bytes"], size)
    return summary


class IterationProfiler:
    """Call `step()` once per batch (target) or optimizer step (drafter)."""

    def __init__(self, role: str, device: torch.device) -> None:
        self.dir = os.environ.get(ENV_DIR)
        self.role = role.replace("/", "-")
        self.skip = int(os.environ.get(ENV_SKIP, "5"))
        self.count = int(os.environ.get(ENV_COUNT, "20"))
        self.enabled = bool(self.dir) and device.type == "cuda"
        self.iteration = 0
        self.profiler = None

    def step(self) -> None:
        if not self.enabled:
            return
        self.iteration += 1
        if self.iteration == self.skip:
            self.profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                               torch.profiler.ProfilerActivity.CUDA])
            self.profiler.__enter__()
        elif self.iteration == self.skip + self.count and self.profiler is not None:
            self.finish()

    def finish(self) -> None:
        if self.profiler is None:
            return
        torch.cuda.synchronize()
        self.profiler.__exit__(None, None, None)
        os.makedirs(self.dir, exist_ok=True)
        trace = os.path.join(self.dir, f"{self.role}-trace.json")
        self.profiler.export_chrome_trace(trace)
        summary = {"role": self.role, "iterations": self.iteration - self.skip,
                   "memcpy": summarize_memcpy(trace)}
        with open(os.path.join(self.dir, f"{self.role}-memcpy.json"), "w") as f:
            json.dump(summary, f, indent=1)
        os.remove(trace)  # large; the summary is what matters
        log.info("profile of %d iterations: %s", summary["iterations"], summary["memcpy"])
        self.profiler = None
