"""The output of a regeneration: resumable, never torn, complete and ordered at the end.

Four files side by side:
  OUT.jsonl          one regenerated row a line, `{"index": i, "messages": [...]}`, the index
                     (the row's position in the input) first; appended as rows finish, in
                     any order; sorted by index when the run is complete. With N samples per
                     prompt (`--samples-per-prompt`) each row has N lines,
                     `{"index": i, "sample": k, "messages": [...]}`, k = 0..N-1
  OUT.rejects.jsonl  the rows this run could not regenerate (index, place, reason, detail)
  OUT.state.json     the settings the replies depend on, whether the file is complete, and
                     the input files' sizes and first bytes (regenerate/input_marks.py)
  OUT.lock           held (flock) by the run writing OUT.jsonl: a second run on it is refused
                     (regenerate/out_lock.py)

Each row is one `os.write` of a whole line to a file opened for appending, and the file is
fsynced every few seconds and at the end. A run killed mid-write leaves at most one partial
last line; the next run cuts it off before appending (and says so). A rerun with the same
settings skips every row (every sample of it) already in the file and retries the others (last run's rejects
included: their errors may have been transient). A rerun with other settings is refused,
since one file would then mix replies of two configurations. Complete means every input row
is in the output or in the rejects file; the file is then rewritten in index order
(through a temporary file and a rename, so it is never half sorted).

A write that fails (a full disk, a quota, an I/O error) stops the run with one `OutputFailed`
line saying how many rows are kept: the rows already written stay, a partly written line is
cut off again, and nothing more is appended (a later line glued to a torn one would corrupt
the file); a rerun resumes.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import time

from dflash_ipc.errors import DataError
from dflash_ipc.regenerate.input_marks import changed_inputs, input_marks
from dflash_ipc.regenerate.out_lock import OutLock
from dflash_ipc.regenerate.out_paths import check_out_path, sidecar_paths
from dflash_ipc.run.json_files import read_json_object, write_json_atomic
from dflash_ipc.run.write_probe import output_file_problem

log = logging.getLogger(__name__)

STATE_FORMAT = 1
FSYNC_INTERVAL_S = 5.0
# 18 digits: any row index, and int() stays cheap
_INDEX_HEAD = re.compile(rb'^\{"index": (\d{1,18})(?:, "sample": (\d{1,9}))?[,}]')


class OutputFailed(DataError):
    """Writing the output failed (ENOSPC, EDQUOT, EIO): the run stops; what is written is kept."""


def line_key(line: bytes) -> tuple[int, int] | None:
    """(index, sample) of a written line (sample 0 when it has none), or None when it is not one of ours."""
    m = _INDEX_HEAD.match(line)
    if m:
        return int(m.group(1)), int(m.group(2) or 0)
    try:
        value = json.loads(line)
    except (ValueError, RecursionError):  # bad JSON or UTF-8, huge integers, deep nesting
        return None
    if not isinstance(value, dict):
        return None
    index, sample = value.get("index"), value.get("sample", 0)
    ok = all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (index, sample))
    return (index, sample) if ok else None


def line_index(line: bytes) -> int | None:
    """The index a written line starts with, or None when it is not one of ours."""
    key = line_key(line)
    return None if key is None else key[0]


def _recorded_settings(state_path: str, state: dict) -> dict:
    theirs = state.get("settings")
    if not isinstance(theirs, dict):
        raise DataError(f"{state_path}: field settings must be an object; pass --overwrite to start over")
    return theirs


def _read_state(path: str) -> dict:
    """The state file of output `path`, read (a JSON object, else DataError naming it)."""
    return read_json_object(sidecar_paths(path)[1], "regenerate state")


def _refuse_other_settings(path: str, state: dict, settings: dict, keys) -> None:
    """DataError naming each of `keys` whose value in `state` (`path`'s state file) is not `settings`'."""
    theirs = _recorded_settings(sidecar_paths(path)[1], state)
    diff = sorted(k for k in keys
                  if theirs.get(k) != settings.get(k) and not _legacy_auto_dtype(path, k, theirs, settings))
    if diff:
        shown = {k: (theirs.get(k), settings.get(k)) for k in diff}
        raise DataError(f"{path}: made with other settings (file, now): {shown}; rerun with the same "
                        "options to resume, or pass --overwrite / choose another --out")


def _legacy_auto_dtype(path: str, key: str, theirs: dict, settings: dict) -> bool:
    """True (with a warning) for a state file written before the resolved dtype was recorded:
    it holds "auto", which says nothing of what was used (float32 on CPU, bfloat16 on a GPU).
    Refusing would strand every run in progress (no option makes the new record "auto"
    again, and --overwrite throws its rows away); earlier versions resumed it silently, so it
    is accepted, said once, and the state file records the resolved dtype from now on."""
    if key != "dtype" or theirs.get("dtype") != "auto" or settings.get("dtype") in (None, "auto"):
        return False
    log.warning("%s: its state file records dtype 'auto' (written by an earlier version), so the dtype of its "
                "rows is unknown; resuming with %s. If the earlier run used another device kind (CPU: float32, "
                "GPU: bfloat16), pass --overwrite or choose another --out", path, settings["dtype"])
    return True


def check_resumable(out_path: str, known: dict) -> None:
    """Before the backend is made (a model loaded: seconds): an existing output whose state file
    records other values of the `known` settings (the options, the backend's kind) is refused
    now. The settings only the backend knows (stop tokens, dtype) are checked when it runs."""
    path = os.path.abspath(out_path)
    if os.path.exists(sidecar_paths(path)[1]):
        _refuse_other_settings(path, _read_state(path), known, known)


class RegenOutput:
    """The output file of one run (see the module docstring). `done` holds the indices
    already written (before this run and during it), every sample of them."""

    def __init__(self, path: str, settings: dict, *, overwrite: bool = False, samples_per_prompt: int = 1,
                 inputs=(), input_dir: str | None = None, split: str | None = None, lock: OutLock | None = None):
        """`lock`: the output's lock, taken by the caller (the command line takes it before the
        model loads); this output releases it when closed. None: taken here."""
        self.path = os.path.abspath(path)
        self.rejects_path, self.state_path = sidecar_paths(self.path)
        self.settings = settings
        self.samples_per_prompt = samples_per_prompt
        self.done: set[int] = set()
        self._samples: dict[int, set[int]] = {}  # index -> samples written, for rows not yet done
        self.rejected: set[tuple[int, int]] = set()  # this run's rejects: (index, sample)
        self.num_written = 0
        self.num_rejected = 0
        self.num_torn = 0
        self.failed: OutputFailed | None = None
        self.input_marks = input_marks(inputs)
        self._lock = lock
        self._fd = -1
        self._closed = False
        try:
            check_out_path(self.path, inputs, input_dir=input_dir, split=split)  # before --overwrite deletes anything
            check_writable(self.path)
            if self._lock is None:
                self._lock = OutLock(self.path)
                self._lock.acquire()  # before anything is deleted, cut or appended: this run is the only writer
            if overwrite:
                self._remove_earlier_output()
            self._check_settings()
            if os.path.exists(self.path):
                self._resume()
            self._write_state(complete=False, num_rows=None)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            self._rejects = open(self.rejects_path, "w", encoding="utf-8")
        except BaseException as e:
            if self._fd >= 0:
                os.close(self._fd)
            if self._lock is not None:
                self._lock.release()
            if isinstance(e, OSError):
                raise self._fail(e) from None
            raise
        self._synced = time.monotonic()

    def _remove_earlier_output(self) -> None:
        """--overwrite: the earlier output and its side files go; one that cannot is named (the
        ones removed before it are gone, and the rerun starts over as this one would have)."""
        for p in (self.path, self.rejects_path, self.state_path):
            try:
                if os.path.exists(p):
                    os.remove(p)
            except OSError as e:
                raise DataError(f"{p}: cannot remove it for --overwrite ({e.strerror or e}); remove it yourself, "
                                "or choose another --out") from None

    def _check_settings(self) -> None:
        if not os.path.exists(self.state_path):
            if os.path.exists(self.path) and os.path.getsize(self.path):
                raise DataError(f"{self.path}: exists without its {os.path.basename(self.state_path)}, so the "
                                "settings its rows were made with are unknown; pass --overwrite or choose another --out")
            return
        state = _read_state(self.path)  # once: the settings, then the input marks
        recorded = set(_recorded_settings(self.state_path, state))
        _refuse_other_settings(self.path, state, self.settings, recorded | set(self.settings))
        changes = changed_inputs(state.get("inputs"), self.input_marks)
        if changes:
            shown = "; ".join(changes[:3]) + (f"; and {len(changes) - 3} more" if len(changes) > 3 else "")
            log.warning("%s: the input changed since this output was begun (%s): the rows already written answer "
                        "the earlier content and are kept; pass --overwrite to regenerate every row", self.path, shown)

    def _resume(self) -> None:
        """Cut a torn last line off, then read the indices already written."""
        size = os.path.getsize(self.path)
        with open(self.path, "rb+") as f:
            keep = _complete_prefix(f, size)
            if keep < size:
                f.truncate(keep)
                self.num_torn = 1
                log.warning("%s: cut off a torn last line (%d bytes) left by an interrupted run", self.path, size - keep)
            f.seek(0)
            for n, line in enumerate(f, start=1):
                key = line_key(line)
                if key is None or key[1] >= self.samples_per_prompt:
                    raise DataError(f"{self.path}:{n}: not a regenerated row (no leading \"index\", or a \"sample\" "
                                    f"not below {self.samples_per_prompt}); this file was not written by regenerate "
                                    "with these settings, or was edited")
                self._add(*key)

    def _add(self, index: int, sample: int) -> None:
        if index in self.done:
            return
        written = self._samples.setdefault(index, set())
        written.add(sample)
        if len(written) == self.samples_per_prompt:
            self.done.add(index)
            del self._samples[index]

    def missing_samples(self, index: int) -> list[int]:
        """The samples of row `index` not written yet (all of them for a new row, none for a done one)."""
        if index in self.done:
            return []
        written = self._samples.get(index, ())
        return [k for k in range(self.samples_per_prompt) if k not in written]

    def write(self, row: dict) -> None:
        """Append one finished row (its dict starts with "index", then "sample" if it has one) as one line."""
        if self.failed is not None:
            raise self.failed
        line = (json.dumps(row, ensure_ascii=False) + "\n").encode("utf-8")
        view = memoryview(line)
        try:
            while view:
                view = view[os.write(self._fd, view):]
        except BaseException as e:  # a full disk, or Ctrl-C / SIGTERM between two partial writes
            self._cut_partial(len(line) - len(view))
            if isinstance(e, OSError):
                raise self._fail(e) from None
            raise
        self._add(row["index"], row.get("sample", 0))
        self.num_written += 1
        if time.monotonic() - self._synced > FSYNC_INTERVAL_S:
            try:
                os.fsync(self._fd)
            except OSError as e:
                raise self._fail(e) from None
            self._synced = time.monotonic()

    def _cut_partial(self, written: int) -> None:
        """Take back the first `written` bytes of a line that was not written whole (this
        process is the file's only writer, so they are its last bytes). Best effort: a line
        left torn is cut off by the next run."""
        if written:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, os.fstat(self._fd).st_size - written)

    def _fail(self, e: OSError) -> OutputFailed:
        """The one error a failed write becomes (of OUT.jsonl or a side file: one cause, a
        full disk or a quota, one remedy); later writes raise it again."""
        reason = (e.strerror or str(e)).rstrip(".")
        reason = reason[:1].lower() + reason[1:]
        self.failed = OutputFailed(f"{self.path}: {reason} ({len(self.done)} rows kept; rerun to resume)")
        return self.failed

    def reject(self, index: int, where: str, reason: str, detail: str, raw: str = "",
               samples: list[int] | None = None) -> None:
        """Record a row this run could not regenerate: `samples` of it (default: every one not written)."""
        samples = self.missing_samples(index) if samples is None else samples
        record = {"index": index, "where": where, "reason": reason, "detail": detail[:500], "raw": raw[:2000]}
        if self.samples_per_prompt > 1:
            record = {"index": index, "samples": samples} | record
        if self.failed is not None:
            raise self.failed
        try:
            self._rejects.write(json.dumps(record, ensure_ascii=False) + "\n")
        except OSError as e:
            raise self._fail(e) from None
        self.rejected.update((index, k) for k in samples)
        self.num_rejected += 1

    def finish(self, num_rows: int | None) -> bool:
        """Close the files. num_rows: the input's rows when it was read to the end (None if
        not). Complete (every row written or rejected): sort by index; returns complete.
        After a failed write: closes what it can, raises nothing (the run's error is that
        write's) and returns False. A failure here: OutputFailed, once the files are closed.
        The output's lock goes last, once the sort and the state file are done. A second call
        returns False and does nothing."""
        if self._closed:
            return False
        self._closed = True
        try:
            return self._close(num_rows)
        finally:
            self._lock.release()

    def _close(self, num_rows: int | None) -> bool:
        errors = []
        for close in (lambda: os.fsync(self._fd), lambda: os.close(self._fd), self._rejects.close):
            try:
                close()
            except OSError as e:
                errors.append(e)
        if self.failed is not None:
            # The state file keeps its last whole version (complete: false): a rerun resumes.
            with contextlib.suppress(OSError):
                self._write_state(complete=False, num_rows=num_rows)
            return False
        complete = not errors and num_rows is not None and all(
            i in self.done or all((i, k) in self.rejected for k in self.missing_samples(i)) for i in range(num_rows))
        try:
            if errors:
                raise errors[0]
            if complete:
                sort_by_index(self.path)
            self._write_state(complete=complete, num_rows=num_rows)
        except OSError as e:
            raise self._fail(e) from None
        return complete

    def _write_state(self, *, complete: bool, num_rows: int | None) -> None:
        state = {"format": STATE_FORMAT, "settings": self.settings, "complete": complete, "num_rows": num_rows,
                 "num_done": len(self.done), "num_rejected": self.num_rejected, "inputs": self.input_marks}
        write_json_atomic(self.state_path, state, sort_keys=True, fsync=True)


def _complete_prefix(f, size: int) -> int:
    """Bytes up to and including the last newline (a line after it is torn)."""
    pos = size
    while pos > 0:
        step = min(1 << 16, pos)
        f.seek(pos - step)
        chunk = f.read(step)
        k = chunk.rfind(b"\n")
        if k >= 0:
            return pos - step + k + 1
        pos -= step
    return 0


def sort_by_index(path: str) -> int:
    """Rewrite path in (index, sample) order (a later copy of one is dropped); returns the lines
    kept. Memory: one (key, offset, length) per line, never the rows themselves."""
    spans = []
    with open(path, "rb") as f:
        offset = 0
        for line in f:
            spans.append((line_key(line), offset, len(line)))
            offset += len(line)
        spans.sort(key=lambda s: (s[0], s[1]))
        tmp = f"{path}.sorting-{os.getpid()}"
        seen = None
        try:
            with open(tmp, "wb") as out:
                for key, start, length in spans:
                    if key == seen:
                        continue
                    seen = key
                    f.seek(start)
                    out.write(f.read(length))
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, path)
        except BaseException:  # a full disk, Ctrl-C: the unsorted file stays whole, no half copy beside it
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
    return len({s[0] for s in spans})


def check_writable(path: str) -> None:
    """DataError naming `path` when it is a directory, its directory cannot be made or takes no
    new file (the sort's temporary file and the state file are new files there), or the file
    exists and cannot be written; makes the directory."""
    parent = os.path.dirname(path) or "."
    if not os.path.isdir(path):
        try:
            os.makedirs(parent, exist_ok=True)
        except OSError as e:
            raise DataError(f"{parent}: cannot create the output directory ({e.strerror})") from None
    problem = output_file_problem(path)
    if problem:
        raise DataError(f"{path}: {problem}; choose a writable --out (a JSONL file path)")
