"""The inputs people have, read one row at a time: each row with its index and its place.

One reader serves `prepare` and `regenerate`, so an original dataset and a regenerated file
go through the same code. What it reads (`open_input`):
  FILE.jsonl        one JSON object a line
  FILE.json         a JSON array of objects, pretty-printed or not, streamed element by
                    element; or pretty-printed objects one after another (the form is
                    sniffed from the first bytes, whatever the name: a file starting with
                    '[' is an array, except a .jsonl file whose first line holds more)
  FILE.parquet      Parquet (pyarrow), in record batches
  DIR               a `datasets` save_to_disk directory (state.json / dataset_dict.json), or a
                    dataset's local shards: every *.parquet, *.jsonl, *.json below it but
                    regenerate's side files (*.rejects.jsonl, *.state.json: skipped, counted
                    in `side_files` and said once in the command's report)
  /dev/stdin, FIFO  JSONL or a JSON array, streamed (nothing is sought)

Rows are isolated: the reader only splits the input; `decode_row` parses one row and turns
every failure (bad UTF-8, bad JSON, nesting deeper than Python's recursion limit, integers
past its 4,300-digit limit, a row over `max_row_bytes`) into `RowRejected`, so one bad row
never stops a run. A row over the cap is never held in memory whole: only its first bytes
are kept, for the rejects file. Parquet is read one row group at a time: a row group that
cannot be decoded (a damaged page) makes each of its rows an `unreadable_row` reject, and so
does a value Python cannot hold (a timestamp past year 9999), for its row alone; only a file
whose footer cannot be read is a DataError (no row of it is reachable).

Shards and splits: a file named `<split>-00000-of-00004.<ext>` (the HF naming), one under a
directory named like a split (train/, test/, ...), or one whose stem is a split name belongs
to that split. `split=None` takes "train" when several splits are present.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass

from dflash_ipc.data.messages import RowRejected, parse_json
from dflash_ipc.errors import DataError
from dflash_ipc.run.json_files import read_json_object
from dflash_ipc.run.json_lines import capped_lines

log = logging.getLogger(__name__)

MAX_ROW_BYTES = 32 << 20  # 32 MiB: far above any conversation a max_length can hold
_READ_CHUNK = 1 << 20
_HEAD_KEEP = 2000  # bytes of an oversize row kept for the rejects file
_SHARD_EXTS = (".parquet", ".jsonl", ".json")
_SPLIT_NAMES = ("train", "test", "validation", "valid", "dev", "eval")
_HF_SHARD = re.compile(r"^(?P<split>[A-Za-z0-9_]+)-\d+-of-\d+")
_DATA_EXTRA_HINT = "pip install 'dflash-ipc[data]'"
# The files regenerate writes beside its output (regenerate/out_paths.py, sidecar_paths): a
# directory of regenerated files holds them too, and they are not conversations.
REJECTS_SUFFIX, STATE_SUFFIX = ".rejects.jsonl", ".state.json"
SIDE_FILE_SUFFIXES = (REJECTS_SUFFIX, STATE_SUFFIX)


@dataclass(slots=True)
class RawRow:
    """One row as read: JSON text still to parse (`raw`) or an already decoded row (`value`).

    index: 0-based position among the input's rows (blank lines are not rows), stable across
    runs; where: "file:line" or "file row N", for messages; oversize: the byte size of a row
    over the cap (raw then holds only its first bytes)."""

    index: int
    where: str
    line: int | None = None
    raw: bytes | None = None
    value: dict | None = None
    oversize: int = 0
    unreadable: str | None = None  # why the reader could not read the row's values (Parquet, Arrow)

    def text(self, limit: int = _HEAD_KEEP) -> str:
        """The row's first `limit` characters, for a rejects file."""
        if self.raw is not None:
            return self.raw[: limit * 4].decode("utf-8", errors="replace").rstrip("\n")[:limit]
        try:
            return json.dumps(self.value, ensure_ascii=False, default=str)[:limit]
        except (TypeError, ValueError, RecursionError):
            return repr(self.value)[:limit]


