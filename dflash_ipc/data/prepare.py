"""`dflash-ipc prepare`: chat data -> tokenized, loss-masked, memory-mapped dataset.

Run manual:
    report = prepare_dataset("models/Qwen3-8B", "chats.jsonl", "data/chats",
                             max_length=4096, num_workers=8)
The input is any form `data/reader.py` reads (JSONL, a JSON array, Parquet, a `datasets`
save_to_disk directory, a directory of Parquet/JSON shards); each row is one of
    {"messages": [{"role": ..., "content": ...}, ...]}           (OpenAI, see messages.py)
    {"conversations": [{"from": ..., "value": ...}, ...]}          (ShareGPT)
    {"input_ids": [int, ...], "loss_mask": [0/1, ...]}             (pre-tokenized)
Conversations are rendered with the target's own chat template (with `template_kwargs`,
the ones the replies were generated with); the loss mask covers the assistant's tokens (see
`chat.py`). Samples longer than max_length are cut to max_length (on_long="truncate") or
rejected (on_long="reject"); a sample is also rejected as too_long when truncation leaves no
two consecutive trained tokens (the drafter needs an anchor with a following target token).
`last_turn_only` trains on the last assistant turn (for pre-tokenized rows: the last run of
masked tokens). Samples with the same tokens as an earlier one are counted as duplicates
(dropped with dedup=True). `held_out=N` keeps the last N usable conversations out of the
dataset and records their prompts in meta.json for `dflash-ipc eval` (see held_out.py).

Every row is isolated: whatever goes wrong on it (bad JSON, a row over the byte limit, a
template error, any exception) makes it a reject with its index, place and reason, never a
stopped run. The input is streamed in chunks of rows; with num_workers > 1 the chunks are
encoded by a forkserver pool with a bounded number of chunks in flight and written back in
input order, so the output is byte-identical for any num_workers. Rejects are counted by
reason and written to rejects.jsonl inside the dataset (index, place, reason, detail, the
row's head); strict=True stops at the first one. Output appears at out_dir only when
complete (see dataset.py). As with any multiprocessing pool, a script that calls this with
num_workers > 1 needs an `if __name__ == "__main__":` guard.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import json
import logging
import multiprocessing
import os
import time
from dataclasses import dataclass, field

import numpy as np

from dflash_ipc.data.chat import ChatEncoder, keep_last_run
from dflash_ipc.data.messages import RowRejected, parse_conversation
from dflash_ipc.data.dataset import DatasetWriter, check_out_dir, tokenizer_fingerprint
from dflash_ipc.data.held_out import HeldOut
from dflash_ipc.obs.progress import ProgressLine, eta
from dflash_ipc.data.reader import MAX_ROW_BYTES, InputSource, RawRow, decode_row
from dflash_ipc.errors import ConfigError, DataError

log = logging.getLogger(__name__)

ON_LONG = ("truncate", "reject")
# A share of unknown tokens above this says the tokenizer does not fit the text (a wrong --model,
# a word-level tokenizer on another language): warned about, with the share, in the report.
UNK_WARN_SHARE = 0.05
REJECTS_FILE = "rejects.jsonl"
CHUNK_LINES = 64
_RAW_KEEP_CHARS = 2000
_DETAIL_CHARS = 500


@dataclass
class PrepareReport:
    """What a prepare did; also logged and stored (counts) in meta.json's source."""

    num_rows: int
    num_samples: int
    num_rejected: int
    rejects_by_reason: dict = field(default_factory=dict)
    rejects_path: str | None = None
    seconds: float = 0.0
    samples_per_s: float = 0.0
    out_dir: str = ""
    num_truncated: int = 0
    num_duplicates: int = 0
    num_held_out: int = 0
    unk_share: float | None = None  # tokens of the samples that are the tokenizer's unk token (None: it has none)
    warnings: list = field(default_factory=list)  # sentences a user should read once (side files, unk share)

    def summary(self) -> str:
        """One line for the command line."""
        return (f"{self.num_samples} samples written to {self.out_dir} from {self.num_rows} rows: "
                f"{self.num_rejected} rejected {self.rejects_by_reason}, {self.num_truncated} truncated, "
                f"{self.num_duplicates} duplicates, {self.num_held_out} held out; {self.seconds:.1f}s, "
                f"{self.samples_per_s:,.0f} samples/s")


@dataclass(frozen=True, slots=True)
class _Options:
    max_length: int
    last_turn_only: bool
    on_long: str
    max_row_bytes: int = MAX_ROW_BYTES
    template_kwargs: tuple = ()  # sorted (key, value) pairs: hashable, picklable


