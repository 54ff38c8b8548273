"""The prepared dataset on disk: memory-mapped tokens and loss masks, an index, metadata.

Layout of a dataset directory (FORMAT_VERSION 1):
  tokens.bin     int32, all samples back to back
  loss_mask.bin  uint8 (0/1), aligned with tokens.bin
  index.npy      int64 [N, 2]: (offset, length) of each sample, in tokens
  meta.json      format_version, num_samples, num_tokens, num_loss_tokens, max_length,
                 max_sample_length, length_histogram, tokenizer_fingerprint, source,
                 created_at, extra, complete: true
  rejects.jsonl  (written by prepare) rows that were skipped, with line numbers

Completeness: `DatasetWriter` fills "<out>.partial-<pid>" and renames it to <out> only in
close(), after meta.json (with complete: true) is written and everything is fsynced. A
prepare that dies leaves at most a ".partial-<pid>" directory, which `TokenDataset`
refuses (no meta.json), and never touches an existing <out> before the final rename.

Opening is cheap (three memory maps and a small JSON), so every worker process opens its
own `TokenDataset`; the dispatcher plans from `lengths` alone.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time

import numpy as np

from dflash_ipc.errors import DataError
from dflash_ipc.run.json_files import read_json_object
from dflash_ipc.run.regular_file import regular_file

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
TOKENS_FILE = "tokens.bin"
_CHECK_CHUNK = 1 << 24  # tokens per chunk of check_token_ids: 64 MiB of int32
MASK_FILE = "loss_mask.bin"
INDEX_FILE = "index.npy"
META_FILE = "meta.json"
_FLUSH_TOKENS = 1 << 20


def tokenizer_fingerprint(tokenizer) -> str:
    """Stable hash of what decides token ids: vocabulary (with added tokens), special
    tokens and chat template. Independent of the tokenizer class, so the same files
    loaded by different transformers versions give the same fingerprint."""
    specials = {
        name: getattr(tokenizer, name, None)
        for name in ("bos_token", "eos_token", "pad_token", "unk_token", "mask_token")
    }
    payload = {
        "vocab": sorted(tokenizer.get_vocab().items()),
        "special_tokens": sorted(set(tokenizer.all_special_tokens)),
        "named_special_tokens": {k: (str(v) if v is not None else None) for k, v in specials.items()},
        "chat_template": tokenizer.chat_template,
    }
    blob = json.dumps(payload, sort_keys=True, ensure_ascii=False, default=str).encode()
    return "sha256:" + hashlib.sha256(blob).hexdigest()[:32]


def length_histogram(lengths: np.ndarray) -> dict:
    """Power-of-two histogram: counts[i] = #samples with edges[i] <= length < edges[i+1]."""
    lengths = np.asarray(lengths, dtype=np.int64)
    top = int(lengths.max()) if lengths.size else 1
    edges = [1 << k for k in range(max(1, top.bit_length()) + 1)]
    counts, _ = np.histogram(lengths, bins=np.asarray(edges))
    # np.histogram closes the last bin on the right; top < edges[-1], so nothing is lost.
    return {"edges": edges, "counts": counts.tolist()}


def dataset_is_complete(path: str) -> bool:
    """True when path holds a finished dataset of this format version."""
    try:
        meta = read_json_object(os.path.join(path, META_FILE), "dataset metadata")
    except DataError:
        return False
    return meta.get("complete") is True and meta.get("format_version") == FORMAT_VERSION