def decode_row(row: RawRow, max_row_bytes: int = MAX_ROW_BYTES) -> dict:
    """The row as a dict; RowRejected (line_too_long, malformed_json, not_an_object) otherwise."""
    if row.unreadable is not None:
        raise RowRejected("unreadable_row", row.unreadable)
    if row.oversize:
        raise RowRejected("line_too_long", f"{row.oversize} bytes > the {max_row_bytes}-byte row limit "
                                           "(--max-line-bytes); not parsed")
    value = row.value if row.raw is None else parse_json(row.raw)
    if not isinstance(value, dict):
        raise RowRejected("not_an_object", f"a JSON {type(value).__name__}, expected an object")
    return value


class InputSource:
    """Rows of one input (see the module docstring). `rows()` yields RawRows once; the
    counters (`bytes_read`, `num_rows`, `sha256`: of every byte read, in order; of a
    DatasetDict's whole directory) fill as it goes."""

    def __init__(self, path: str, *, split: str | None = None, max_row_bytes: int = MAX_ROW_BYTES):
        if max_row_bytes < 1:
            raise DataError(f"max_row_bytes={max_row_bytes}; must be >= 1")
        self.path = path
        self.max_row_bytes = max_row_bytes
        self.files, self.kind, self.side_files = _resolve(path, split)
        self.total_bytes = sum(_size(f) for f in self.files) if self.kind != "arrow_dataset" else 0
        self.bytes_read = 0
        self.num_rows = 0
        self.sha256 = hashlib.sha256()
        self._split = split

    def rows(self) -> Iterator[RawRow]:
        """Every row of every file, in order, indexed from 0."""
        if self.kind == "arrow_dataset":
            yield from self._numbered(_arrow_dataset_rows(self.path, self._split))
            _hash_tree(self.path, self.sha256, self._split)  # the files read, for meta.json's input_sha256
            return
        for path in self.files:
            yield from self._numbered(self._file_rows(path))

    def _numbered(self, rows: Iterator[RawRow]) -> Iterator[RawRow]:
        for row in rows:
            row.index = self.num_rows
            self.num_rows += 1
            yield row

    def _file_rows(self, path: str) -> Iterator[RawRow]:
        if _is_parquet(path):
            yield from _parquet_rows(path)
            self.bytes_read += _hash_file(path, self.sha256)
            return
        with open(path, "rb") as f:
            head = f.peek(64)[:64].lstrip() if hasattr(f, "peek") else b""
            reader = _ByteCounter(f, self)
            # A .jsonl file is JSON lines, unless its first line opens a pretty-printed array.
            if head.startswith(b"[") and (not path.endswith(".jsonl") or _first_line(head) == b"["):
                yield from _JsonScanner(reader, path, self.max_row_bytes).values(array=True)
            elif head.startswith(b"{") and _first_line(head) == b"{":
                yield from _JsonScanner(reader, path, self.max_row_bytes).values(array=False)
            else:
                yield from _jsonl_rows(reader, path, self.max_row_bytes)

    def notes(self) -> list[str]:
        """What a user should hear once about this input (the side files skipped)."""
        if not self.side_files:
            return []
        names = ", ".join(os.path.relpath(f, self.path) for f in self.side_files[:3])
        more = f" and {len(self.side_files) - 3} more" if len(self.side_files) > 3 else ""
        return [f"{self.path}: skipped {len(self.side_files)} side files of regenerate (*{REJECTS_SUFFIX}, "
                f"*{STATE_SUFFIX}), not read as data: {names}{more}"]

    def estimated_rows(self) -> int | None:
        """The number of rows, or an estimate (lines of JSONL files), or None for streams."""
        total = 0
        for path in self.files:
            if _is_parquet(path):
                total += _parquet_num_rows(path)
            elif os.path.isfile(path):
                total += _count_lines(path)
            else:
                return None
        if self.kind == "arrow_dataset":
            return _arrow_dataset_len(self.path, self._split)
        return total