@dataclass(slots=True)
class _RowResult:
    index: int
    where: str
    line: int | None
    input_ids: np.ndarray | None = None  # int32 [L]
    loss_mask: np.ndarray | None = None  # uint8 [L]
    truncated: bool = False
    reason: str | None = None
    detail: str = ""
    raw: str = ""


class RowEncoder:
    """Turns one raw row into (ids, mask) or a rejection; pure, so it runs the same in the
    main process and in pool workers."""

    def __init__(self, tokenizer, *, max_length: int, last_turn_only: bool = False, on_long: str = "truncate",
                 max_row_bytes: int = MAX_ROW_BYTES, template_kwargs: dict | None = None):
        self.tokenizer = tokenizer
        self.options = _Options(max_length, last_turn_only, on_long, max_row_bytes,
                                tuple(sorted((template_kwargs or {}).items())))
        self._vocab_limit = len(tokenizer)
        self._chat: ChatEncoder | None = None  # built at the first conversation row

    def encode_row(self, row: RawRow) -> _RowResult:
        """Encode one row; bad rows come back with reason set, never raise (but Ctrl-C)."""
        try:
            ids, mask = self._encode(decode_row(row, self.options.max_row_bytes))
            ids, mask, truncated = self._fit(ids, mask)
        except RowRejected as e:
            return _RowResult(row.index, row.where, row.line, reason=e.reason, detail=e.detail[:_DETAIL_CHARS],
                              raw=row.text(_RAW_KEEP_CHARS))
        except Exception as e:  # anything else is this row's problem, not the run's
            return _RowResult(row.index, row.where, row.line, reason="row_error",
                              detail=f"{type(e).__name__}: {e}"[:_DETAIL_CHARS], raw=row.text(_RAW_KEEP_CHARS))
        return _RowResult(row.index, row.where, row.line, ids, mask, truncated)

    def _encode(self, row: dict) -> tuple[np.ndarray, np.ndarray]:
        if row.get("input_ids") is not None or row.get("loss_mask") is not None:
            return self._pretokenized(row)
        conv = parse_conversation(row)
        if self._chat is None:
            self._chat = ChatEncoder(self.tokenizer, template_kwargs=dict(self.options.template_kwargs))
        # One token past max_length tells a long sample from one that fits.
        enc = self._chat.encode(conv, last_turn_only=self.options.last_turn_only, max_tokens=self.options.max_length + 1)
        return np.asarray(enc.input_ids, np.int32), np.asarray(enc.loss_mask, np.uint8)

    def _pretokenized(self, row: dict) -> tuple[np.ndarray, np.ndarray]:
        ids, mask = row.get("input_ids"), row.get("loss_mask")
        if not isinstance(ids, list) or not ids or not all(type(x) is int for x in ids):
            raise RowRejected("bad_tokens", "input_ids must be a non-empty list of integers")
        if not isinstance(mask, list) or len(mask) != len(ids):
            got = len(mask) if isinstance(mask, list) else type(mask).__name__
            raise RowRejected("bad_tokens", f"loss_mask must be a list as long as input_ids ({len(ids)}), got {got}")
        if not all(x in (0, 1) and type(x) in (int, bool) for x in mask):
            raise RowRejected("bad_tokens", "loss_mask values must be 0/1 or true/false")
        lo, hi = min(ids), max(ids)
        if lo < 0 or hi >= self._vocab_limit:
            raise RowRejected("bad_tokens", f"token ids span [{lo}, {hi}]; the tokenizer has ids [0, {self._vocab_limit})")
        mask = [int(x) for x in mask]
        if self.options.last_turn_only:
            mask = keep_last_run(mask)
        return np.asarray(ids, np.int32), np.asarray(mask, np.uint8)

    def _fit(self, ids: np.ndarray, mask: np.ndarray) -> tuple[np.ndarray, np.ndarray, bool]:
        """Apply max_length / on_long, then require an anchor: two consecutive trained tokens."""
        limit = self.options.max_length
        truncated = ids.size > limit
        if truncated:
            if self.options.on_long == "reject":
                raise RowRejected("too_long", f"{ids.size} tokens > max_length {limit} (on_long=reject)")
            ids, mask = ids[:limit], mask[:limit]
        if not (mask[:-1] & mask[1:]).any():
            if truncated:
                raise RowRejected("too_long", f"no trained token pair left within max_length {limit}")
            raise RowRejected("no_loss_tokens", f"the loss mask has no two consecutive trained tokens ({int(mask.sum())} trained)")
        return ids, mask, truncated


