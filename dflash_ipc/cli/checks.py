"""Option checks that click's own types leave open: non-finite floats, ranges given as two options,
and output paths that would fail only after the work is done."""

from __future__ import annotations

import math
import os

import click

from dflash_ipc.run.write_probe import check_takes_new_files, output_file_problem


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
    problem = None if value is None else output_file_problem(value)
    if problem:
        raise click.BadParameter(f"{value}: {problem}.", ctx, param)
    return value


def made_directory(ctx, param, value: str | None) -> str | None:
    """A working directory the command keeps: made now (with its parents), or one error line that
    names it and the system's reason."""
    if value is None:
        return None
    try:
        os.makedirs(value, exist_ok=True)
        check_takes_new_files(value)  # not os.access: root passes it on a read-only mount
    except OSError as exc:
        raise click.BadParameter(f"{value}: cannot be made or written ({exc.strerror or exc}).", ctx,
                                 param) from None
    return value
