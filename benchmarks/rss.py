"""Samples the host RSS of every process of a running job (from its processes.json).

    python -m benchmarks.rss RUN_DIR --interval 2 --out rss.csv

Stops when the job's supervisor is gone, then prints per role the first, the largest and the
last RSS: a flat line is the evidence that hidden states do not pile up in host memory.
"""

from __future__ import annotations

import json
import os
import time

import click
import psutil

from dflash_ipc.run.files import RunFiles


def sample_until_done(run_dir: str, interval_s: float, out_path: str, max_s: float) -> dict:
    path = RunFiles(run_dir).processes
    deadline = time.monotonic() + max_s
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.5)
    with open(path) as f:
        record = json.load(f)
    series: dict[str, list[float]] = {}
    started = time.monotonic()
    with open(out_path, "w") as out:
        out.write("t_s,role,pid,rss_mib\n")
        while psutil.pid_exists(record["supervisor"]) and time.monotonic() < deadline:
            now = time.monotonic() - started
            for proc in record["processes"]:
                try:
                    rss = psutil.Process(proc["pid"]).memory_info().rss / 2**20
                except psutil.Error:
                    continue
                series.setdefault(proc["role"], []).append(rss)
                out.write(f"{now:.1f},{proc['role']},{proc['pid']},{rss:.1f}\n")
            out.flush()
            time.sleep(interval_s)
    return {role: {"first_mib": v[0], "max_mib": max(v), "last_mib": v[-1], "samples": len(v)}
            for role, v in series.items()}


@click.command()
@click.argument("run_dir")
@click.option("--interval", default=2.0)
@click.option("--out", "out_path", default="rss.csv")
@click.option("--max-s", default=3600.0)
def main(run_dir, interval, out_path, max_s) -> None:
    summary = sample_until_done(run_dir, interval, out_path, max_s)
    for role, s in sorted(summary.items()):
        click.echo(f"{role:12s} RSS first {s['first_mib']:8.0f} MiB  max {s['max_mib']:8.0f} MiB  "
                   f"last {s['last_mib']:8.0f} MiB  ({s['samples']} samples)")


if __name__ == "__main__":
    main()
