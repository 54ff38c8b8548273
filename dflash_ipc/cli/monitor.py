"""`status`, `health` and `report`: what a running or finished job is doing, and did."""

from __future__ import annotations

import sys

import click

from dflash_ipc.run.json_files import json_safe
from dflash_ipc.cli.app import main



@main.command()
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print the raw status as JSON.")
def status(run_dir, as_json) -> None:
    """Live rates and queue depths, asked from the running dispatcher."""
    from dflash_ipc.supervise.status_query import query_status
    click.echo(query_status(run_dir, as_json=as_json))


@main.command()
@click.argument("run_dir", type=click.Path(file_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option("--stale-after", "stale_after_s", type=float, default=None,
              help="Heartbeat age (s) that degrades a worker (default: dispatch.heartbeat_timeout_s / 2).")
@click.option("--stall-after", "stall_after_s", type=float, default=None,
              help="Seconds without progress that degrade (default: 2 x dispatch.heartbeat_timeout_s).")
@click.option("--timeout", "timeout_s", type=float, default=2.0, show_default=True,
              help="Seconds to wait for the dispatcher's status.")
@click.option("--node-rank", type=click.IntRange(min=0), default=0, show_default=True,
              help="Which node's processes to check (run it on that node); the dispatcher is asked from any.")
def health(run_dir, as_json, stale_after_s, stall_after_s, timeout_s, node_rank) -> None:
    """Per-process health (psutil, heartbeats, progress). Exit 0 healthy, starting or finished, 1 degraded, 2 down."""
    import json
    from dflash_ipc.supervise.health import format_health, health_report
    report = health_report(run_dir, node_rank=node_rank, stale_after_s=stale_after_s,
                           stall_after_s=stall_after_s, timeout_s=timeout_s)
    click.echo(json.dumps(json_safe(report.to_json()), indent=1, allow_nan=False) if as_json else format_health(report))
    sys.exit(report.exit_code)


@main.command("report")
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--out", "out_path", type=click.Path(dir_okay=False), default=None,
              help="PNG to write (default RUN_DIR/report.png; its numbers go beside it as .json).")
def report(run_dir, out_path) -> None:
    """Worker states, token rates, memory, loss and lr, latest eval: a PNG and its numbers as JSON."""
    from dflash_ipc.report import build_report, format_summary
    summary = build_report(run_dir, out_path)
    click.echo(format_summary(summary))
    loss = ("loss -" if summary["loss_first"] is None
            else f"loss {summary['loss_first']:.3f} -> {summary['loss_last']:.3f}")
    click.echo(f"{loss}; panels {', '.join(summary['panels'])}; wrote {summary['png']} and {summary['json']}")
