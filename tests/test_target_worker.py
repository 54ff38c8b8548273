"""The target worker's batch assembly: token ids outside the target's vocabulary (a damaged or
crafted tokens.bin) are a clear DataError, never an index error or a device-side assert."""

import types

import numpy as np
import pytest
import torch

from dflash_ipc.data.dataset import DatasetWriter, TokenDataset
from dflash_ipc.errors import DataError
from dflash_ipc.target.worker import TargetWorker


def test_token_ids_outside_the_vocabulary_are_named(tmp_path):
    with DatasetWriter(str(tmp_path / "data"), tokenizer_fingerprint="sha256:test") as writer:
        for ids in ([1, 2, 3], [4, 5], [6, 7, 8, 9]):
            writer.add(ids, [1] * len(ids))
        writer.close()
    tokens = np.memmap(tmp_path / "data" / "tokens.bin", dtype=np.int32, mode="r+")
    tokens[6] = 50_000  # sample 2, as a bit flip or an edit would leave it
    tokens.flush()
    capture = types.SimpleNamespace(device=torch.device("cpu"), vocab_size=64)
    worker = TargetWorker(capture, TokenDataset(str(tmp_path / "data")), pool=None)
    ids, lengths = worker.batch_tokens([0, 1], padded_len=4)
    assert ids.tolist() == [[1, 2, 3, 0], [4, 5, 0, 0]] and lengths.tolist() == [3, 2]
    with pytest.raises(DataError, match=r"data: sample 2 holds token ids outside \[0, 64\), the target's vocab"):
        worker.batch_tokens([0, 2], padded_len=4)