# --- pool workers --------------------------------------------------------------------
_WORKER_ENCODER: RowEncoder | None = None


def _init_worker(model_dir: str, options: _Options) -> None:
    global _WORKER_ENCODER
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    _WORKER_ENCODER = RowEncoder(load_tokenizer(model_dir), max_length=options.max_length,
                                 last_turn_only=options.last_turn_only, on_long=options.on_long,
                                 max_row_bytes=options.max_row_bytes, template_kwargs=dict(options.template_kwargs))


def _encode_chunk(chunk: list[RawRow]) -> list[_RowResult]:
    assert _WORKER_ENCODER is not None, "pool worker not initialised"
    return [_WORKER_ENCODER.encode_row(row) for row in chunk]


def check_model_dir(model_dir: str) -> None:
    """DataError when model_dir is no directory; cheap, so commands call it before they
    import transformers (seconds) to answer a mistyped path at once."""
    if not os.path.isdir(model_dir):
        raise DataError(f"{model_dir}: no such model directory (give the local directory of the target's "
                        "tokenizer and chat template, or its Hub id ORG/NAME)")


def load_tokenizer(model_dir: str):
    """The target's tokenizer from its local directory; DataError naming the directory when
    it is missing or holds no tokenizer (`prepare` resolves a Hub id first: hf/hub.py)."""
    check_model_dir(model_dir)
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except Exception as e:  # OSError, ValueError, and whatever a broken tokenizer file raises
        raise DataError(f"{model_dir}: cannot load a tokenizer ({type(e).__name__}: {str(e)[:300]})") from None


# --- reading ------------------------------------------------------------------------
def _chunks(source: InputSource, size: int = CHUNK_LINES):
    """Lists of up to `size` rows of the input."""
    chunk: list[RawRow] = []
    for row in source.rows():
        chunk.append(row)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _pool_context():
    """forkserver: workers fork from a clean server process, never from the caller, which
    may hold torch/tokenizer threads or CUDA state. Preloading the tokenizer machinery in
    the server makes worker start ~2x cheaper than spawn (measured: 3.0 s vs 7.4 s for 2
    workers on a loaded 2-core box)."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["transformers.models.auto.tokenization_auto", __name__])
    return ctx


def _encoded_chunks(source: InputSource, model_dir: str, encoder: RowEncoder, num_workers: int):
    """Yield each chunk's results in input order; at most 4 chunks per worker in flight."""
    if num_workers <= 1:
        for chunk in _chunks(source):
            yield [encoder.encode_row(row) for row in chunk]
        return
    with _pool_context().Pool(num_workers, initializer=_init_worker, initargs=(model_dir, encoder.options)) as pool:
        pending: collections.deque = collections.deque()
        for chunk in _chunks(source):
            pending.append(pool.apply_async(_encode_chunk, (chunk,)))
            if len(pending) >= 4 * num_workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


# --- writing ------------------------------------------------------------------------
def _sample_key(ids: np.ndarray, mask: np.ndarray) -> int:
    h = hashlib.blake2b(ids.tobytes(), digest_size=8)
    h.update(mask.tobytes())
    return int.from_bytes(h.digest(), "little")