class _ByteCounter:
    """A binary file that counts and hashes what is read through it."""

    def __init__(self, f, source: InputSource):
        self._f = f
        self._source = source

    def readline(self, limit: int) -> bytes:
        return self._count(self._f.readline(limit))

    def read(self, size: int) -> bytes:
        return self._count(self._f.read(size))

    def _count(self, data: bytes) -> bytes:
        self._source.bytes_read += len(data)
        self._source.sha256.update(data)
        return data


def _first_line(head: bytes) -> bytes:
    return head.split(b"\n", 1)[0].strip()


def _jsonl_rows(f: _ByteCounter, path: str, cap: int) -> Iterator[RawRow]:
    """One row per non-blank line; a line over the cap is skipped in chunks, never held."""
    for line_no, raw, size in capped_lines(f, cap, _HEAD_KEEP):
        if size > cap:
            yield RawRow(0, f"{path}:{line_no}", line_no, raw=raw, oversize=size)
        elif raw.strip():
            yield RawRow(0, f"{path}:{line_no}", line_no, raw=raw)


_STRUCTURE = re.compile(rb'["\[\]{},]')
_NESTED = re.compile(rb'["\[\]{}]')  # inside an element a ',' changes nothing: a list of ints is one jump
_STRING_END = re.compile(rb'["\\]')
_SPACE = b" \t\r\n"


class _JsonScanner:
    """Splits a top-level JSON array (or JSON values one after another) into its elements'
    bytes without parsing them: a scan of brackets, commas and strings, where the regexes
    jump over text at C speed. Memory: one read chunk plus the current element, capped; an
    element over the cap keeps only its head."""

    def __init__(self, f: _ByteCounter, path: str, cap: int):
        self.f, self.path, self.cap = f, path, cap
        self.buf = bytearray()
        self.pos = 0
        self.line = 1  # line number of buf[0]
        self.eof = False
        self._head, self._dropped = b"", 0  # of the element being scanned, once past the cap

    def _more(self) -> bool:
        chunk = self.f.read(_READ_CHUNK)
        self.eof = not chunk
        self.buf.extend(chunk)
        return bool(chunk)

    def _drop(self, k: int) -> None:
        self.line += self.buf.count(b"\n", 0, k)
        del self.buf[:k]
        self.pos -= k

    def _next_byte(self, skip: bytes) -> int | None:
        """The first byte at or after pos not in `skip` (pos moved there), None at EOF."""
        while True:
            while self.pos < len(self.buf) and self.buf[self.pos] in skip:
                self.pos += 1
            if self.pos < len(self.buf):
                return self.buf[self.pos]
            self._drop(self.pos)
            if not self._more():
                return None

    def values(self, *, array: bool) -> Iterator[RawRow]:
        """Each element (array=True: of the one top-level array) as a RawRow."""
        if array:
            self._next_byte(_SPACE)
            self.pos += 1  # the opening '['
        while True:
            c = self._next_byte(_SPACE + (b"," if array else b""))
            if c is None:
                if array:
                    log.warning("%s: the JSON array has no closing ']' (a truncated file?)", self.path)
                return
            if array and c == ord("]"):
                self.pos += 1
                if self._next_byte(_SPACE) is not None:
                    log.warning("%s: data after the closing ']' of the JSON array (line %d) ignored",
                                self.path, self.line + self.buf.count(b"\n", 0, self.pos))
                return
            yield self._element(array)

    def _element(self, array: bool) -> RawRow:
        """Scan one element from pos; pos ends after it (before the array's ']')."""
        self._drop(self.pos)
        line, depth = self.line, 0
        self._head, self._dropped = b"", 0
        end = None
        while end is None:
            m = (_NESTED if depth else _STRUCTURE).search(self.buf, self.pos)
            if m is None:
                self.pos = len(self.buf)  # nothing structural up to here: never searched again
                self._trim()
                if not self._more():
                    end = len(self.buf)
                continue
            c, self.pos = self.buf[m.start()], m.end()
            if c == ord('"'):
                self._skip_string()
            elif c in b"[{":
                depth += 1
            elif c in b"]}":
                if depth == 0 and array:  # the array's own ']': values() reads it next
                    end = self.pos = m.start()
                elif depth == 0:  # a stray closer between values: part of a bad element
                    end = self.pos
                else:
                    depth -= 1
                    end = self.pos if depth == 0 and not array else None
            elif depth == 0:  # a ',' between elements
                end = m.start()
        size = self._dropped + end
        where = f"{self.path}:{line}"
        if size > self.cap:
            return RawRow(0, where, line, raw=self._head or bytes(self.buf[:_HEAD_KEEP]), oversize=size)
        return RawRow(0, where, line, raw=bytes(self.buf[:end]))

    def _trim(self) -> None:
        """An element past the cap: keep its head, let the bytes before pos go (they are
        scanned), so memory stays at the cap plus one read chunk however long the element."""
        if self.pos > self.cap:
            self._head = self._head or bytes(self.buf[:_HEAD_KEEP])
            self._dropped += self.pos
            self._drop(self.pos)

    def _skip_string(self) -> None:
        """Move pos past the closing quote of the string it is in (or to the end of the data)."""
        while True:
            s = _STRING_END.search(self.buf, self.pos)
            if s is None or (self.buf[s.start()] == ord("\\") and s.end() >= len(self.buf)):
                # scanned up to the end, or to a backslash whose escaped byte is still unread
                self.pos = len(self.buf) if s is None else s.start()
                self._trim()
                if not self._more():
                    self.pos = len(self.buf)
                    return
                continue
            if self.buf[s.start()] == ord("\\"):
                self.pos = s.end() + 1  # the escaped character, whatever it is
                continue
            self.pos = s.end()
            return


