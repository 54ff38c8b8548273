"""The `dflash-ipc` group and what its commands share: config loading, common options, checks."""

from __future__ import annotations

import os

import click

from dflash_ipc.errors import ConfigError


DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                              "configs", "default.yaml")


def load_job_config(config: str | None, overrides: tuple[str, ...]):
    from dflash_ipc.config.load import load_config
    if config is None and os.path.exists(DEFAULT_CONFIG):
        config = DEFAULT_CONFIG
    return load_config(config, list(overrides))


def checked_device(ctx, param, value: str) -> str:
    """--device: cpu or cuda:N of a GPU this machine has, else one error line (not a CUDA traceback)."""
    from dflash_ipc.config.machine import check_device
    check_device(value, "--device")
    return value


config_option = click.option("--config", "config", type=click.Path(dir_okay=False), default=None,
                             help="YAML job config (default: configs/default.yaml).")
override_option = click.option("-o", "--override", "overrides", multiple=True, metavar="KEY=VALUE",
                               help="Override a config key, e.g. -o optimizer.lr=3e-4 (repeatable).")


@click.group()
def main() -> None:
    """Train DFlash drafters from a frozen target, across processes and GPUs."""


def echo_report(report) -> None:
    """A prepare or regenerate report's summary line, its warnings, and where its rejects are."""
    click.echo(report.summary())
    for warning in report.warnings:
        click.echo(f"warning: {warning}", err=True)
    if report.num_rejected:
        click.echo(f"rejected rows: {report.rejects_path}")


input_option = click.option("--input", "input_path", required=True, type=click.Path(),
                            help="JSONL, JSON array, Parquet, a datasets save_to_disk directory, a directory "
                                 "of Parquet/JSON shards, or a Hub dataset id ORG/NAME.")
split_option = click.option("--split", default=None, help="Split of a directory input (default: train, or the only one).")
max_line_option = click.option("--max-line-bytes", type=click.IntRange(min=1), default=32 << 20, show_default=True,
                               help="Rows longer than this are rejected without being parsed.")
template_kwargs_option = click.option(
    "--chat-template-kwargs", "template_kwargs", multiple=True, metavar="JSON|KEY=VALUE",
    help="Chat-template variables, e.g. '{\"enable_thinking\": false}' or enable_thinking=false (repeatable).")


def comma_list(ctx, param, value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def add_options(fn, options: list):
    for option in reversed(options):
        fn = option(fn)
    return fn


def int_list(text: str, option: str, size: int | None = None) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1 or (size is not None and len(values) != size):
        want = f"{size} " if size else ""
        raise ConfigError(f"{option} {text!r}: expected {want}comma-separated integers >= 1")
    return values


def resolved(cfg):
    """The job every process runs: the embedded default's assets built, then `resolve_job`."""
    from dflash_ipc.builtin.assets import materialize
    from dflash_ipc.target.resolve import resolve_job
    cfg = resolve_job(materialize(cfg))
    if cfg.drafter.init_from:  # checked against the job before any child starts
        from dflash_ipc.drafter.warm_start import resolve_init_from
        from dflash_ipc.hf.target_config import load_target_config
        resolve_init_from(cfg, load_target_config(cfg.target.path))
    return cfg
