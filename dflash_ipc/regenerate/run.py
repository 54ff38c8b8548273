"""The regeneration loop: input rows -> turns to replace -> backend -> output file.

Run manual:
    options = GenerationOptions(max_new_tokens=2048, template_kwargs={"enable_thinking": False})
    backend = HFBackend("models/Qwen3-8B", options, devices="cuda:0,cuda:1")
    try:
        report = regenerate("ultrachat/", "data/regen.jsonl", backend, options)
    finally:
        backend.close()
    print(report.summary())

One loop in this process: (1) read rows until `window` rows are in flight (rows already in
the output are skipped; a row that cannot be parsed or rendered is rejected with its index),
(2) poll the backend for replies, each of which moves its row to the next turn to replace or
finishes it, (3) write finished rows at once. With several turns per row, a row's next turn
goes back to the backend as soon as its reply arrives, so batches mix turns and rows.
Ctrl-C, SIGTERM (stop.py) or any error closes the output as partial: only the rows in flight
are lost, and a rerun of the same command resumes. A failed write of the output (a full disk:
output.OutputFailed) stops the run rather than rejecting its row: nothing more is appended.
"""

from __future__ import annotations

import collections
import itertools
import logging
import os
from dataclasses import dataclass, field

from dflash_ipc.data.messages import RowRejected, parse_conversation
from dflash_ipc.obs.progress import ProgressLine, eta
from dflash_ipc.data.reader import MAX_ROW_BYTES, InputSource, RawRow, decode_row
from dflash_ipc.errors import ConfigError, DataError
from dflash_ipc.hf.hub import resolve_dataset, resolve_model
from dflash_ipc.regenerate.conversation import Reply, RowState, assistant_message
from dflash_ipc.regenerate.options import GenerationOptions
from dflash_ipc.regenerate.output import OutputFailed, RegenOutput
from dflash_ipc.regenerate.stop import StopOnSigterm

log = logging.getLogger(__name__)

DEFAULT_WINDOW = 4096


@dataclass
class RegenerateReport:
    """What a run did."""

    out_path: str
    rejects_path: str
    complete: bool
    num_rows: int = 0  # input rows seen
    num_skipped: int = 0  # already in the output before this run
    num_written: int = 0
    num_rejected: int = 0
    rejects_by_reason: dict = field(default_factory=dict)
    num_replies: int = 0
    num_truncated: int = 0  # replies cut at max_new_tokens
    new_tokens: int = 0
    seconds: float = 0.0
    padding_share: float | None = None  # hf backend
    shared_prompts: int = 0  # hf engine: replies whose prompt another sample's prefill computed
    batches_per_device: dict = field(default_factory=dict)
    warnings: list = field(default_factory=list)  # sentences a user should read once (the input's notes)

    def summary(self) -> str:
        """One line for the command line."""
        state = "complete (sorted by index)" if self.complete else "PARTIAL: rerun the same command to resume"
        pad = f", padding {100 * self.padding_share:.1f}%" if self.padding_share is not None else ""
        if self.shared_prompts:
            pad += f", {self.shared_prompts} replies shared their prompt's prefill"
        return (f"{self.out_path}: {state}; {self.num_rows} rows read, {self.num_skipped} already done, "
                f"{self.num_written} written, {self.num_rejected} rejected {self.rejects_by_reason}; "
                f"{self.num_replies} replies ({self.num_truncated} cut at --max-new-tokens), {self.new_tokens} "
                f"tokens in {self.seconds:.1f}s ({self.new_tokens / max(self.seconds, 1e-9):,.0f} tokens/s){pad}")


