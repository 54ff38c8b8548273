"""Reading a job config: YAML files and `-o key=value` overrides into `JobConfig`.

Every problem is one `ConfigError` line naming the file (and line) or the override and the
dotted key: YAML syntax errors, a key given twice, an empty file, unknown keys, wrong types,
keys that moved to another section (the message names the new key). Hostile YAML too: nesting
past the parser's recursion limit, integers past Python's 4,300 digits, a file over
`MAX_CONFIG_BYTES`, and values that are expanded by aliases (a few hundred bytes can name 10^9
list entries) are shown abbreviated, so no message costs more than a line.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import reprlib
import types
import typing
from typing import Any, Literal

import yaml

from dflash_ipc.config.schema import JobConfig, config_to_dict
from dflash_ipc.errors import ConfigError
from dflash_ipc.run.regular_file import regular_file

MAX_CONFIG_BYTES = 1 << 20  # a job config is a few kilobytes

_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxlist, _REPR.maxtuple, _REPR.maxdict, _REPR.maxset = 2, 8, 8, 8, 8
_REPR.maxstring = _REPR.maxother = 80


def _short(value: Any) -> str:
    """repr() of a value from a config, at most a few hundred characters whatever it holds
    (YAML aliases can make a tiny file name a structure of exponential size)."""
    return _REPR.repr(value)


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping (YAML silently keeps the last)."""


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)  # a list key filled now, for the message
        line = key_node.start_mark.line + 1
        try:
            hash(key)
        except TypeError:  # `? [1]` or a flow mapping as a key: no dict can hold it
            raise ConfigError(f"line {line}: key {_short(key)} is a {type(key).__name__}; "
                              "a key must be a plain value") from None
        if key in seen:
            raise ConfigError(f"line {line}: key {_short(key)} given twice (first at line {seen[key]})")
        seen[key] = line
    return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _parse_yaml(text: str, where: str) -> Any:
    try:
        return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except ConfigError as exc:
        raise ConfigError(f"{where} {exc}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" line {mark.line + 1}, column {mark.column + 1}:" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"{where}: not valid YAML:{at} {problem}") from None
    except RecursionError:
        raise ConfigError(f"{where}: not valid YAML: nested deeper than the parser's recursion limit") from None
    except ValueError as exc:  # an integer of more than 4,300 digits, a date past year 9999
        raise ConfigError(f"{where}: not valid YAML: {str(exc).split(';')[0][:120]}") from None


YAML_SWITCH = {False: "off", True: "on"}
"""The setting a YAML boolean spells where a field's allowed values are strings that include it."""


def _convert(value: Any, hint: Any, key: str) -> Any:
    """Checks `value` against a type hint, converting the few lossless cases (int -> float)."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        if value is None and type(None) in args:
            return None
        arms = [a for a in args if a is not type(None)]
        if len(arms) == 1:
            return _convert(value, arms[0], key)
        for arm in arms:  # e.g. list[str] | str: the first form the value has
            try:
                return _convert(value, arm, key)
            except ConfigError:
                continue
        names = " or ".join(getattr(a, "__name__", None) or str(a) for a in arms)
        raise ConfigError(f"{key}: expected {names}, got {type(value).__name__} {_short(value)}")
    if origin is Literal:
        allowed = typing.get_args(hint)
        if isinstance(value, bool) and YAML_SWITCH[value] in allowed:
            return YAML_SWITCH[value]  # YAML 1.1 reads off/on (and no/yes) as booleans: drafter.compile=off
        if value not in allowed:
            spelled = " (YAML reads on/off/yes/no as booleans)" if isinstance(value, bool) else ""
            raise ConfigError(f"{key}: {_short(value)}{spelled} not allowed; allowed: {', '.join(map(str, allowed))}")
        return value
    if origin is list:
        (inner,) = typing.get_args(hint)
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {_short(value)}")
        return [_convert(v, inner, f"{key}[{i}]") for i, v in enumerate(value)]
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint is float and isinstance(value, str):
        # YAML 1.1 reads "6e-4" (no dot) as a string; accept any spelling float() takes.
        try:
            return float(value)
        except ValueError:
            raise ConfigError(f"{key}: expected float, got str {_short(value)}") from None
    if hint in (int, float, str, bool) and not (isinstance(value, hint) and
                                                 not (hint is int and isinstance(value, bool))):
        raise ConfigError(f"{key}: expected {hint.__name__}, got {type(value).__name__} {_short(value)}")
    return value


def _unknown_key(cls: type, key: str, names: set[str]) -> ConfigError:
    section, _, name = key.rpartition(".")
    close = difflib.get_close_matches(name, sorted(names), n=1)
    hint = f" (did you mean {(section + '.') if section else ''}{close[0]}?)" if close else ""
    return ConfigError(f"unknown key {key}{hint}; allowed keys{' of ' + section if section else ''}: "
                       f"{', '.join(sorted(names))}")


def _build(cls: type, data: Any, prefix: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or 'config'}: expected a mapping, got {_short(data)}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for name in sorted(set(data) - names, key=str):
        name = str(name) if len(str(name)) <= 80 else _short(str(name))
        raise _unknown_key(cls, f"{prefix}.{name}" if prefix else name, names)
    kwargs = {}
    for name, value in data.items():
        key = f"{prefix}.{name}" if prefix else name
        hint = hints[name]
        kwargs[name] = _build(hint, value, key) if dataclasses.is_dataclass(hint) else _convert(value, hint, key)
    return cls(**kwargs)


def _apply_override(tree: dict, override: str) -> None:
    if "=" not in override:
        raise ConfigError(f"override '{override}' must look like section.key=value")
    dotted, raw = override.split("=", 1)
    dotted = dotted.strip()
    parts = dotted.split(".")
    node = tree
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override '{override}': {part} is not a section")
    # YAML gives ints, floats, bools, lists ("[64,128]") and null the natural way; an empty
    # value is the empty string (refused by the fields that cannot be empty).
    node[parts[-1]] = _parse_yaml(raw, f"override {dotted}") if raw.strip() else ""


def apply_overrides(tree: dict, overrides: list[str] | tuple[str, ...]) -> dict:
    """``tree`` (a config's YAML tree, changed in place and returned) with ``section.key=value``
    overrides applied as ``-o`` applies them; validate it with :func:`config_from_dict`."""
    for override in overrides:
        _apply_override(tree, override)
    return tree


def config_from_dict(data: dict) -> JobConfig:
    return _build(JobConfig, data, "")


def read_config_file(path: str) -> dict:
    """The YAML tree of a config file; ConfigError for a missing, empty or malformed file."""
    try:  # /dev/zero, a FIFO, a directory: one clear error before anything is read
        regular_file(path, "the config file", error=ConfigError, max_bytes=MAX_CONFIG_BYTES)
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file {path} cannot be read: {exc}") from None
    tree = _parse_yaml(text, path)
    if tree is None:
        raise ConfigError(f"config file {path} is empty (or only comments): give its sections, "
                          f"e.g. as in configs/default.yaml")
    if not isinstance(tree, dict):
        raise ConfigError(f"{path}: top level must be a mapping of sections, got {type(tree).__name__}")
    return tree


def load_config(path: str | None = None, overrides: list[str] | tuple[str, ...] = ()) -> JobConfig:
    """Reads YAML (or the defaults when path is None), applies `key=value` overrides, validates."""
    tree = read_config_file(path) if path is not None else {}
    for override in overrides:
        _apply_override(tree, override)
    try:
        return config_from_dict(tree)
    except ConfigError as exc:
        raise ConfigError(f"{_culprit(path, overrides)}: {exc}") from None


def _culprit(path: str | None, overrides) -> str:
    """What to blame for an invalid job: the first `-o` override that makes a valid file invalid,
    else the file (a user searching the file for a key they typed on the command line would not
    find it). Only on the error path: the file is re-read and validated once per override."""
    tree = read_config_file(path) if path is not None else {}
    try:
        config_from_dict(tree)
    except ConfigError:
        return path or "defaults"
    for override in overrides:
        _apply_override(tree, override)
        try:
            config_from_dict(tree)
        except ConfigError:
            return f"override -o {override}"
    return path or "defaults"


def dump_config(cfg: JobConfig, path: str) -> None:
    """Writes the resolved config, so every worker and a later audit see the same job."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        yaml.safe_dump(config_to_dict(cfg), f, sort_keys=False)
    os.replace(tmp, path)
