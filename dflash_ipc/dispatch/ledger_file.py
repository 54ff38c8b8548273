"""The ledger on disk: one uncompressed ``.npz`` of column arrays, no pickle.

Written to a temp file in the same directory, fsynced, then ``os.replace``d over the old
file, so a crash at any point leaves either the old or the new ledger. Reading turns every
failure (missing, truncated, bit-flipped, empty, not an archive, inconsistent columns) into
one ``DataError`` naming the file. Version 1 files (whole-batch commits) are read too.
"""

from __future__ import annotations

import logging
import math
import os
import tempfile
import zipfile

import numpy as np

from dflash_ipc.dispatch.buckets import PlannedBatch
from dflash_ipc.dispatch.ledger import BatchState, CommitRecord, Ledger, Owner
from dflash_ipc.errors import DataError

logger = logging.getLogger(__name__)

FORMAT_VERSION = 2
NO_OWNER = -1  # owner/slot/step columns use -1 for "none" on disk
_HEADER_READERS = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}


_TEMP_PREFIX, _TEMP_SUFFIX = ".ledger-", ".tmp"


def remove_partial_saves(path: str | os.PathLike) -> int:
    """Deletes the temp files of saves cut short next to ledger `path` (a dispatcher killed
    mid-save: up to a ledger's size each). Only while no dispatcher of that run directory
    lives: the supervisor's start, under the run directory's lock."""
    directory = os.path.dirname(os.path.abspath(os.fspath(path)))
    removed = 0
    for name in os.listdir(directory) if os.path.isdir(directory) else []:
        if name.startswith(_TEMP_PREFIX) and name.endswith(_TEMP_SUFFIX):
            try:
                os.unlink(os.path.join(directory, name))
                removed += 1
            except FileNotFoundError:
                pass
    return removed