def _is_parquet(path: str) -> bool:
    if path.endswith(".parquet"):
        return True
    if not os.path.isfile(path):  # a pipe: reading its magic would consume it
        return False
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"PAR1"
    except OSError:
        return False


def _require(module: str, what: str):
    import importlib
    try:
        return importlib.import_module(module)
    except ImportError:
        raise DataError(f"reading {what} needs the {module.split('.')[0]} package: {_DATA_EXTRA_HINT}") from None


def _parquet_file(path: str):
    """The opened Parquet file; DataError when its footer cannot be read (no row is reachable)."""
    pq = _require("pyarrow.parquet", "Parquet files")
    try:
        return pq.ParquetFile(path)
    except Exception as e:  # pyarrow's ArrowInvalid and friends
        raise DataError(f"{path}: not a readable Parquet file ({type(e).__name__}: {str(e)[:300]})") from None


def _parquet_rows(path: str) -> Iterator[RawRow]:
    pf = _parquet_file(path)
    n = 0
    for group in range(pf.num_row_groups):
        # One row group at a time: a damaged one (a corrupt page) rejects its own rows, not the file.
        num_rows, done = pf.metadata.row_group(group).num_rows, 0
        try:
            for batch in pf.iter_batches(batch_size=64, row_groups=[group]):
                for value, why in _batch_values(batch):
                    yield RawRow(0, f"{path} row {n}", value=value, unreadable=why)
                    n, done = n + 1, done + 1
        except Exception as e:  # pyarrow's ArrowInvalid, OSError and friends: the group cannot be decoded
            why = f"row group {group} of {path} unreadable ({type(e).__name__}: {str(e)[:200]})"
            for _ in range(num_rows - done):
                yield RawRow(0, f"{path} row {n}", unreadable=why)
                n += 1


_VALUE_ERRORS = (ValueError, OverflowError, TypeError, ArithmeticError)


def _batch_values(batch) -> list[tuple[dict | None, str | None]]:
    """(row, None) for each row of a record batch; (None, why) for a row whose values Python
    cannot hold (a timestamp past year 9999: OverflowError), the batch's other rows intact."""
    try:
        return [(value, None) for value in batch.to_pylist()]
    except _VALUE_ERRORS:
        pass
    out = []
    for i in range(batch.num_rows):  # row by row, only for the batch that failed
        try:
            out.append((batch.slice(i, 1).to_pylist()[0], None))
        except _VALUE_ERRORS as e:
            out.append((None, f"a value cannot be read ({type(e).__name__}: {str(e)[:200]})"))
    return out