class _Loop:
    """The state of one run: rows in flight, counters, the progress line."""

    def __init__(self, source: InputSource, rows, out: RegenOutput, backend, options: GenerationOptions, window: int,
                 bar: ProgressLine):
        self.source, self.out, self.backend, self.options = source, out, backend, options
        self.window, self.bar = window, bar
        self.rows = rows  # the source's rows
        self.active: dict[tuple[int, int], tuple[RowState, RawRow]] = {}  # (index, sample) ->
        self.input_done = False
        self.reasons: collections.Counter = collections.Counter()
        self.skipped = self.replies = self.truncated = self.tokens = 0
        self.total = source.estimated_rows()

    def run(self) -> None:
        while True:
            self._fill()
            if not self.active and self.input_done:
                return
            flush = self.input_done or len(self.active) >= self.window
            for reply in self.backend.poll(flush=flush, timeout_s=0.5):
                self._on_reply(reply)
            self.bar.show(self.progress())

    def _fill(self) -> None:
        while not self.input_done and len(self.active) < self.window:
            raw = next(self.rows, None)
            if raw is None:
                self.input_done = True
                return
            samples = self.out.missing_samples(raw.index)
            if not samples:
                self.skipped += 1
                continue
            numbered = self.options.samples_per_prompt > 1
            try:
                conv = parse_conversation(decode_row(raw, self.source.max_row_bytes), need_assistant=False)
                states = [RowState(raw.index, conv, max_turns=self.options.max_turns, sample=k if numbered else None)
                          for k in samples]
            except RowRejected as e:
                self._reject(raw, e.reason, e.detail, samples)
                continue
            except Exception as e:  # one row's problem, never the run's
                self._reject(raw, "row_error", f"{type(e).__name__}: {e}", samples)
                continue
            for k, state in zip(samples, states):
                self.active[(raw.index, k)] = (state, raw)
                self._submit_or_reject(state, raw, k)

    def _submit_or_reject(self, state: RowState, raw: RawRow, sample: int) -> None:
        try:
            self._submit(state)
        except RowRejected as e:
            self._reject(raw, e.reason, e.detail, [sample])
        except Exception as e:  # one row's problem, never the run's
            self._reject(raw, "row_error", f"{type(e).__name__}: {e}", [sample])

    def _submit(self, state: RowState) -> None:
        request = state.request(self.options.max_new_tokens)
        self.backend.prepare(request)
        self.backend.submit(request)

    def _on_reply(self, reply: Reply) -> None:
        unit = (reply.key[0], reply.key[2])
        state, raw = self.active[unit]
        self.replies += 1
        self.tokens += reply.num_tokens
        self.truncated += int(reply.truncated)
        try:
            if reply.error is not None:
                raise RowRejected("generation_error", f"turn {reply.key[1]}: {reply.error}")
            state.add_reply(assistant_message(reply, self.options.reasoning))
            if not state.done:
                self._submit(state)
                return
            self.out.write(state.result())
        except OutputFailed:
            raise  # the output's problem, not the row's: the run stops (output.py)
        except RowRejected as e:
            self._reject(raw, e.reason, e.detail, [unit[1]])
        except Exception as e:
            self._reject(raw, "row_error", f"{type(e).__name__}: {e}", [unit[1]])
        self.active.pop(unit, None)

    def _reject(self, raw: RawRow, reason: str, detail: str, samples: list[int]) -> None:
        for k in samples:
            self.active.pop((raw.index, k), None)
        self.reasons[reason] += 1
        self.out.reject(raw.index, raw.where, reason, detail, raw.text(), samples)

    def progress(self) -> str:
        """`regenerate: 1200/5000 rows (300 before), 3.1 rows/s, 4,210 tokens/s, 12 rejected, ETA 20m31s`."""
        s = max(self.bar.elapsed_s, 1e-9)
        new = self.out.num_written + self.out.num_rejected
        rate = new / s
        total = f"/{self.total}" if self.total is not None else ""
        todo = None if self.total is None else self.total - self.skipped
        return (f"regenerate: {len(self.out.done) + self.out.num_rejected}{total} rows ({self.skipped} before), "
                f"{rate:.1f} rows/s, {self.tokens / s:,.0f} tokens/s, {self.out.num_rejected} rejected, "
                f"{len(self.active)} in flight, {eta(new, todo, rate)}")


