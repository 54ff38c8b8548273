"""Reads back what W&B wrote in offline mode: `wandb/offline-run-*/run-<id>.wandb`.

The file is W&B's record log (a LevelDB-style log: a 7-byte header `:W&B` + magic + version,
then 32 KiB blocks of records, each with a 7-byte header crc32 / length / type, a record split
over blocks as FIRST, MIDDLE..., LAST) of protobuf `Record`s. The wandb package of this version
has no Python reader of its own (its core is a Go binary), so the tests read it here.
"""

import glob
import json
import os
import struct

BLOCK = 32 * 1024
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def _records(path: str) -> list[bytes]:
    data = open(path, "rb").read()
    assert data[:4] == b":W&B", path
    out, pending, pos = [], b"", HEADER
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:  # the rest of a block too small for a header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        if kind == 0:  # zero padding up to the block end
            pos += left
            continue
        pending += data[pos + HEADER:pos + HEADER + length]
        pos += HEADER + length
        if kind in (FULL, LAST):
            out.append(pending)
            pending = b""
    return out


def read_offline_run(run_dir: str) -> dict:
    """{"id", "project", "name", "tags", "config": {...}, "history": [{key: value, "_step": n}, ...]}
    of one offline run directory."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = glob.glob(os.path.join(run_dir, "run-*.wandb"))
    run: dict = {"history": []}
    for blob in _records(path):
        record = pb.Record()
        record.ParseFromString(blob)
        kind = record.WhichOneof("record_type")
        if kind == "run":
            r = record.run
            run.update(id=r.run_id, project=r.project, name=r.display_name, tags=list(r.tags),
                       config={i.key: json.loads(i.value_json) for i in r.config.update})
        elif kind == "history":
            row = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in record.history.item}
            run["history"].append(row)
    return run


def offline_runs(wandb_dir: str) -> list[dict]:
    """Every offline run under `wandb_dir` (RUN_DIR/wandb), oldest first."""
    return [read_offline_run(d) for d in sorted(glob.glob(os.path.join(wandb_dir, "offline-run-*")))]