def _parquet_num_rows(path: str) -> int:
    return int(_parquet_file(path).metadata.num_rows)


def _load_from_disk(path: str, split: str | None):
    datasets = _require("datasets", "a save_to_disk directory")
    try:
        ds = datasets.load_from_disk(path)
    except Exception as e:
        raise DataError(f"{path}: not a readable save_to_disk directory ({type(e).__name__}: {e})") from None
    if isinstance(ds, datasets.DatasetDict):
        ds = ds[chosen_split(path, list(ds), split)]
    elif split is not None:
        raise DataError(f"{path}: a single-split dataset; --split {split!r} does not apply")
    return ds


def chosen_split(path: str, names: list[str], split: str | None) -> str:
    """The split of a DatasetDict that is read: `split`, else `train`, else the only one."""
    chosen = split or ("train" if "train" in names else names[0] if len(names) == 1 else None)
    if chosen not in names:
        raise DataError(f"{path}: split {split!r} not found; splits: {names} (choose one with --split)"
                        if split else f"{path}: splits {names} and none is 'train'; choose one with --split")
    return chosen


def _arrow_dataset_rows(path: str, split: str | None) -> Iterator[RawRow]:
    ds = _load_from_disk(path, split)
    for start in range(0, len(ds), 64):
        stop = min(start + 64, len(ds))
        try:
            batch = ds[start:stop]
            keys = list(batch)
            rows = [(dict(zip(keys, values)), None) for values in zip(*(batch[k] for k in keys))]
        except Exception:  # a value Python cannot hold, a damaged arrow file: find the rows, one by one
            rows = [_arrow_dataset_row(ds, i) for i in range(start, stop)]
        for n, (value, why) in enumerate(rows, start):
            yield RawRow(0, f"{path} row {n}", value=value, unreadable=why)


def _arrow_dataset_row(ds, i: int) -> tuple[dict | None, str | None]:
    try:
        return ds[i], None
    except Exception as e:  # pyarrow's and datasets' own errors, OverflowError of a timestamp
        return None, f"a value cannot be read ({type(e).__name__}: {str(e)[:200]})"


def _arrow_dataset_len(path: str, split: str | None) -> int:
    return len(_load_from_disk(path, split))


def _count_lines(path: str) -> int:
    n, last = 0, b"\n"
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            n += chunk.count(b"\n")
            last = chunk[-1:]
    return n + (last != b"\n")


def _hash_file(path: str, h) -> int:
    """Add a file's bytes to hash h; returns its size."""
    n = 0
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
            n += len(chunk)
    return n


def _hash_tree(root: str, h, split: str | None) -> None:
    """Add the files of a save_to_disk directory to hash h, in sorted order, each as its
    relative path and its bytes: a DatasetDict keeps its rows in split subdirectories, not
    beside dataset_dict.json; only the split read is hashed (another may be far larger)."""
    splits = _dict_splits(root)
    for dirpath, dirnames, filenames in os.walk(root):
        if dirpath == root and splits:
            dirnames[:] = [d for d in dirnames if d not in splits or d == chosen_split(root, splits, split)]
        dirnames.sort()
        for name in sorted(filenames):
            path = os.path.join(dirpath, name)
            if os.path.isfile(path):
                h.update(os.path.relpath(path, root).replace(os.sep, "/").encode() + b"\0")
                h.update(str(_size(path)).encode() + b"\0")  # so no path/content split is ambiguous
                _hash_file(path, h)


def _dict_splits(root: str) -> list[str]:
    """The splits a DatasetDict's dataset_dict.json names ([] for a single Dataset)."""
    path = os.path.join(root, "dataset_dict.json")
    if not os.path.isfile(path):
        return []
    splits = read_json_object(path, "dataset_dict.json", max_bytes=1 << 20).get("splits")
    return [s for s in splits if isinstance(s, str)] if isinstance(splits, list) else []


