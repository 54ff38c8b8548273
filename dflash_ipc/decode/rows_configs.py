"""The few-row kernel's launch configs: a rule, tables swept on a GPU, and a table of your own.

decode/matvec.py's few-row kernel (2..16 rows: a verify pass, a drafted block at batch 1) takes
block sizes, warps, pipeline stages and K splits per weight (N x K, and whether it is a gate|up
weight run with silu * up, ``glu``). Which ones stream a weight fastest depends on the GPU and
on the weight, so a config comes from, in order:

  1. the JSON table that ``$DFLASH_DECODE_ROWS_CONFIGS`` names, where it has the weight
     (``python3 -m benchmarks.matvec SHAPE --rows 16 --sweep --write PATH`` writes one: the
     fastest config of the sweep per weight, on the GPU it ran on);
  2. the built-in table of this GPU's model (TUNED, by a fragment of the device's name), where
     it has the weight;
  3. the rule (:func:`rule_config`): the winners of a narrower sweep on an H200, by N.

``$DFLASH_DECODE_ROWS_CONFIGS=rule`` takes the rule alone, no table (to compare against the
tables in one process, benchmarks/cycle_switch.py); unset or ``auto``: steps 2 and 3. A table
is data only (JSON: numbers and names), checked field by field (and each config against a
program's shared memory) when the decoder is built and whenever the file changes. A gate|up
entry's BLOCK_N counts its gate and up rows together (the kernel takes BLOCK_N // 2 of each, at
least 16), and its SPLIT is 1.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Mapping

from dflash_ipc.errors import ConfigError

ROWS_CONFIGS_ENV = "DFLASH_DECODE_ROWS_CONFIGS"
TABLE_FORMAT = "dflash-ipc rows configs"
TABLE_VERSION = 1

ROWS_BLOCK_N = 64
"""The rule's weight rows per program."""
ROWS_SPLIT_BELOW = 64
"""The rule splits K for a weight of fewer blocks of ROWS_BLOCK_N rows than this (N < 4,096), up
to about one program per SM: 2,048 x 6,144 (a 1.7B down projection) runs 32 blocks x 4 splits."""
MAX_ROWS_SPLIT = 8

CONFIG_FIELDS: dict[str, tuple[int, ...]] = {
    # field: allowed values. Block sizes are powers of two (Triton's tiles); BLOCK_N from 16,
    # tl.dot's smallest operand dimension.
    "BLOCK_N": (16, 32, 64, 128, 256),
    "BLOCK_K": (16, 32, 64, 128, 256, 512, 1024),
    "SPLIT": tuple(range(1, 65)),
    "num_warps": (1, 2, 4, 8, 16),
    "num_stages": tuple(range(1, 11)),
}
ENTRY_FIELDS = ("n", "k", "glu", "config", "us")
"""A table entry's fields: the weight (n, k, glu), its config and, optionally, the microseconds
the sweep measured for it (kept for the reader, not used)."""

Key = tuple[int, int, bool]  # (weight rows N, K, glu)

def _config(block_n: int, block_k: int, split: int, warps: int, stages: int) -> dict:
    return dict(BLOCK_N=block_n, BLOCK_K=block_k, SPLIT=split, num_warps=warps, num_stages=stages)


TUNED: dict[str, dict[Key, dict]] = {
    # python3 -m benchmarks.matvec qwen3-1.7b --rows 16 --sweep --grid wide --fused-only --products
    # qkv,o,gate_up,down,fc,head --write ... (96 configs a weight; docs/benchmarks.md, "The few-row
    # kernel's configs swept per GPU"). The Qwen3-1.7B shape's weights; the drafter's fc kept the rule.
    "NVIDIA H100 80GB HBM3": {
        (2048, 2048, False): _config(64, 128, 1, 4, 6),   # o, the drafter's context k|v: 5.29 us (rule 5.89)
        (2048, 6144, False): _config(64, 128, 4, 4, 4),   # down: the rule's, 11.44 us
        (4096, 2048, False): _config(64, 128, 1, 4, 6),   # q|k|v: 8.93 us (rule 9.17)
        (12288, 2048, True): _config(64, 128, 1, 4, 3),   # gate|up with silu * up: 21.14 us (rule 21.76)
        (151936, 2048, False): _config(128, 128, 1, 8, 4),  # the head: 204.1 us (rule 204.8)
    },
}
"""Built-in tables by a fragment of the CUDA device's name (the whole name here: an H100 PCIe or
NVL, of other bandwidth and SMs, keeps the rule): the sweep's winners on that GPU."""


