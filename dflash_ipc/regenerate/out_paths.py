"""What `--out` may name: checked before the model loads and again before anything is deleted.

regenerate appends to OUT.jsonl, fsyncs it, rewrites it sorted through a rename, and writes
OUT.rejects.jsonl, OUT.state.json and OUT.lock (regenerate/out_lock.py) beside it. Each of these needs a regular file (or none
yet): a device such as /dev/null cannot be fsynced or renamed over, and its side files would
land in /dev. And none of the three may be one of the inputs: `--overwrite` would delete the
input before reading it, a resume would append to what it reads, and the lock would write a pid
over it.
"""

from __future__ import annotations

import os
import stat

from dflash_ipc.data.reader import REJECTS_SUFFIX, STATE_SUFFIX, read_as_shard
from dflash_ipc.errors import DataError
from dflash_ipc.regenerate.out_lock import lock_path


def sidecar_paths(out_path: str) -> tuple[str, str]:
    """(rejects file, state file) of an output file."""
    stem = out_path[: -len(".jsonl")] if out_path.endswith(".jsonl") else out_path
    return f"{stem}{REJECTS_SUFFIX}", f"{stem}{STATE_SUFFIX}"  # suffixes a directory input skips (data/reader.py)


def out_files(out_path: str) -> tuple[str, str, str, str]:
    """(output, rejects file, state file, lock file) of an --out, absolute."""
    path = os.path.abspath(out_path)
    return (path, *sidecar_paths(path), lock_path(path))


def check_out_path(out_path: str, inputs=(), *, input_dir: str | None = None, split: str | None = None) -> None:
    """DataError naming the path when --out (or a side file of it) exists and is not a regular
    file, or is the same file as one of `inputs` (symlinks and ./ spellings included), or is a
    file that the directory input `input_dir` would read as a shard on the rerun that resumes."""
    paths = out_files(out_path)
    for path in paths:
        try:
            mode = os.stat(path).st_mode  # follows a symlink: what would be written is its target
        except (FileNotFoundError, NotADirectoryError):
            # Not there yet (or a dangling symlink, which a write replaces): fine. A parent
            # that is a file is answered by the writability check, naming the directory.
            continue
        except OSError as e:
            raise DataError(f"{path}: cannot be inspected ({e.strerror}); choose another --out") from None
        if stat.S_ISDIR(mode):
            raise DataError(f"{path}: is a directory; --out names the output JSONL file")
        if not stat.S_ISREG(mode):
            raise DataError(f"{path}: exists and is not a regular file (a device, pipe or socket); regenerate "
                            "appends to, fsyncs and renames its output and side files: choose a file path for --out")
    for path in paths:
        for source in inputs:
            if _same_file(path, source):
                raise DataError(f"{path}: is the input {source} (the same file); regenerate would write over what "
                                "it reads: choose another --out")
    if input_dir is not None and read_as_shard(input_dir, paths[0], split):
        raise DataError(f"{paths[0]}: is inside the input directory {input_dir}, which would read it as one of "
                        "its shards on the rerun that resumes (and on any later run): choose an --out outside it")


def local_input_files(input_path: str, split: str | None) -> list[str]:
    """The files an input reads, when it is a local path (a Hub id is resolved later, with the
    model: [] here). A missing or unreadable input is answered now, before the model loads."""
    if not os.path.exists(input_path):
        return []
    from dflash_ipc.data.reader import InputSource
    return list(InputSource(input_path, split=split).files)


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist: they cannot be one file
        return False
