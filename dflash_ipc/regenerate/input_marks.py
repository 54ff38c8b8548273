"""What a resume knows of the input its output was begun from: each file's size and the digest
of its first 64 KiB, kept in OUT.state.json.

The settings compare the input by path. A file replaced under the same path (a dataset
re-exported, a shard rewritten) would have the rerun append replies to the new rows beside
replies to the old ones, and the indices would no longer say which. The marks catch the usual
cases (a different file, a shorter one, changed first rows) without reading the whole input
again; rows appended at the end are not a change (the rerun generates them). A change is said
once, not refused: an edit that fixed a few rows is a reason to resume, and the user knows which.
Files that are not regular (a pipe, stdin) get no mark: reading their head would consume it.
"""

from __future__ import annotations

import hashlib
import os
import stat

HEAD_BYTES = 64 * 1024


def input_marks(files) -> list[dict]:
    """``[{"file", "size", "head_bytes", "head_sha256"}]`` for the regular files among ``files``: the
    digest of their first ``head_bytes`` (at most HEAD_BYTES)."""
    marks = []
    for path in files:
        try:
            st = os.stat(path)
            if not stat.S_ISREG(st.st_mode):
                continue
            head = min(st.st_size, HEAD_BYTES)
            digest = _head_digest(path, head)
        except OSError:  # unreadable now: the reader says so in its own words
            continue
        marks.append({"file": os.path.abspath(path), "size": st.st_size, "head_bytes": head, "head_sha256": digest})
    return marks


def _head_digest(path: str, length: int) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read(length)).hexdigest()


def changed_inputs(before, now: list[dict]) -> list[str]:
    """What changed from the marks ``before`` (a state file's, any JSON) to ``now``: one phrase per
    file; [] when nothing did or ``before`` holds no marks (a state file of an earlier version)."""
    if not isinstance(before, list):
        return []
    old = {m["file"]: m for m in before if isinstance(m, dict) and isinstance(m.get("file"), str)}
    new = {m["file"]: m for m in now}
    if not old:
        return []
    changes = [f"{f}: gone" for f in sorted(old.keys() - new.keys())]
    changes += [f"{f}: new" for f in sorted(new.keys() - old.keys())]
    for f in sorted(old.keys() & new.keys()):
        was, is_ = old[f], new[f]
        size, head = was.get("size"), was.get("head_bytes")
        if not (isinstance(size, int) and isinstance(head, int) and 0 <= head <= min(size, HEAD_BYTES)):
            changes.append(f"{f}: its mark in the state file is unreadable")
        elif is_["size"] < size:
            changes.append(f"{f}: shorter ({size} -> {is_['size']} bytes)")
        else:  # the same first bytes as then (rows appended after them are no change)
            try:
                same = _head_digest(f, head) == was.get("head_sha256")
            except OSError:
                continue
            if not same:
                changes.append(f"{f}: its first {head:,} bytes differ")
    return changes
