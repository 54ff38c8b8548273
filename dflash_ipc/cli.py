"""`dflash-ipc`: the command line. Thin: click parses, the config builds, a class runs.

    dflash-ipc up [--config FILE] [-o key=value ...]     the whole job (= bin/dflash-up)
    dflash-ipc dispatcher|target|drafter --config FILE [--rank N]   one stage alone
    dflash-ipc prepare --model DIR --input FILE.jsonl --out DIR
    dflash-ipc export CHECKPOINT OUT_DIR
    dflash-ipc status|health RUN_DIR
    dflash-ipc bench transport|drafter
"""

from __future__ import annotations

import logging
import os
import signal
import sys

import click

from dflash_ipc.errors import DFlashError

log = logging.getLogger("dflash_ipc.cli")

DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                              "configs", "default.yaml")


def _load(config: str | None, overrides: tuple[str, ...]):
    from dflash_ipc.config import load_config
    if config is None and os.path.exists(DEFAULT_CONFIG):
        config = DEFAULT_CONFIG
    return load_config(config, list(overrides))


def _exit_on_sigterm() -> None:
    """SIGTERM unwinds like an exception, so `finally` blocks close pools and sockets."""
    def handler(signum, frame):
        raise SystemExit(128 + signum)
    signal.signal(signal.SIGTERM, handler)


def _stage_setup(role: str, cfg) -> None:
    from dflash_ipc.logs import setup_logging
    setup_logging(role, level=cfg.run.log_level)
    _exit_on_sigterm()
    if os.environ.get("DFLASH_IPC_SUPERVISED"):
        from dflash_ipc.supervise.children import ParentWatch
        ParentWatch().start()


config_option = click.option("--config", "config", type=click.Path(dir_okay=False), default=None,
                             help="YAML job config (default: configs/default.yaml).")
override_option = click.option("-o", "--override", "overrides", multiple=True, metavar="KEY=VALUE",
                               help="Override a config key, e.g. -o drafter.lr=3e-4 (repeatable).")


@click.group()
def main() -> None:
    """Train DFlash drafters from a frozen target, across processes and GPUs."""


@main.command()
@config_option
@override_option
def up(config, overrides) -> None:
    """Run the whole job: dispatcher, targets and drafters, supervised."""
    from dflash_ipc.logs import setup_logging
    from dflash_ipc.runinfo import resolve_job
    from dflash_ipc.supervise.supervisor import Supervisor
    cfg = _load(config, overrides)
    setup_logging("supervisor", level=cfg.run.log_level)
    cfg = resolve_job(cfg)
    log.info("run directory %s: %d targets on %s, %d drafters on %s", cfg.run.run_dir,
             cfg.target.num_workers, ",".join(cfg.target.devices), cfg.drafter.num_workers,
             ",".join(cfg.drafter.devices))
    sys.exit(Supervisor(cfg, print_status=lambda line: click.echo(line)).run())


@main.command()
@config_option
@override_option
def dispatcher(config, overrides) -> None:
    """Run the dispatcher alone."""
    from dflash_ipc.dispatch.proc import run_dispatcher
    from dflash_ipc.runinfo import resolve_job
    cfg = _load(config, overrides)
    _stage_setup("dispatcher", cfg)
    run_dispatcher(resolve_job(cfg))


@main.command()
@config_option
@override_option
@click.option("--rank", type=int, required=True, help="Target rank, 0..target.num_workers-1.")
def target(config, overrides, rank) -> None:
    """Run one target worker alone."""
    from dflash_ipc.runinfo import resolve_job
    from dflash_ipc.target.worker import run_target
    cfg = _load(config, overrides)
    _stage_setup(f"target/{rank}", cfg)
    run_target(resolve_job(cfg), rank)


@main.command()
@config_option
@override_option
@click.option("--rank", type=int, required=True, help="Drafter rank, 0..drafter.num_workers-1.")
def drafter(config, overrides, rank) -> None:
    """Run one drafter worker alone (all drafters must run to form the group)."""
    from dflash_ipc.drafter.worker import run_drafter
    from dflash_ipc.runinfo import resolve_job
    cfg = _load(config, overrides)
    _stage_setup(f"drafter/{rank}", cfg)
    run_drafter(resolve_job(cfg), rank)