class _Sink:
    """Takes encoded rows in input order: samples to the writer (through the held-out
    choice), rejects to rejects.jsonl, counts to the tally."""

    def __init__(self, writer: DatasetWriter, rejects, source: InputSource, *, strict: bool, dedup: bool,
                 held_out: int, unk_id: int | None = None, unk_token: str | None = None):
        self.writer = writer
        self.source = source
        self.rejects = rejects
        self.strict = strict
        self.dedup = dedup
        self.held = HeldOut(held_out)
        self.counts: collections.Counter = collections.Counter()
        self.num_samples = 0
        self.num_truncated = 0
        self.num_duplicates = 0
        self.first_rejects: list[str] = []
        self.unk_id = unk_id
        self.unk_token = unk_token
        self.num_tokens = 0
        self.num_unk = 0
        self._keys: dict[int, int] = {}  # sample key -> index of its first row

    @property
    def num_rejected(self) -> int:
        """Rejected rows, all reasons."""
        return sum(self.counts.values())

    def add(self, r: _RowResult) -> None:
        if r.reason is None:
            self.num_tokens += len(r.input_ids)
            if self.unk_id is not None:
                self.num_unk += int(np.count_nonzero(r.input_ids == self.unk_id))
            key = _sample_key(r.input_ids, r.loss_mask)
            first = self._keys.setdefault(key, r.index)
            if first != r.index:
                self.num_duplicates += 1
                if self.dedup:
                    r = _RowResult(r.index, r.where, r.line, reason="duplicate",
                                   detail=f"the same tokens as row {first} (--dedup)", raw="")
            if r.reason is None:
                for sample in self.held.offer(r, r.input_ids, r.loss_mask):
                    self._write(sample)
                return
        if self.strict:
            raise DataError(f"{r.where}: {r.reason}: {r.detail} (strict mode)")
        self.counts[r.reason] += 1
        if len(self.first_rejects) < 3:
            self.first_rejects.append(f"{self._short(r)}: {r.reason}: {r.detail}")
        record = {"index": r.index, "where": r.where, "reason": r.reason, "detail": r.detail, "raw": r.raw}
        if r.line is not None:
            record["line"] = r.line
        self.rejects.write(json.dumps(record, ensure_ascii=False) + "\n")

    def _short(self, r: _RowResult) -> str:
        """`line 12` in a single file; a shard's place relative to the input directory."""
        if self.source.kind == "file":
            return f"line {r.line}" if r.line is not None else f"row {r.index}"
        return os.path.relpath(r.where, self.source.path) if r.where.startswith(self.source.path) else r.where

    def _write(self, r: _RowResult) -> None:
        self.writer.add(r.input_ids, r.loss_mask)
        self.num_samples += 1
        self.num_truncated += int(r.truncated)

    def held_out_records(self) -> list[dict]:
        """meta.json's extra.held_out: the held-out rows' indices and prompt ids."""
        return [{"sample_id": r.index, "prompt_ids": prompt.astype(int).tolist()} for r, prompt in self.held.held()]


def _progress_line(source: InputSource, sink: _Sink, bar: ProgressLine, total_rows: int | None = None) -> str:
    """Rows, samples and rate; the share done and the ETA at the rate so far, by bytes for
    files, by rows for a datasets directory (`total_rows`), none for a pipe."""
    elapsed = max(bar.elapsed_s, 1e-9)
    if source.total_bytes:
        done = f"{100.0 * source.bytes_read / source.total_bytes:5.1f}% "
        left = f", {eta(source.bytes_read, source.total_bytes, source.bytes_read / elapsed)}"
    elif total_rows:
        done = f"{100.0 * source.num_rows / total_rows:5.1f}% "
        left = f", {eta(source.num_rows, total_rows, source.num_rows / elapsed)}"
    else:
        done = left = ""
    return (f"prepare: {done}{source.num_rows} rows, {sink.num_samples} samples, {sink.num_rejected} rejected, "
            f"{sink.num_samples / elapsed:.0f} samples/s{left}")


def _write_rows(sink: _Sink, source: InputSource, chunks, bar: ProgressLine) -> None:
    total_rows = source.estimated_rows() if source.kind == "arrow_dataset" and bar.enabled else None
    for results in chunks:
        for r in results:
            sink.add(r)
        bar.show(_progress_line(source, sink, bar, total_rows))
    bar.show(_progress_line(source, sink, bar, total_rows), final=True)


# --- entry point --------------------------------------------------------------------
def _check_options(max_length: int, on_long: str, num_workers: int, held_out: int) -> None:
    if on_long not in ON_LONG:
        raise ConfigError(f"on_long={on_long!r}; allowed: {list(ON_LONG)}")
    if max_length < 2:
        raise ConfigError(f"max_length={max_length}; must be >= 2")
    if num_workers < 1:
        raise ConfigError(f"num_workers={num_workers}; must be >= 1")
    if held_out < 0:
        raise ConfigError(f"held_out={held_out}; must be >= 0")