def _size(path: str) -> int:
    try:
        return os.path.getsize(path) if os.path.isfile(path) else 0
    except OSError:
        return 0


def split_of(rel_path: str) -> str | None:
    """The split a shard belongs to by its name (see the module docstring), or None."""
    parts = rel_path.replace(os.sep, "/").split("/")
    name = parts[-1]
    m = _HF_SHARD.match(name)
    if m:
        return m.group("split")
    for d in reversed(parts[:-1]):
        if d in _SPLIT_NAMES:
            return d
    stem = name.split(".", 1)[0]
    return stem if stem in _SPLIT_NAMES else None


def read_as_shard(root: str, path: str, split: str | None) -> bool:
    """Whether a directory input `root` would read a file at `path` as one of its shards (by
    the rules of `_shards`; with no --split, a file of any split counts)."""
    if not os.path.isdir(root) or any(os.path.exists(os.path.join(root, n)) for n in ("dataset_dict.json",
                                                                                    "state.json")):
        return False  # a file input, or a save_to_disk directory (its Arrow files, not shards)
    # The directory resolved, the name not: os.walk lists a symlink by its own name, and the
    # sort's rename replaces the link itself with the output.
    path = os.path.abspath(path)
    rel = os.path.relpath(os.path.join(os.path.realpath(os.path.dirname(path)), os.path.basename(path)),
                          os.path.realpath(root))
    parts = rel.split(os.sep)
    if parts[0] == os.pardir or any(p.startswith(".") for p in parts):
        return False
    name = parts[-1]
    if not name.endswith(_SHARD_EXTS) or name.endswith(SIDE_FILE_SUFFIXES) or name in ("dataset_info.json",
                                                                                          "state.json"):
        return False
    return split is None or split_of(rel) == split


def _shards(root: str, split: str | None) -> tuple[list[str], list[str]]:
    """(the shards to read, the side files skipped) of a directory input."""
    found, side = [], []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        names = [n for n in sorted(filenames) if n.endswith(_SHARD_EXTS) and not n.startswith(".")
                 and n not in ("dataset_info.json", "state.json")]
        side += [os.path.join(dirpath, n) for n in names if n.endswith(SIDE_FILE_SUFFIXES)]
        found += [os.path.join(dirpath, n) for n in names if not n.endswith(SIDE_FILE_SUFFIXES)]
    dangling = [f for f in found if not os.path.exists(f)]  # a symlink to nothing (exists() follows it)
    if dangling:
        raise DataError(f"{dangling[0]}: a symlink to {os.readlink(dangling[0])}, which does not exist; fix or "
                        f"remove it (the input directory {root} would read it as a shard)")
    if not found:
        raise DataError(f"{root}: no *.parquet, *.jsonl or *.json files, and not a save_to_disk directory "
                        "(no state.json / dataset_dict.json)")
    splits = {f: split_of(os.path.relpath(f, root)) for f in found}
    named = sorted({s for s in splits.values() if s is not None})
    if split is None:
        if len(named) <= 1:
            return found, side
        if "train" not in named:
            raise DataError(f"{root}: shards of several splits {named}; choose one with --split")
        split = "train"
    chosen = [f for f in found if splits[f] == split]
    if not chosen:
        raise DataError(f"{root}: no shard of split {split!r}; splits found: {named or 'none (no split names)'}")
    return chosen, side


def _resolve(path: str, split: str | None) -> tuple[list[str], str, list[str]]:
    """(files, kind, side files skipped) of an input path; DataError naming the path when it
    cannot be read."""
    if not os.path.exists(path):
        raise DataError(f"{path}: no such input file or directory")
    if os.path.isdir(path):
        if os.path.exists(os.path.join(path, "dataset_dict.json")) or os.path.exists(os.path.join(path, "state.json")):
            return [], "arrow_dataset", []
        files, side = _shards(path, split)
        return files, "shards", side
    if split is not None:
        raise DataError(f"{path}: --split {split!r} applies to a directory input, not to a file")
    if not os.access(path, os.R_OK):
        raise DataError(f"{path}: not readable (permission denied)")
    return [path], "file", []
