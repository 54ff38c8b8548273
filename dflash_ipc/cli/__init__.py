"""`dflash-ipc`: the command line. Thin: click parses, the config builds, a class runs.

    dflash-ipc up [--config FILE] [-o key=value ...]     the whole job (= bin/dflash-up)
    dflash-ipc dispatcher|target|drafter --config FILE [--rank N] [--tp-rank K]   one stage alone
    dflash-ipc regenerate --model DIR --input FILE_OR_DIR --out FILE.jsonl   the target writes the replies
    dflash-ipc prepare --model DIR --input FILE_OR_DIR --out DIR
    dflash-ipc export CHECKPOINT OUT_DIR [--with-code]
    dflash-ipc report RUN_DIR
    dflash-ipc status|health RUN_DIR
    dflash-ipc eval --target DIR --drafter CKPT (--data DIR | --prompts FILE.jsonl ...)
    dflash-ipc bench transport|drafter|dispatch|pipeline|target|regenerate|eval
    dflash-ipc plan --gpus N (--target-capacity T --drafter-capacity D | --from-bench FILE)
"""

from __future__ import annotations

import sys

import click

from dflash_ipc.cli import bench, data, job, monitor, plan, publish  # noqa: F401  (each registers its commands)
from dflash_ipc.cli.app import main
from dflash_ipc.run.quiet import quiet_unactionable_warnings
from dflash_ipc.errors import EXIT_CONFIG_ERROR, EXIT_ERROR, ConfigError, DFlashError

__all__ = ["main", "run"]


def run() -> None:
    """Console entry point: typed errors become one clear line and exit code 2."""
    quiet_unactionable_warnings()  # before any command imports transformers (run/quiet.py)
    try:
        main(standalone_mode=False)
    except click.exceptions.Abort:
        sys.exit(130)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except ConfigError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(EXIT_CONFIG_ERROR)  # the supervisor never restarts a child that exits so
    except DFlashError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(EXIT_ERROR)