class TokenDataset:
    """A prepared dataset, read-only and memory-mapped.

    lengths: int32 [N]; sample(i) -> (input_ids int32 [L], loss_mask bool [L]) as copies
    (writable, so torch.from_numpy works on them and the maps stay untouched).
    """

    def __init__(self, path: str):
        self.path = os.path.abspath(path)
        self.meta = self._read_meta()
        n, num_tokens = self.meta["num_samples"], self.meta["num_tokens"]
        self._index = self._read_index(n, num_tokens)
        self._tokens = self._map(TOKENS_FILE, np.int32, num_tokens)
        self._mask = self._map(MASK_FILE, np.uint8, num_tokens)
        self.lengths = np.ascontiguousarray(self._index[:, 1], dtype=np.int32)  # [N]
        self.offsets = np.ascontiguousarray(self._index[:, 0], dtype=np.int64)  # [N]

    def _read_meta(self) -> dict:
        meta_path = os.path.join(self.path, META_FILE)
        if not os.path.isdir(self.path):
            raise DataError(f"{self.path}: no such dataset directory; run `dflash-ipc prepare` first")
        if not os.path.exists(meta_path):
            raise DataError(
                f"{meta_path}: missing; {self.path} is not a complete dataset (an interrupted prepare?)")
        meta = read_json_object(meta_path, "dataset metadata")
        if meta.get("format_version") != FORMAT_VERSION:
            raise DataError(
                f"{meta_path}: format_version={meta.get('format_version')!r:.40}, this code reads {FORMAT_VERSION}; "
                "re-run prepare"
            )
        if meta.get("complete") is not True:
            raise DataError(f"{meta_path}: complete is not true; the prepare that wrote it did not finish")
        for key in ("num_samples", "num_tokens"):
            value = meta.get(key)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 1 << 62:
                raise DataError(f"{meta_path}: field {key} must be an integer >= 0, got {value!r:.40}")
        if not isinstance(meta.get("tokenizer_fingerprint"), str):
            raise DataError(f"{meta_path}: field tokenizer_fingerprint must be a string")
        if not isinstance(meta.get("source", {}), dict):
            raise DataError(f"{meta_path}: field source must be an object")
        return meta

    def _read_index(self, n: int, num_tokens: int) -> np.ndarray:
        """index.npy as [n, 2] int64, every (offset, length) a non-empty span inside tokens.bin:
        a wrong entry would otherwise read another sample's tokens, or none, without a word."""
        index_path = os.path.join(self.path, INDEX_FILE)
        if not n:
            return np.zeros((0, 2), np.int64)
        try:
            regular_file(index_path, "the dataset index")  # a FIFO would block np.load forever
            index = np.load(index_path, mmap_mode="r", allow_pickle=False)
        except FileNotFoundError:
            raise DataError(f"{index_path}: missing; re-run prepare") from None
        except (OSError, ValueError, EOFError) as e:
            # numpy's own words for a pickle suggest loading it unsafely: never here.
            pickled = "pickle" in str(e) or "Python objects" in str(e)
            why = "not a plain numpy array: Python objects or a pickle, never loaded" if pickled else str(e)[:200]
            raise DataError(f"{index_path}: cannot read index ({why}); re-run prepare") from None
        if index.dtype != np.int64 or index.shape != (n, 2):
            raise DataError(f"{index_path}: {index.dtype} {index.shape}, meta.json says int64 ({n}, 2); re-run prepare")
        offsets, lengths = index[:, 0], index[:, 1]
        bad = (offsets < 0) | (lengths < 1) | (offsets > num_tokens - lengths)
        if bad.any():
            i = int(np.argmax(bad))
            raise DataError(f"{index_path}: sample {i} spans tokens [{int(offsets[i])}, +{int(lengths[i])}), "
                            f"outside the {num_tokens} tokens of {TOKENS_FILE}; re-run prepare")
        return index

    def _map(self, name: str, dtype, count: int) -> np.ndarray:
        file_path = os.path.join(self.path, name)
        want = count * np.dtype(dtype).itemsize
        try:
            size = regular_file(file_path, "a dataset file")
        except OSError as e:
            raise DataError(f"{file_path}: missing ({e}); re-run prepare") from e
        if size != want:
            raise DataError(f"{file_path}: {size} bytes, meta.json implies {want}; re-run prepare")
        if count == 0:
            return np.zeros(0, dtype)  # np.memmap cannot map an empty file
        return np.memmap(file_path, dtype=dtype, mode="r", shape=(count,))

    def __len__(self) -> int:
        return len(self.lengths)

    def sample(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """(input_ids int32 [L], loss_mask bool [L]) of sample i."""
        if not -len(self) <= i < len(self):
            raise IndexError(f"sample {i} out of range for {len(self)} samples in {self.path}")
        off, length = int(self.offsets[i]), int(self.lengths[i])
        ids = np.array(self._tokens[off : off + length], dtype=np.int32)  # [L]
        mask = np.array(self._mask[off : off + length], dtype=np.bool_)  # [L]
        return ids, mask

    def check_token_ids(self, vocab_size: int, *, source: str = "the target") -> None:
        """DataError unless every token id is in [0, vocab_size): checked once when the job starts
        (an id past the embedding would otherwise stop the job when its batch comes, hours in).
        A min and max over the map in chunks: a pass at memory speed, no copy of the file."""
        tokens = self._tokens
        for start in range(0, len(tokens), _CHECK_CHUNK):
            chunk = tokens[start:start + _CHECK_CHUNK]
            low, high = int(chunk.min()), int(chunk.max())
            if low >= 0 and high < vocab_size:
                continue
            at = start + int(np.argmax((chunk < 0) | (chunk >= vocab_size)))
            sample = int(np.searchsorted(self.offsets, at, side="right")) - 1
            raise DataError(f"{os.path.join(self.path, TOKENS_FILE)}: token {at} (of sample {sample}) is id "
                            f"{int(tokens[at])}, outside the vocabulary of {source} [0, {vocab_size}); the data "
                            "was not prepared for this target (or is damaged): re-run prepare with its tokenizer")

    def __reduce__(self):
        # Pickled as its path: a worker reopens the maps instead of receiving a copy of the data.
        return (TokenDataset, (self.path,))

    @property
    def tokenizer_fingerprint(self) -> str:
        """Fingerprint of the tokenizer the data was made with (see tokenizer_fingerprint())."""
        return self.meta["tokenizer_fingerprint"]

    def check_tokenizer(self, model_dir_or_tokenizer) -> None:
        """Raise DataError unless the target's tokenizer is the one this data was made with.

        Accepts a model directory (its tokenizer is loaded) or a tokenizer object.
        """
        if isinstance(model_dir_or_tokenizer, (str, os.PathLike)):
            from transformers import AutoTokenizer

            source = str(model_dir_or_tokenizer)
            tokenizer = AutoTokenizer.from_pretrained(source)
        else:
            tokenizer = model_dir_or_tokenizer
            source = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        theirs = tokenizer_fingerprint(tokenizer)
        if theirs != self.tokenizer_fingerprint:
            raise DataError(
                f"dataset {self.path} was tokenized with tokenizer {self.tokenizer_fingerprint} "
                f"(from {self.meta.get('source', {}).get('model_dir', '?')}), but the target {source} "
                f"has tokenizer {theirs}; re-run `dflash-ipc prepare --model {source}`"
            )


class DatasetWriter:
    """Appends samples to "<out>.partial-<pid>" and publishes it as <out> on close().

    Use as a context manager (an exception aborts and removes the partial directory) or
    call abort() yourself. `aux_path(name)` is a file inside the dataset that moves with it.
    `source` and `extra` (dicts) may be updated before close(); they go to meta.json.
    """

    def __init__(
        self,
        out_dir: str,
        *,
        tokenizer_fingerprint: str,
        overwrite: bool = False,
        max_length: int | None = None,
        source: dict | None = None,
        extra: dict | None = None,
    ):
        self.out_dir = os.path.abspath(out_dir.rstrip("/"))
        check_out_dir(self.out_dir, overwrite)
        self.partial_dir = f"{self.out_dir}.partial-{os.getpid()}"
        self.started = time.monotonic()
        _warn_stale_partials(self.out_dir)
        shutil.rmtree(self.partial_dir, ignore_errors=True)
        try:
            os.makedirs(self.partial_dir)
        except OSError as e:
            raise DataError(f"{self.out_dir}: cannot write the dataset there ({e.strerror}: "
                            f"{e.filename}); choose a writable output directory") from None
        self._fingerprint = tokenizer_fingerprint
        self._overwrite = overwrite
        self._max_length = max_length
        self.source = dict(source or {})
        self.extra = dict(extra or {})
        self._tokens = open(os.path.join(self.partial_dir, TOKENS_FILE), "wb")
        self._mask = open(os.path.join(self.partial_dir, MASK_FILE), "wb")
        self._index: list[tuple[int, int]] = []
        self._num_tokens = 0
        self._num_loss_tokens = 0
        self._closed = False

    def aux_path(self, name: str) -> str:
        """Path of an extra file inside the (partial, later final) dataset directory."""
        return os.path.join(self.partial_dir, name)

    def add(self, input_ids, loss_mask) -> None:
        """Append one sample. input_ids: ints [L]; loss_mask: bools/0-1 [L]."""
        ids = np.asarray(input_ids, dtype=np.int32)  # [L]
        mask = np.asarray(loss_mask).astype(np.uint8)  # [L]
        if ids.ndim != 1 or ids.shape != mask.shape or ids.size == 0:
            raise DataError(f"{self.partial_dir}: sample {len(self._index)}: ids {ids.shape} / mask {mask.shape} must be equal, 1-D, non-empty")
        self._tokens.write(ids.tobytes())
        self._mask.write(mask.tobytes())
        self._index.append((self._num_tokens, int(ids.size)))
        self._num_tokens += int(ids.size)
        self._num_loss_tokens += int(mask.sum())

    def close(self) -> dict:
        """Finish the files, write meta.json, rename to out_dir. Returns meta."""
        if self._closed:
            raise DataError(f"{self.out_dir}: writer already closed")
        index = np.asarray(self._index, dtype=np.int64).reshape(-1, 2)  # [N, 2]
        lengths = index[:, 1]
        meta = {
            "format_version": FORMAT_VERSION,
            "num_samples": int(len(index)),
            "num_tokens": self._num_tokens,
            "num_loss_tokens": self._num_loss_tokens,
            "max_length": self._max_length if self._max_length is not None else int(lengths.max(initial=0)),
            "max_sample_length": int(lengths.max(initial=0)),
            "length_histogram": length_histogram(lengths),
            "tokenizer_fingerprint": self._fingerprint,
            "source": self.source,
            "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "extra": self.extra,
            "complete": True,
        }
        for f in (self._tokens, self._mask):
            f.flush()
            os.fsync(f.fileno())
            f.close()
        with open(self.aux_path(INDEX_FILE), "wb") as f:
            np.save(f, index)
            f.flush()
            os.fsync(f.fileno())
        with open(self.aux_path(META_FILE), "w") as f:
            json.dump(meta, f, indent=2, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        self._publish()
        self._closed = True
        log.info("wrote dataset %s: %d samples, %d tokens", self.out_dir, meta["num_samples"], meta["num_tokens"])
        return meta

    def _publish(self) -> None:
        # Checked again: another prepare may have finished the same out_dir meanwhile.
        check_out_dir(self.out_dir, self._overwrite)
        old = None
        if os.path.exists(self.out_dir):
            old = f"{self.out_dir}.old-{os.getpid()}"
            os.rename(self.out_dir, old)
        os.rename(self.partial_dir, self.out_dir)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)

    def abort(self) -> None:
        """Drop everything written; out_dir is left as it was."""
        if self._closed:
            return
        for f in (self._tokens, self._mask):
            f.close()
        shutil.rmtree(self.partial_dir, ignore_errors=True)
        self._closed = True

    def __enter__(self) -> "DatasetWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
        elif not self._closed:
            self.abort()
            raise DataError(f"{self.out_dir}: DatasetWriter left without close(); nothing was written")


def check_out_dir(out_dir: str, overwrite: bool) -> None:
    """DataError unless out_dir may be written: an existing dataset only with overwrite, and
    never a directory that is not a dataset (a typo must not delete someone's files)."""
    if not os.path.exists(out_dir):
        return
    if not os.path.isdir(out_dir):
        raise DataError(f"{out_dir}: exists and is not a directory")
    if not os.listdir(out_dir):
        return  # an empty directory made beforehand (mkdir -p) holds nothing to lose
    if not overwrite:
        raise DataError(f"{out_dir}: already exists; --overwrite (overwrite=True) replaces it")
    if not os.path.exists(os.path.join(out_dir, META_FILE)):
        raise DataError(f"{out_dir}: exists, is not empty and holds no {META_FILE}; refusing to replace it")


def _warn_stale_partials(out_dir: str) -> None:
    """Leftovers of killed prepares are never read as data; say they can be deleted. Not
    deleted here: on a shared filesystem the pid may belong to a live process elsewhere."""
    parent, name = os.path.split(out_dir)
    try:
        stale = [n for n in os.listdir(parent or ".") if n.startswith(name + ".partial-")]
    except OSError:
        return
    if stale:
        log.warning("%s: leftovers of interrupted prepares, safe to delete once no prepare runs: %s",
                    parent, stale)
