"""Drafter checkpoints on disk: data only, checksummed, verified before use.

    checkpoints/step_00000500/
        config.json, model.safetensors   the inference export (bf16): what SGLang/vLLM load
        training_state.safetensors       master weights, optimizer moments, RNG (tensors)
        training_state.json              step, schedule, optimizer groups, commit bookkeeping
        manifest.json                    size and sha256 of every file above; written last
    checkpoints/latest.json             {"step", "path"} of the newest *committed* checkpoint: written by
                                        drafter rank 0 alone, at the step the dispatcher confirmed
                                        (`DrafterLoop.confirmed`), for export and eval to find
    checkpoints/uncommitted/step_N/      written but never committed: moved aside, never resumed

Nothing here can execute code: tensors are safetensors, the rest is JSON. A checkpoint is
written to a temp directory and renamed into place, its manifest the last file in it, so a
directory without a matching manifest is incomplete or damaged; `read` and `verify` raise
`DamagedCheckpointError` naming the file, and resume falls back to an older committed one.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import time

import psutil

from dflash_ipc.errors import DamagedCheckpointError
from dflash_ipc.run.json_files import read_json_object, write_json_atomic
from dflash_ipc.run.regular_file import regular_file

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
STATE_TENSORS = "training_state.safetensors"
STATE_JSON = "training_state.json"
LATEST = "latest.json"
CHECKPOINT_FILES = ("config.json", "model.safetensors", STATE_TENSORS, STATE_JSON)  # every one in the manifest
UNCOMMITTED = "uncommitted"
UNCOMMITTED_NOTE = "set aside, never committed (never resumed from)"  # how status and health list them
MAX_JSON_BYTES = 256 * 1024 * 1024  # the JSON parts of a checkpoint are far smaller
_STEP_DIR = re.compile(r"^step_(\d{8})$")
_PARTIAL_WRITE = re.compile(r"^(step_\d{8})\.(tmp|old|deleted)-(\d+)$")  # what `write`, `retain` rename through


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def step_of_dir_name(name: str) -> int | None:
    """The step a `step_NNNNNNNN` directory name holds, or None for any other name."""
    match = _STEP_DIR.match(name)
    return int(match.group(1)) if match else None


def sha256_of(path: str, chunk: int = 16 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def read_json_file(path: str, what: str) -> dict:
    """A JSON object from a file of bounded size; DamagedCheckpointError otherwise."""
    return read_json_object(path, what, error=DamagedCheckpointError, max_bytes=MAX_JSON_BYTES)


class CheckpointStore:
    """The checkpoints root of one run (`RunFiles.checkpoints`)."""

    def __init__(self, root: str) -> None:
        self.root = root

    def path(self, step: int) -> str:
        return os.path.join(self.root, step_dir_name(step))

    # --- writing ---------------------------------------------------------------------------

    def write(self, step: int, write_files) -> str:
        """Calls `write_files(tmp_dir)` to fill a temp directory, adds the manifest, and
        renames it to `step_<step>` (an existing one is swapped out, then removed)."""
        final = self.path(step)
        tmp = f"{final}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        try:
            write_files(tmp)
            files = {name: {"bytes": os.path.getsize(os.path.join(tmp, name)),
                            "sha256": sha256_of(os.path.join(tmp, name))}
                     for name in sorted(os.listdir(tmp))}
            write_json_file(os.path.join(tmp, MANIFEST), {"format": 1, "step": step, "files": files})
            _fsync_tree(tmp)
            if os.path.exists(final):  # a resumed run reaching this step again
                old = f"{final}.old-{os.getpid()}"
                os.replace(final, old)
                os.replace(tmp, final)
                shutil.rmtree(old)
            else:
                os.replace(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return final

    def mark_latest(self, step: int | None) -> None:
        """`latest.json` names checkpoint `step` (None: no committed checkpoint, no file).
        One caller: drafter rank 0, once the dispatcher confirmed that step is the ledger's
        last commit."""
        path = os.path.join(self.root, LATEST)
        if step is None:
            if os.path.exists(path):
                os.unlink(path)
            return
        write_json_file(path, {"step": step, "path": step_dir_name(step)})

    # --- reading ---------------------------------------------------------------------------

    def verify(self, step: int) -> dict:
        """Checks every file of checkpoint `step` against its manifest; returns the manifest."""
        return verify_dir(self.path(step))

    def latest(self) -> str | None:
        """The newest committed checkpoint directory (latest.json), or None."""
        path = os.path.join(self.root, LATEST)
        if not os.path.exists(path):
            return None
        record = read_json_file(path, "latest.json")
        name = record.get("path")
        if not isinstance(name, str) or not _STEP_DIR.match(name):
            raise DamagedCheckpointError(f"{path}: 'path' must name a step_NNNNNNNN directory, got {name!r:.60}")
        if not os.path.isdir(os.path.join(self.root, name)):
            # Set aside as never committed (quarantine_after) before the group resumed and
            # pointed latest.json at its last commit.
            raise DamagedCheckpointError(f"{path}: names {name}, which is not in {self.root} (set aside under "
                                         f"{UNCOMMITTED}/, or removed); resuming the job points it at the last "
                                         f"committed checkpoint, or name a step directory instead")
        return os.path.join(self.root, name)

    def steps_on_disk(self) -> list[int]:
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return []
        return sorted(step for n in names if (step := step_of_dir_name(n)) is not None)

    def newest_intact(self, candidates: list[int]) -> int:
        """The newest of `candidates` (committed steps) whose files verify; -1 if none."""
        for step in sorted(candidates, reverse=True):
            try:
                self.verify(step)
                return step
            except DamagedCheckpointError as exc:
                log.error("checkpoint of step %d is damaged, not resumed from: %s", step, exc)
        return -1

    # --- retention ---------------------------------------------------------------------------

    def latest_step(self) -> int | None:
        """The step latest.json names, or None (no latest.json)."""
        path = self.latest()
        return None if path is None else step_of_dir_name(os.path.basename(path))

    def retain(self, committed_step: int, *, keep_last: int | None, best_step: int | None = None) -> list[int]:
        """Called once the commit of `committed_step` is durable: deletes the committed
        checkpoints (steps on disk up to `committed_step`) older than the newest `keep_last`
        (0 or None: keeps all). Never deleted, whatever `keep_last` says: `committed_step`
        (what a resume loads), the step latest.json names, any step newer than
        `committed_step` (written, its commit not yet answered) and `best_step` (the best by
        validation). A checkpoint being written is a `.tmp-<pid>` directory, never a step one.
        Returns the steps deleted."""
        if not keep_last:
            return []
        committed = [s for s in self.steps_on_disk() if s <= committed_step]
        keep = set(committed[-keep_last:]) | {committed_step}
        keep |= {s for s in (self.latest_step(), best_step) if s is not None}
        removed = []
        for step in committed:
            if step in keep:
                continue
            # Renamed aside first: a reader never sees a half-deleted step directory, and a
            # kill during the rmtree leaves a `.deleted-<pid>` that `remove_partial_writes` clears.
            aside = f"{self.path(step)}.deleted-{os.getpid()}"
            os.replace(self.path(step), aside)
            shutil.rmtree(aside)
            removed.append(step)
        if removed:
            log.info("checkpoint.keep_last=%d: deleted the checkpoints of steps %s (kept %s)", keep_last,
                     ", ".join(map(str, removed)), ", ".join(map(str, sorted(s for s in keep if s in committed))))
        return removed

    # --- uncommitted checkpoints -------------------------------------------------------------

    def remove_partial_writes(self) -> list[str]:
        """What a writer killed inside `write` or `retain` left (`step_N.tmp-<pid>`, `.old-<pid>`,
        `.deleted-<pid>` of a pid no longer alive; a checkpoint's size each): a temp or deleted
        directory is removed; an `.old`
        one whose step directory is missing goes back (the kill fell between the two renames, and
        the old one may be the committed one). Returns what was removed or restored."""
        try:
            names = sorted(os.listdir(self.root))
        except FileNotFoundError:
            return []
        done = []
        for name in names:
            match = _PARTIAL_WRITE.match(name)
            if match is None or psutil.pid_exists(int(match.group(3))):  # a writer that runs: not ours
                continue
            path, final = os.path.join(self.root, name), os.path.join(self.root, match.group(1))
            if match.group(2) == "old" and not os.path.exists(final):
                os.replace(path, final)
                log.warning("checkpoint %s: restored from %s, left by a writer killed mid-swap", final, name)
            else:
                shutil.rmtree(path, ignore_errors=True)
                log.warning("removed %s, left by a checkpoint writer killed mid-write", path)
            done.append(path)
        return done

    def quarantine_after(self, step: int | None) -> list[str]:
        """Moves every checkpoint newer than committed `step` (None: all) to `uncommitted/`:
        written, but its commit never reached the ledger. Returns the new paths. Partial
        writes of killed writers go first (`remove_partial_writes`). latest.json is left to
        its one writer (drafter rank 0, when the group resumes)."""
        self.remove_partial_writes()
        moved = []
        for s in self.steps_on_disk():
            if step is None or s > step:
                dst_dir = os.path.join(self.root, UNCOMMITTED)
                os.makedirs(dst_dir, exist_ok=True)
                dst = os.path.join(dst_dir, f"{step_dir_name(s)}-{time.strftime('%Y%m%d-%H%M%S')}")
                os.replace(self.path(s), dst)
                moved.append(dst)
                log.warning("checkpoint of step %d was never committed: moved to %s (never resumed from)", s, dst)
        return moved

    def uncommitted(self) -> list[str]:
        """Checkpoints set aside as never committed."""
        folder = os.path.join(self.root, UNCOMMITTED)
        return sorted(os.path.join(folder, n) for n in os.listdir(folder)) if os.path.isdir(folder) else []


def verify_dir(step_dir: str) -> dict:
    """Checks every file of a checkpoint directory against its manifest."""
    manifest = read_json_file(os.path.join(step_dir, MANIFEST), "manifest")
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        raise DamagedCheckpointError(f"{step_dir}/{MANIFEST}: no 'files'")
    unlisted = [name for name in CHECKPOINT_FILES if name not in files]
    if unlisted:  # a file read on resume or export that no checksum covers
        raise DamagedCheckpointError(f"{step_dir}/{MANIFEST}: does not list {', '.join(unlisted)}")
    for name, want in files.items():
        path = os.path.join(step_dir, name)
        if os.path.basename(name) != name or not isinstance(want, dict):
            raise DamagedCheckpointError(f"{step_dir}/{MANIFEST}: bad entry {name!r:.60}")
        try:  # a FIFO or /dev/zero would hang the checksum below; a symlink out reads another's file
            size = regular_file(path, "a checkpoint file", error=DamagedCheckpointError, inside=step_dir)
        except OSError:
            raise DamagedCheckpointError(f"{path}: missing (listed in the manifest)") from None
        if size != want.get("bytes"):
            raise DamagedCheckpointError(f"{path}: {size} bytes, the manifest says {want.get('bytes')} (truncated?)")
        if sha256_of(path) != want.get("sha256"):
            raise DamagedCheckpointError(f"{path}: checksum differs from the manifest (damaged)")
    return manifest


def write_json_file(path: str, value: dict) -> None:
    """A checkpoint's JSON: on disk before it is renamed into place."""
    write_json_atomic(path, value, fsync=True)


def _fsync_tree(directory: str) -> None:
    for name in os.listdir(directory):
        with open(os.path.join(directory, name), "rb") as f:
            os.fsync(f.fileno())