def prepare_dataset(
    model_dir: str,
    input_path: str,
    out_dir: str,
    *,
    max_length: int = 4096,
    last_turn_only: bool = False,
    num_workers: int = 1,
    strict: bool = False,
    on_long: str = "truncate",
    overwrite: bool = False,
    progress: bool = True,
    extra_meta: dict | None = None,
    split: str | None = None,
    max_line_bytes: int = MAX_ROW_BYTES,
    template_kwargs: dict | None = None,
    held_out: int = 0,
    dedup: bool = False,
) -> PrepareReport:
    """Tokenize input_path (see data/reader.py) with model_dir's tokenizer into the dataset out_dir.

    Raises DataError for an unreadable or empty input, a missing model directory, an
    unwritable or existing out_dir (without overwrite), a strict-mode bad row (its place
    named), or when no row is usable; ConfigError for bad options.
    """
    _check_options(max_length, on_long, num_workers, held_out)
    if held_out and extra_meta and "held_out" in extra_meta:
        raise ConfigError("held_out: given both as an option and in extra_meta")
    source = InputSource(input_path, split=split, max_row_bytes=max_line_bytes)
    # The cheap refusals first: loading a tokenizer imports transformers and torch (seconds).
    check_model_dir(model_dir)
    check_out_dir(out_dir, overwrite)
    tokenizer = load_tokenizer(model_dir)
    encoder = RowEncoder(tokenizer, max_length=max_length, last_turn_only=last_turn_only, on_long=on_long,
                         max_row_bytes=max_line_bytes, template_kwargs=template_kwargs)
    meta_source = {"input": os.path.abspath(input_path), "model_dir": os.path.abspath(model_dir), "split": split,
                   "max_length": max_length, "last_turn_only": last_turn_only, "on_long": on_long,
                   "template_kwargs": dict(template_kwargs or {}), "dedup": dedup, "held_out": held_out}
    with DatasetWriter(out_dir, tokenizer_fingerprint=tokenizer_fingerprint(tokenizer), overwrite=overwrite,
                       max_length=max_length, source=meta_source, extra=extra_meta) as writer:
        with open(writer.aux_path(REJECTS_FILE), "w") as rejects:
            sink = _Sink(writer, rejects, source, strict=strict, dedup=dedup, held_out=held_out,
                         unk_id=tokenizer.unk_token_id, unk_token=tokenizer.unk_token)
            # closing(): a strict-mode stop or Ctrl-C shuts the pool down now, not at garbage collection.
            with contextlib.closing(_encoded_chunks(source, model_dir, encoder, num_workers)) as chunks:
                _write_rows(sink, source, chunks, ProgressLine(progress))
        _check_usable(input_path, source, sink, held_out)
        if held_out:
            writer.extra["held_out"] = sink.held_out_records()
        writer.source.update(input_sha256=source.sha256.hexdigest(), num_rows=source.num_rows,
                             num_rejected=sink.num_rejected, num_truncated=sink.num_truncated,
                             num_duplicates=sink.num_duplicates, rejects_by_reason=dict(sorted(sink.counts.items())))
        writer.close()
    return _report(input_path, writer, source, sink, held_out)


def _check_usable(input_path: str, source: InputSource, sink: _Sink, held_out: int) -> None:
    if source.num_rows == 0:
        raise DataError(f"{input_path}: the input is empty (no rows)")
    if sink.num_samples == 0:
        kept = f" and {len(sink.held.held())} held out (--held-out {held_out})" if held_out else ""
        raise DataError(f"{input_path}: no usable rows ({source.num_rows} rows{kept}; rejected by reason: "
                        f"{dict(sink.counts)}; first: {sink.first_rejects})")
    if held_out and len(sink.held.held()) < held_out:
        raise DataError(f"{input_path}: --held-out {held_out}, but only {len(sink.held.held())} conversations "
                        "qualify (usable, with a prompt no other row has)")


def _report(input_path: str, writer: DatasetWriter, source: InputSource, sink: _Sink, held_out: int) -> PrepareReport:
    seconds = time.monotonic() - writer.started
    report = PrepareReport(
        num_rows=source.num_rows, num_samples=sink.num_samples, num_rejected=sink.num_rejected,
        rejects_by_reason=dict(sorted(sink.counts.items())), rejects_path=os.path.join(writer.out_dir, REJECTS_FILE),
        seconds=seconds, samples_per_s=sink.num_samples / max(seconds, 1e-9), out_dir=writer.out_dir,
        num_truncated=sink.num_truncated, num_duplicates=sink.num_duplicates, num_held_out=held_out,
        unk_share=sink.num_unk / sink.num_tokens if sink.unk_id is not None and sink.num_tokens else None,
        warnings=source.notes(),
    )
    if report.unk_share is not None and report.unk_share > UNK_WARN_SHARE:
        report.warnings.append(
            f"{100 * report.unk_share:.1f}% of the {sink.num_tokens:,} tokens are the tokenizer's unknown token "
            f"{sink.unk_token!r} (above {100 * UNK_WARN_SHARE:.0f}%): the tokenizer does not cover this text, and "
            "a drafter trained on it learns to predict that token; check that --model is the target the data is for")
    log.info("prepare %s -> %s", input_path, report.summary())
    return report
