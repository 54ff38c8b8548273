"""Option checks that click's own types leave open: non-finite floats, ranges given as two options,
and output paths that would fail only after the work is done."""

from __future__ import annotations

import math
import os

import click

from dflash_ipc.run.write_probe import check_takes_new_files


class FiniteFloatRange(click.FloatRange):
    """click.FloatRange that also refuses nan and inf: both pass its comparisons (nan compares false
    to every bound), and a bound of inf or nan makes every figure computed from it meaningless."""

    def convert(self, value, param, ctx):
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number.", param, ctx)
        return number


def ordered_range(low_name: str, low: int, high_name: str, high: int) -> None:
    """Refuse a range whose low end lies above its high end, naming both options (one line, not the
    sampler's ``high - low < 0`` from deep inside the run)."""
    if low > high:
        raise click.UsageError(f"{low_name} {low} is above {high_name} {high}")


def writable_output(ctx, param, value: str | None) -> str | None:
    """An output file written at the end of a run: its directory must exist and take a new file now,
    so a bad path fails before the run rather than after it."""
    if value is None:
        return None
    if os.path.isdir(value):
        raise click.BadParameter(f"{value} is a directory; give a file path.", ctx, param)
    parent = os.path.dirname(os.path.abspath(value))
    if not os.path.isdir(parent):
        raise click.BadParameter(f"{value}: its directory {parent} does not exist.", ctx, param)
    try:
        check_takes_new_files(parent)
    except OSError as exc:
        raise click.BadParameter(f"{value}: its directory {parent} is not writable "
                                 f"({exc.strerror or exc}).", ctx, param) from None
    if os.path.exists(value) and not os.access(value, os.W_OK):
        raise click.BadParameter(f"{value} exists and is not writable.", ctx, param)
    return value


def made_directory(ctx, param, value: str | None) -> str | None:
    """A working directory the command keeps: made now (with its parents), or one error line that
    names it and the system's reason."""
    if value is None:
        return None
    try:
        os.makedirs(value, exist_ok=True)
    except OSError as exc:
        raise click.BadParameter(f"{value}: cannot be made ({exc.strerror or exc}).", ctx, param) from None
    if not os.access(value, os.W_OK | os.X_OK):
        raise click.BadParameter(f"{value} is not writable.", ctx, param)
    return value