def regenerate(input_path: str, out_path: str, backend, options: GenerationOptions, *, split: str | None = None,
               max_line_bytes: int = MAX_ROW_BYTES, window: int = DEFAULT_WINDOW, overwrite: bool = False,
               progress: bool = True, lock=None) -> RegenerateReport:
    """Regenerate every conversation of input_path into out_path with `backend` (HFBackend,
    OpenAIBackend); see the module docstring. The caller closes the backend. `lock`: the
    output's OutLock where the caller took it (regenerate/out_lock.py): the output releases it
    when it closes; the caller releases it too, for a run that fails before its output opens."""
    if window < 1:
        raise ConfigError(f"--window={window}: must be >= 1")
    input_path = resolve_dataset(input_path, what="--input")
    source = InputSource(input_path, split=split, max_row_bytes=max_line_bytes)
    rows = source.rows()
    first = next(rows, None)  # peeked from the one reader: a pipe is read once
    if first is None:
        # Before the output exists: an empty input writes nothing (prepare refuses it alike).
        raise DataError(f"{input_path}: the input is empty (no rows)")
    settings = {"input": os.path.abspath(input_path), "split": split, **options.settings(), **backend.describe()}
    out = RegenOutput(out_path, settings, overwrite=overwrite, samples_per_prompt=options.samples_per_prompt,
                      inputs=source.files, input_dir=input_path, split=split, lock=lock)
    if out.num_torn:
        log.warning("%s: the last run was interrupted mid-line; that row is generated again", out_path)
    try:
        loop = _Loop(source, itertools.chain([first], rows), out, backend, options, window, ProgressLine(progress))
    except BaseException:
        out.finish(None)  # closed as partial, the lock let go
        raise
    complete = False
    with StopOnSigterm() as stop:
        try:
            loop.run()
        finally:
            with stop.closing():
                complete = out.finish(source.num_rows if loop.input_done and not loop.active else None)
                loop.bar.show(loop.progress(), final=True)
                if not complete and out.failed is None:  # a failed write's own error line says it all
                    log.warning("%s: partial, %d rows written (%d this run), %d in flight lost; rerun the same "
                                "command to resume", out.path, len(out.done), out.num_written, len(loop.active))
    stats = getattr(backend, "stats", None)
    report = RegenerateReport(
        out_path=out.path, rejects_path=out.rejects_path, complete=complete, num_rows=source.num_rows,
        num_skipped=loop.skipped, num_written=out.num_written, num_rejected=out.num_rejected,
        rejects_by_reason=dict(sorted(loop.reasons.items())), num_replies=loop.replies,
        num_truncated=loop.truncated, new_tokens=loop.tokens, seconds=loop.bar.elapsed_s,
        padding_share=stats.padding_share if stats is not None and stats.batches else None,
        shared_prompts=stats.shared_prompts if stats is not None else 0,
        batches_per_device=dict(stats.per_device) if stats is not None else {}, warnings=source.notes(),
    )
    log.info("%s", report.summary())
    return report


def make_backend(kind: str, options: GenerationOptions, *, model_dir: str | None = None, devices="cpu",
                 dtype: str = "auto", decoder: str = "auto", cache: str = "auto", token_budget: int | None = None,
                 max_batch_size: int | None = None, url: str | None = None, served_model: str | None = None,
                 concurrency: int = 16, timeout_s: float = 600.0, retries: int = 5, api_key: str | None = None,
                 max_answer_mib: float = 16.0):
    """The backend a command line asks for: "hf" (needs model_dir) or "openai" (needs url)."""
    check_backend_options(kind, model_dir=model_dir, url=url)
    if kind == "hf":
        from dflash_ipc.regenerate.hf import HFBackend
        return HFBackend(resolve_model(model_dir, what="--model"), options, devices=devices, dtype=dtype, cache=cache,
                         token_budget=token_budget, max_batch_size=max_batch_size, decoder=decoder)
    from dflash_ipc.regenerate.openai import OpenAIBackend
    return OpenAIBackend(url, options, model=served_model, concurrency=concurrency, timeout_s=timeout_s,
                         retries=retries, api_key=api_key, max_answer_mib=max_answer_mib)


def check_backend_options(kind: str, *, model_dir: str | None, url: str | None) -> None:
    """What each backend needs, named: the first answer to a command line that lacks it."""
    if kind == "hf":
        if not model_dir:
            raise ConfigError("--backend hf needs --model DIR (the target's local directory, or its Hub id)")
    elif kind == "openai":
        if not url:
            raise ConfigError("--backend openai needs --url http://HOST:PORT/v1 (the server's base URL)")
    else:
        raise ConfigError(f"--backend {kind!r}; allowed: ['hf', 'openai']")


def auto_devices(devices: str) -> str:
    """--devices auto: every visible GPU (one process each), else cpu."""
    if devices != "auto":
        return devices
    import torch
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return ",".join(f"cuda:{i}" for i in range(count)) if count else "cpu"
