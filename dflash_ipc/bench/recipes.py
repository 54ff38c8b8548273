"""Named training recipes for `bench precision`: each a list of config overrides.

Every recipe starts from the DFlash paper's recipe (``PAPER``: decay weights, AdamW, cosine;
full attention is the default layout) and adds its parts' changes, so a table of them compares
each change against the paper whatever the job defaults are; a recipe with the part ``default``
starts from the job defaults instead (today D-PACE, Muon, WSD: what the recipe table on a real
target chose, docs/benchmarks.md).

    paper    the paper's recipe                           (decay weights, AdamW, cosine)
    dpace    objective.weighting=dpace                     (D-PACE weights, alpha 0.5)
    swa      model.layer_types=S..SF, sliding_window=2048  (all but the last layer sliding: SpecForge's
                                                           Qwen3.6 layout; speculators' window)
    muon     optimizer.name=muon                           (Muon for the matrices at optimizer.lr,
                                                           match_rms_adamw scaling)
    wsd      schedule.name=wsd, decay_shape=cosine          (TorchSpec's DFlash schedule: last 20 %)
    default  the job defaults, nothing else
    bf16     drafter.precision=bf16                        (the default, named for the precision table)
    fp8      drafter.precision=fp8

Names combine with ``+``: ``dpace+muon+wsd`` is the paper's recipe, then the three lists in
order (a later override of the same key wins). ``--recipe NAME=KEY=VALUE[,KEY=VALUE...]``
defines more (or redefines one), e.g. ``muon10=optimizer.name=muon,optimizer.muon_lr=6e-3``; a
value may not hold a comma (give layer_types in its compact form, ``SSSSF``). Every recipe is
validated as a whole job config before anything trains.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from dflash_ipc.errors import ConfigError

SWA_WINDOW = 2048  # speculators' default window, SpecForge's Qwen3.6 drafter's too
NAME_PATTERN = re.compile(r"[A-Za-z0-9_.-]+")


def _swa(num_layers: int) -> list[str]:
    kinds = "S" * (num_layers - 1) + "F" if num_layers > 1 else "S"
    return [f"model.layer_types={kinds}", f"model.sliding_window={SWA_WINDOW}"]


PAPER = ("objective.weighting=decay", "optimizer.name=adamw", "schedule.name=cosine")
"""The DFlash paper's recipe, where the job defaults differ from it: every recipe's start."""
DEFAULT = "default"
"""The part that starts a recipe from the job defaults instead of PAPER."""

BUILTIN = {
    "paper": lambda n: [],
    DEFAULT: lambda n: [],
    "dpace": lambda n: ["objective.weighting=dpace"],
    "swa": _swa,
    "muon": lambda n: ["optimizer.name=muon"],
    "wsd": lambda n: ["schedule.name=wsd", "schedule.decay_shape=cosine"],
    "bf16": lambda n: ["drafter.precision=bf16"],
    "fp8": lambda n: ["drafter.precision=fp8"],
}


@dataclass(frozen=True)
class Recipe:
    """One row of the comparison: its label and the overrides that make it."""

    name: str
    overrides: tuple[str, ...]


def parse_definition(text: str) -> tuple[str, list[str]]:
    """``NAME=KEY=VALUE[,KEY=VALUE...]`` (``--recipe``) -> (name, overrides)."""
    name, sep, rest = text.partition("=")
    if not sep or not NAME_PATTERN.fullmatch(name) or not rest:
        raise ConfigError(f"--recipe {text!r}: write NAME=section.key=value[,section.key=value...] "
                          f"(NAME of letters, digits, '_', '-', '.')")
    overrides = [part.strip() for part in rest.split(",")]
    bad = [o for o in overrides if "=" not in o or "." not in o.partition("=")[0]]
    if bad:
        raise ConfigError(f"--recipe {name}: {bad[0]!r} is not section.key=value")
    return name, overrides


def resolve(names: list[str], defined: dict[str, list[str]] | None = None, *, num_layers: int) -> list[Recipe]:
    """The recipes ``names`` ask for, in order; each name a built-in, a ``--recipe`` one or a
    ``+`` combination of those. ConfigError names an unknown part and lists the known ones."""
    defined = defined or {}
    if not names:
        raise ConfigError("bench precision: --recipes names no recipe")
    if len(set(names)) != len(names):
        raise ConfigError(f"bench precision: a recipe is asked twice: {names}")
    out = []
    for name in names:
        parts = name.split("+")
        overrides: list[str] = [] if DEFAULT in parts else list(PAPER)
        for part in parts:
            if part in defined:
                overrides += defined[part]
            elif part in BUILTIN:
                overrides += BUILTIN[part](num_layers)
            else:
                known = ", ".join(sorted(set(BUILTIN) | set(defined)))
                raise ConfigError(f"bench precision: recipe {part!r} (in {name!r}) is unknown; known: {known} "
                                  f"(combine with '+', define more with --recipe NAME=KEY=VALUE,...)")
        out.append(Recipe(name=name, overrides=tuple(overrides)))
    return out


def precision_recipes(variants: list[dict], label) -> list[Recipe]:
    """The ``drafter`` fields of precision variants (bench/drafter.py) as recipes named ``label(v)``,
    each on the paper's recipe (the one the precision figures of docs/benchmarks.md train)."""
    return [Recipe(name=label(v), overrides=PAPER + tuple(f"drafter.{k}={v[k]}" for k in v)) for v in variants]