def rule_config(n: int, k: int, sms: int = 132) -> dict:
    """Block sizes, warps, stages and K splits of the few-row kernel against an N x K weight on
    a GPU of ``sms`` SMs (the winners of a sweep at 16 rows on an H200 over 40 configs of 4
    stages: blocks of 128 keys where K is split or N is large, of 256 otherwise)."""
    if n < 1:
        raise ValueError(f"rows_config: a weight of {n} rows")
    blocks = -(-n // ROWS_BLOCK_N)
    split = 1
    if blocks < ROWS_SPLIT_BELOW:
        while split * 2 <= min(MAX_ROWS_SPLIT, sms // blocks):
            split *= 2
    block_k = 128 if split > 1 or n >= 12288 else 256
    return dict(BLOCK_N=ROWS_BLOCK_N, BLOCK_K=block_k, SPLIT=split, num_warps=4, num_stages=4)


def rows_config(n: int, k: int, sms: int = 132, *, glu: bool = False, device_name: str = "") -> dict:
    """The config of the few-row kernel for an N x K weight (``glu``: gate|up rows, run with
    silu * up) on the GPU named ``device_name`` of ``sms`` SMs: the module docstring's order."""
    setting = os.environ.get(ROWS_CONFIGS_ENV) or "auto"
    if setting != "rule":
        table = {} if setting == "auto" else table_file(setting)
        for source in (table, builtin_table(device_name)):
            if (n, k, glu) in source:
                return dict(source[(n, k, glu)])
    return dict(rule_config(n, k, sms), **({"SPLIT": 1} if glu else {}))  # silu * up runs unsplit


def check_setting() -> None:
    """Read ``$DFLASH_DECODE_ROWS_CONFIGS`` now (where a decoder is built), so that a missing or
    malformed table stops the run before it decodes; launches read it again (cached by the file)."""
    setting = os.environ.get(ROWS_CONFIGS_ENV) or "auto"
    if setting not in ("auto", "rule"):
        table_file(setting)


def builtin_table(device_name: str) -> Mapping[Key, dict]:
    """TUNED's table for a device of this name (the first fragment it contains), else none; a
    MIG slice (its name says so) has a share of the GPU's SMs and bandwidth: none."""
    if "MIG" in device_name:
        return {}
    return next((table for fragment, table in TUNED.items() if fragment in device_name), {})


def table_file(path: str) -> dict[Key, dict]:
    """The table in the JSON file at ``path``, checked (read again only when the file's time,
    size or inode changes)."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise ConfigError(f"${ROWS_CONFIGS_ENV}={path!r}: {e.strerror}; allowed: 'auto', 'rule' or the path "
                          f"of a table that benchmarks/matvec.py --write wrote") from None
    return _read_table(path, (st.st_mtime_ns, st.st_size, st.st_ino))


@functools.lru_cache(maxsize=8)
def _read_table(path: str, stamp: tuple[int, int, int]) -> dict[Key, dict]:
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f, object_pairs_hook=_no_repeated_keys)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: line {e.lineno}, column {e.colno}: not JSON ({e.msg})") from None
    except (OSError, ValueError, RecursionError) as e:  # ValueError: undecodable bytes, a key twice, huge ints
        raise ConfigError(f"{path}: cannot be read as a rows configs table ({e})") from None
    return parse_table(doc, path)


def _no_repeated_keys(pairs: list[tuple[str, object]]) -> dict:
    keys = [k for k, _ in pairs]
    repeated = sorted({k for k in keys if keys.count(k) > 1})
    if repeated:
        raise ValueError(f"the key(s) {repeated} twice in one object")
    return dict(pairs)


def parse_table(doc: object, where: str = "rows configs") -> dict[Key, dict]:
    """A table's entries by (n, k, glu) from its JSON document, each field checked; errors name
    ``where`` (the file), the entry and the field."""
    if not isinstance(doc, dict) or doc.get("format") != TABLE_FORMAT:
        raise ConfigError(f"{where}: not a rows configs table (want an object with \"format\": \"{TABLE_FORMAT}\")")
    extra = set(doc) - {"format", "version", "device", "rows", "configs"}
    if extra:
        raise ConfigError(f"{where}: unknown field(s) {sorted(extra)}; allowed: format, version, device, rows, "
                          f"configs")
    if not _is_int(doc.get("version")) or doc["version"] != TABLE_VERSION:
        raise ConfigError(f"{where}: version {doc.get('version')!r}; allowed: {TABLE_VERSION}")
    if not isinstance(doc.get("device", ""), str):
        raise ConfigError(f"{where}: device {doc['device']!r}; allowed: the GPU's name, a string")
    if not _is_int(doc.get("rows", 16)) or not 1 <= doc.get("rows", 16) <= 16:
        raise ConfigError(f"{where}: rows {doc['rows']!r}; allowed: the rows swept, 1..16")
    if not isinstance(doc.get("configs"), list):
        raise ConfigError(f"{where}: configs must be a list of entries")
    table: dict[Key, dict] = {}
    for i, entry in enumerate(doc["configs"]):
        at = f"{where}: configs[{i}]"
        if not isinstance(entry, dict):
            raise ConfigError(f"{at}: an entry must be an object with fields {list(ENTRY_FIELDS)}")
        unknown = set(entry) - set(ENTRY_FIELDS)
        missing = {"n", "k", "glu", "config"} - set(entry)
        if unknown or missing:
            raise ConfigError(f"{at}: unknown field(s) {sorted(unknown)}, missing {sorted(missing)}; "
                              f"allowed: {list(ENTRY_FIELDS)} (us optional)")
        for name in ("n", "k"):
            if not _is_int(entry[name]) or entry[name] < 1:
                raise ConfigError(f"{at}.{name} = {entry[name]!r}; allowed: an integer >= 1")
        if not isinstance(entry["glu"], bool):
            raise ConfigError(f"{at}.glu = {entry['glu']!r}; allowed: true or false")
        if entry["glu"] and entry["n"] % 2:
            raise ConfigError(f"{at}.n = {entry['n']}: a glu weight has gate and up rows, an even count")
        if "us" in entry and (isinstance(entry["us"], bool) or not isinstance(entry["us"], (int, float))):
            raise ConfigError(f"{at}.us = {entry['us']!r}; allowed: the microseconds swept, a number")
        key = (entry["n"], entry["k"], entry["glu"])
        if key in table:
            raise ConfigError(f"{at}: a second entry for n={key[0]}, k={key[1]}, glu={key[2]}")
        table[key] = check_config(entry["config"], f"{at}.config", glu=entry["glu"])
    return table


SHARED_MEMORY_BYTES = 227 * 1024
"""Shared memory a program may take on an H100 or H200 (232,448 bytes)."""


def shared_memory_bytes(config: Mapping, glu: bool = False) -> int:
    """The shared memory a program of the few-row kernel takes under ``config``: its pipeline
    stages of weight tiles (under ``glu``, gate and up tiles of BLOCK_N // 2 rows each, at least
    16) and 16-row input tiles, bf16/fp16 (Triton allocates these, as its reports agree)."""
    rows = 2 * max(16, config["BLOCK_N"] // 2) if glu else config["BLOCK_N"]
    return config["num_stages"] * (rows + 16) * config["BLOCK_K"] * 2


def check_config(config: object, where: str, *, glu: bool = False) -> dict:
    """``config`` if it has exactly CONFIG_FIELDS, each at an allowed value, and fits a program's
    shared memory (``glu``: a gate|up weight's, one split only)."""
    if not isinstance(config, dict) or set(config) != set(CONFIG_FIELDS):
        got = sorted(config) if isinstance(config, dict) else type(config).__name__
        raise ConfigError(f"{where}: fields {got}; want exactly {list(CONFIG_FIELDS)}")
    for name, allowed in CONFIG_FIELDS.items():
        if not _is_int(config[name]) or config[name] not in allowed:
            shown = f"{allowed[0]}..{allowed[-1]}" if name in ("SPLIT", "num_stages") else list(allowed)
            raise ConfigError(f"{where}.{name} = {config[name]!r}; allowed: {shown}")
    if glu and config["SPLIT"] != 1:
        raise ConfigError(f"{where}.SPLIT = {config['SPLIT']}: silu * up runs unsplit; allowed: 1")
    if shared_memory_bytes(config, glu) > SHARED_MEMORY_BYTES:
        raise ConfigError(f"{where}: {shared_memory_bytes(config, glu)} bytes of shared memory a program "
                          f"(num_stages x (BLOCK_N{' of gate and up' if glu else ''} + 16) x BLOCK_K x 2); "
                          f"allowed: at most {SHARED_MEMORY_BYTES}")
    return dict(config)


def table_document(device_name: str, rows: int, winners: Mapping[Key, tuple[dict, float]]) -> dict:
    """The JSON document of a table: ``winners`` maps (n, k, glu) to (config, microseconds)."""
    entries = [{"n": n, "k": k, "glu": glu, "config": check_config(cfg, f"n={n}, k={k}, glu={glu}", glu=glu),
                "us": round(us, 3)} for (n, k, glu), (cfg, us) in sorted(winners.items())]
    return {"format": TABLE_FORMAT, "version": TABLE_VERSION, "device": device_name, "rows": rows,
            "configs": entries}


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