@main.command()
@click.option("--model", "model_dir", required=True, type=click.Path(file_okay=False),
              help="Target model directory (its tokenizer and chat template are used).")
@click.option("--input", "input_path", required=True, type=click.Path(dir_okay=False), help="JSONL file.")
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False), help="Output dataset directory.")
@click.option("--max-length", default=4096, show_default=True, help="Longest sample in tokens.")
@click.option("--on-long", type=click.Choice(["truncate", "reject"]), default="truncate", show_default=True)
@click.option("--last-turn-only", is_flag=True, help="Loss on the last assistant turn only.")
@click.option("--workers", "num_workers", default=1, show_default=True, help="Tokenizer processes.")
@click.option("--strict", is_flag=True, help="Stop at the first bad row.")
@click.option("--overwrite", is_flag=True, help="Replace an existing dataset at --out.")
def prepare(model_dir, input_path, out_dir, max_length, on_long, last_turn_only, num_workers, strict, overwrite) -> None:
    """Tokenize a chat JSONL file into a memory-mapped training dataset."""
    from dflash_ipc.data.prepare import prepare_dataset
    report = prepare_dataset(model_dir, input_path, out_dir, max_length=max_length, last_turn_only=last_turn_only,
                             num_workers=num_workers, strict=strict, on_long=on_long, overwrite=overwrite)
    click.echo(f"{report.num_samples} samples written to {report.out_dir}, {report.num_rejected} rejected "
               f"({report.rejects_by_reason}) in {report.seconds:.1f}s, {report.samples_per_s:,.0f} samples/s")
    if report.num_rejected:
        click.echo(f"rejected rows: {report.rejects_path}")


@main.command()
@click.argument("checkpoint", type=click.Path(exists=True, file_okay=False))
@click.argument("out_dir", type=click.Path(file_okay=False))
def export(checkpoint, out_dir) -> None:
    """Write the SGLang/vLLM inference format (config.json + model.safetensors) of a checkpoint."""
    from dflash_ipc.drafter.export import export_training_checkpoint
    path = export_training_checkpoint(checkpoint, out_dir)
    click.echo(f"exported {path}")


@main.command()
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print the raw status as JSON.")
def status(run_dir, as_json) -> None:
    """Live rates and queue depths, asked from the running dispatcher."""
    from dflash_ipc.supervise.status_query import query_status
    click.echo(query_status(run_dir, as_json=as_json))


@main.group()
def bench() -> None:
    """Benchmarks that print figures."""


@bench.command("transport")
@click.option("--pair", "pairs", multiple=True, metavar="SRC,DST",
              help="Device pair, e.g. cuda:0,cuda:1 (repeatable; default: what this machine has).")
@click.option("--iters", default=50, show_default=True)
def bench_transport(pairs, iters) -> None:
    """Slot handoff latency and copy bandwidth against a plain device-to-device copy."""
    from dflash_ipc.bench.transport import run_transport_bench
    run_transport_bench(pairs=[tuple(pair.split(",")) for pair in pairs] or None, iters=iters)


@bench.command("drafter")
@click.option("--device", default="cuda:0", show_default=True)
@click.option("--steps", default=10, show_default=True)
@click.option("--shape", type=click.Choice(["qwen3-8b", "tiny"]), default="qwen3-8b", show_default=True,
              help="tiny: hidden 64, 2 layers, vocab 512, same step sizes (a quick GPU smoke test).")
def bench_drafter(device, steps, shape) -> None:
    """Step time and MFU of a Qwen3-8B-shaped drafter at 32,768 query tokens per step."""
    from dflash_ipc.bench.drafter import run_drafter_bench
    run_drafter_bench(device=device, steps=steps, shape=shape)


def run() -> None:
    """Console entry point: typed errors become one clear line and exit code 2."""
    try:
        main(standalone_mode=False)
    except click.exceptions.Abort:
        sys.exit(130)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except DFlashError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(2)


if __name__ == "__main__":
    run()