def save_ledger(ledger: Ledger, path: str | os.PathLike) -> None:
    """Write the ledger atomically (temp file in the same dir, fsync, os.replace)."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=_TEMP_PREFIX, suffix=_TEMP_SUFFIX, dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            _write_npz(f, to_columns(ledger))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    _fsync_dir(directory)


def load_ledger(path: str | os.PathLike, *, recover: bool = True) -> Ledger:
    """Read a saved ledger; with ``recover`` apply the dispatcher-restart rule (everything
    not committed is pending again)."""
    path = os.fspath(path)
    hint = ("the ledger is damaged; this run directory cannot resume exactly-once from it: "
            "restore it from a backup, or start a new run.run_dir")
    try:
        if os.path.getsize(path) == 0:
            raise DataError(f"ledger {path} is empty (0 bytes); {hint}")
        with open(path, "rb") as f:
            if f.read(4) != b"PK\x03\x04":
                raise DataError(f"ledger {path} is not a ledger file (not an .npz archive); {hint}")
        _check_archive(path, hint)
        with np.load(path, allow_pickle=False) as z:
            data = {k: z[k] for k in z.files}
    except DataError:
        raise
    except FileNotFoundError:
        raise DataError(f"ledger {path} does not exist") from None
    except ValueError as exc:
        if "pickle" in str(exc):  # numpy's words for "not an .npz archive"
            raise DataError(f"ledger {path} is not a ledger file (not an .npz archive); {hint}") from None
        raise DataError(f"ledger {path} is unreadable ({exc}); {hint}") from None
    except (OSError, EOFError, zipfile.BadZipFile, KeyError, RuntimeError, MemoryError) as exc:
        raise DataError(f"ledger {path} is unreadable ({type(exc).__name__}: {exc}); {hint}") from None
    try:
        version = int(data["format_version"])
    except (KeyError, TypeError, ValueError):
        raise DataError(f"ledger {path} has no format_version: not a ledger file; {hint}") from None
    if version not in (1, FORMAT_VERSION):
        raise DataError(f"ledger {path}: format_version {version}, this code reads 1 and {FORMAT_VERSION}")
    try:
        ledger = from_columns(data, version)
    except (KeyError, IndexError, ValueError, TypeError, DataError) as exc:
        raise DataError(f"ledger {path} is inconsistent or truncated ({exc!r}); {hint}") from None
    if recover:
        moved = ledger.requeue_uncommitted()
        logger.info("loaded ledger %s; %d in-flight batches back to pending", path, len(moved))
    return ledger


def _check_archive(path: str, hint: str) -> None:
    """Before numpy reads a byte: every member a stored (uncompressed, as `save_ledger` writes
    it) plain .npy array whose header promises no more data than the member holds, so no
    file can make the dispatcher allocate more than the file's own size (a zip bomb, a
    header claiming 10^15 entries) or unpickle anything."""
    with zipfile.ZipFile(path) as archive:
        for info in archive.infolist():
            if info.compress_type != zipfile.ZIP_STORED or not info.filename.endswith(".npy"):
                raise DataError(f"ledger {path}: member {info.filename[:60]!r} is not a stored .npy array "
                                f"(this code writes no other); {hint}")
            with archive.open(info) as member:
                read_header = _HEADER_READERS.get(np.lib.format.read_magic(member))
                if read_header is None:
                    raise DataError(f"ledger {path}: member {info.filename[:60]} has an .npy version this code "
                                    f"does not write; {hint}")
                shape, _, dtype = read_header(member)
                if dtype.hasobject:
                    raise DataError(f"ledger {path}: member {info.filename[:60]} holds Python objects, never "
                                    f"loaded; {hint}")
                need = math.prod(shape) * dtype.itemsize
                if need > info.file_size:
                    raise DataError(f"ledger {path}: member {info.filename[:60]} claims {need} bytes of data "
                                    f"in {info.file_size}; {hint}")


def to_columns(ledger: Ledger) -> dict[str, np.ndarray]:
    entries = list(ledger.entries())
    batches = [e.batch for e in entries]
    names: dict[Owner, int] = {}

    def name_index(name: Owner | None) -> int:
        return NO_OWNER if name is None else names.setdefault(name, len(names))

    history = ledger.history()
    hist_sizes = [len(r.sample_ids) for r in history]
    sizes = [len(b.sample_ids) for b in batches]
    return {
        "format_version": np.array(FORMAT_VERSION, dtype=np.int64),
        "batch_id": np.array([b.batch_id for b in batches], dtype=np.int64),
        "epoch": np.array([b.epoch for b in batches], dtype=np.int64),
        "bucket": np.array([b.bucket for b in batches], dtype=np.int64),
        "padded_len": np.array([b.padded_len for b in batches], dtype=np.int64),
        "offsets": _offsets(sizes),
        "sample_ids": _narrow(np.array([s for b in batches for s in b.sample_ids], dtype=np.int64)),
        "lengths": _narrow(np.array([n for b in batches for n in b.lengths], dtype=np.int64)),
        "state": np.array([int(e.state) for e in entries], dtype=np.int8),
        "target": np.array([name_index(e.target) for e in entries], dtype=np.int32),
        "drafter": np.array([name_index(e.drafter) for e in entries], dtype=np.int32),
        "slot": np.array([_or_none(e.slot) for e in entries], dtype=np.int64),
        "leases": np.array([e.leases for e in entries], dtype=np.int64),
        "attempt": np.array([e.attempt for e in entries], dtype=np.int64),
        "orphaned": np.array([e.orphaned for e in entries], dtype=bool),
        "step": np.array([_or_none(e.step) for e in entries], dtype=np.int64),
        "names": np.array([str(n) for n in names] or [""], dtype=str),
        "name_is_int": np.array([isinstance(n, int) for n in names] or [False]),
        "next_attempt": np.array(ledger.next_attempt, dtype=np.int64),
        "hist_batch": np.array([r.batch_id for r in history], dtype=np.int64),
        "hist_step": np.array([r.step for r in history], dtype=np.int64),
        "hist_offsets": _offsets(hist_sizes),
        "hist_samples": _narrow(np.array([s for r in history for s in r.sample_ids], dtype=np.int64)),
    }


def _check_ranges(d: dict[str, np.ndarray], version: int) -> None:
    """Values the state machine would take without a word: owners that name no owner (a
    negative index picks one from the end), negative slots, counts or commit steps."""
    num_names = len(d["names"])
    for column in ("target", "drafter"):
        if d[column].size and not (-1 <= d[column].min() and d[column].max() < num_names):
            raise DataError(f"column {column} names owners outside [-1, {num_names})")
    lows = {"slot": -1, "attempt": 0, "leases" if version >= 2 else "attempts": 0,
            "hist_step" if version >= 2 else "step": -1}
    for column, low in lows.items():
        if column in d and d[column].size and d[column].min() < low:
            raise DataError(f"column {column} holds {d[column].min()}, below {low}")


def from_columns(d: dict[str, np.ndarray], version: int) -> Ledger:
    _check_ranges(d, version)
    offsets, flat_ids, flat_len = d["offsets"].tolist(), d["sample_ids"].tolist(), d["lengths"].tolist()
    batches = [PlannedBatch(batch_id=bid, epoch=ep, bucket=bk, padded_len=pl,
                            sample_ids=tuple(flat_ids[lo:hi]), lengths=tuple(flat_len[lo:hi]))
               for bid, ep, bk, pl, lo, hi in zip(d["batch_id"].tolist(), d["epoch"].tolist(),
                                                  d["bucket"].tolist(), d["padded_len"].tolist(),
                                                  offsets[:-1], offsets[1:])]
    if len(batches) != len(d["state"]) or offsets[-1] != len(flat_ids):
        raise DataError(f"{len(batches)} batches, {len(d['state'])} states, {len(flat_ids)} sample ids")
    names = [int(n) if is_int else n for n, is_int in zip(d["names"].tolist(), d["name_is_int"].tolist())]
    owner = lambda i: None if i == NO_OWNER else names[i]  # noqa: E731
    none = lambda v: None if v == NO_OWNER else v  # noqa: E731
    ledger = Ledger()
    ledger.add_epoch(batches)
    leases = d["leases" if version >= 2 else "attempts"].tolist()
    attempt = d["attempt"].tolist() if version >= 2 else [0] * len(batches)
    orphaned = d["orphaned"].tolist() if version >= 2 else [False] * len(batches)
    for batch, state, tgt, dft, slot, lease, att, orph in zip(batches, d["state"].tolist(), d["target"].tolist(),
                                                              d["drafter"].tolist(), d["slot"].tolist(), leases,
                                                              attempt, orphaned):
        ledger.restore_entry(batch.batch_id, state=BatchState(state), target=owner(tgt), drafter=owner(dft),
                             slot=none(slot), leases=lease, attempt=att, orphaned=bool(orph))
    ledger.restore_history(_history(d, version, batches), next_attempt=int(d.get("next_attempt", 1)))
    return ledger


def _history(d: dict[str, np.ndarray], version: int, batches: list[PlannedBatch]) -> list[CommitRecord]:
    if version == 1:  # whole-batch commits, in commit order; the step of each is its entry's
        by_id = {b.batch_id: b for b in batches}
        steps = dict(zip(d["batch_id"].tolist(), d["step"].tolist()))
        return [CommitRecord(batch_id=b, step=steps[b], sample_ids=by_id[b].sample_ids)
                for b in d["history"].tolist()]
    offsets, flat = d["hist_offsets"].tolist(), d["hist_samples"].tolist()
    if len(offsets) != len(d["hist_batch"]) + 1 or offsets[-1] != len(flat):
        raise DataError("history columns do not match")
    return [CommitRecord(batch_id=b, step=s, sample_ids=tuple(flat[lo:hi]))
            for b, s, lo, hi in zip(d["hist_batch"].tolist(), d["hist_step"].tolist(), offsets[:-1], offsets[1:])]


def _write_npz(f, arrays: dict[str, np.ndarray]) -> None:
    """The one place bytes are written; a test makes it fail to simulate a crash."""
    np.savez(f, **arrays)


def _fsync_dir(directory: str) -> None:
    """Persist the rename itself (POSIX); skipped where directories cannot be fsynced."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _offsets(sizes: list[int]) -> np.ndarray:
    offsets = np.zeros(len(sizes) + 1, dtype=np.int64)
    np.cumsum(np.asarray(sizes, dtype=np.int64), out=offsets[1:])
    return offsets


def _narrow(values: np.ndarray) -> np.ndarray:
    """Smallest of int16/int32/int64 that holds every value: fewer bytes to write and fsync."""
    for dtype in (np.int16, np.int32):
        info = np.iinfo(dtype)
        if values.size == 0 or (values.min() >= info.min and values.max() <= info.max):
            return values.astype(dtype)
    return values


def _or_none(value: int | None) -> int:
    return NO_OWNER if value is None else value
