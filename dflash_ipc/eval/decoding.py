"""Batched decoding: many sequences in flight, each in a cache row, rows refilled as they finish.

The speculative decoder's loop (BatchedDecoder; the plain decoder runs the decoding core's
loop, decode/engine.py, of the same shape):

    admit    free rows take the next ready requests: one left-padded prefill per chunk of
             prompts (``prefill_tokens`` padded tokens at most), the first token chosen
             from its logits
    step     one forward over EVERY row (fixed shapes: a finished row's slot idles until a
             new request fills it), then one device -> host copy of the step's results, the
             only sync; the host commits tokens, advances lengths, finishes sequences (greedy
             speculative cycles: while the next cycle runs, SpeculativeDecoder)
    compact  when nothing is waiting and at most half the rows are busy, the caches keep
             only the busy rows, so the tail of a prompt set does not pay for empty rows

:class:`PlainDecoder` steps one token (the lossless reference and the baseline of the
speedup) on the decoding core (decode/engine.py), which has its own loop of the same shape
with a static cache and no per-step sync. :class:`SpeculativeDecoder` steps one cycle:
the drafter drafts a block for every row from its cached context, the target verifies all
blocks in one forward, the verified positions' features extend the drafter's context, and
the acceptance rule (sampling.py) says how many tokens each row commits
(acceptance.commit_block: budget and stop tokens).
A row's cache length is the position of its newest token, which the next step feeds in.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from dflash_ipc.errors import ConfigError
from dflash_ipc.eval.acceptance import AcceptanceStats, commit_block
from dflash_ipc.eval import overlapped_append
from dflash_ipc.eval.drafter_context import DrafterContext
from dflash_ipc.decode.requests import Generation, Request, RequestSource
from dflash_ipc.eval.sampling import Sampling, probabilities, sample, speculative_accept
from dflash_ipc.decode import aranges
from dflash_ipc.decode.prefill_graphs import PrefillGraphs, enabled as prefill_graphs_enabled
from dflash_ipc.decode.accept import greedy_accept_packed
from dflash_ipc.decode.top2 import greedy_top2
from dflash_ipc.decode.target import BatchedTarget

@dataclass(slots=True)
class LaunchedCycle:
    """A queued greedy cycle: its results on their way to the host, the rows they count for."""

    host: Tensor
    """``[B, 1 + 3 bs]`` float32 (decode/accept.py), filled once ``event`` has passed (CPU: at once)."""
    event: torch.cuda.Event | None
    rows: set[int]
    """Rows busy at the launch and still running the request they ran then."""
    following: tuple[Tensor, Tensor] | None
    """The next cycle's (anchors, starts), without graphs (with them: in the static inputs)."""
    epoch: int
    """The decoder's graph epoch at the launch: a later one means its static inputs are gone."""

    def read(self, decoder: SpeculativeDecoder):
        if self.event is not None:
            self.event.synchronize()
        return decoder._split(self.host.numpy())


PREFILL_TOKENS = 16384
"""Padded prompt tokens per prefill forward (bounds its activations and captured features)."""


@dataclass(slots=True)
class DecodeRun:
    """What one decoder run produced."""

    generations: list[Generation]
    """In finishing order."""
    wall_s: float
    num_target_forwards: int

    @property
    def num_generated(self) -> int:
        return sum(len(g.tokens) for g in self.generations)

    @property
    def tokens_per_s(self) -> float:
        return self.num_generated / self.wall_s if self.wall_s > 0 else float("nan")


class BatchedDecoder:
    """The row bookkeeping of the speculative decoder (a growable row cache, a host commit per
    step); subclasses define ``_step``."""

    extra_positions = 1
    """Cache positions past prompt + budget that a step may write."""
    uses_features = False
    """Whether forwards return the captured layers (the drafter's context)."""
    use_compile = False
    """Whether forwards run the target's compiled forward (decode/compiled.py; prefills too, under its layer scope)."""

    def __init__(self, target: BatchedTarget, *, batch_size: int, sampling: Sampling = Sampling(),
                 prefill_tokens: int = PREFILL_TOKENS, progress=None) -> None:
        if batch_size < 1:
            raise ConfigError(f"batch_size={batch_size} must be >= 1")
        self.target, self.batch_size, self.sampling = target, batch_size, sampling
        self.prefill_tokens, self.progress = prefill_tokens, progress
        self.device = target.device
        self.stops = target.stop_token_ids

    # --- the loop --------------------------------------------------------------------------

    @torch.inference_mode()
    def run(self, source: RequestSource) -> DecodeRun:
        started, forwards = time.perf_counter(), self.target.num_forwards
        self.generator = self.sampling.generator(self.device)
        self.done: list[Generation] = []
        self.num_done_tokens = 0
        self.waiting: collections.deque[Request] = collections.deque()
        self.source = source
        self._pull(self.batch_size)
        if self.waiting:
            self._reset(len(self.waiting), max(self._need(r) for r in self.waiting))
            while True:
                self._admit()
                if not any(s is not None for s in self.slots):
                    break
                self._step()
                self._compact_if_sparse()
            self._drain()
        return DecodeRun(self.done, time.perf_counter() - started, self.target.num_forwards - forwards)

    def _drain(self) -> None:
        """At the end of a run: wait for device work queued for no one (a cycle ahead)."""

    def _pull(self, n: int) -> None:
        while len(self.waiting) < n:
            request = self.source.next_request()
            if request is None:
                return
            self.waiting.append(request)

    def _need(self, request: Request) -> int:
        return int(request.prompt_ids.size) + request.max_new_tokens + self.extra_positions

    def _reset(self, num_rows: int, capacity: int) -> None:
        self._reset_rows(num_rows)
        self.target.reset(num_rows, capacity)

    def _reset_rows(self, num_rows: int) -> None:
        self.slots: list[Generation | None] = [None] * num_rows
        self.length = np.zeros(num_rows, dtype=np.int64)  # cache length = position of the newest token
        self.last = np.zeros(num_rows, dtype=np.int64)  # the newest token: the next step's input

    def _grow(self, capacity: int) -> None:
        self.target.cache.kv.grow(capacity)

    def _select_rows(self, keep: Tensor) -> None:
        self.target.cache.kv.select_rows(keep)

    def _admit(self) -> None:
        """Fill free rows with waiting requests, one prefill per chunk; loops because a request
        can finish at its first token and free its row again."""
        while True:
            free = [r for r, s in enumerate(self.slots) if s is None]
            self._pull(len(free))
            if not free or not self.waiting:
                return
            batch = [self.waiting.popleft() for _ in range(min(len(free), len(self.waiting)))]
            order = sorted(range(len(batch)), key=lambda i: batch[i].prompt_ids.size)
            for chunk in self._chunks([batch[i] for i in order]):
                rows, free = free[: len(chunk)], free[len(chunk):]
                self._prefill(rows, chunk)

    def _chunks(self, requests: list[Request]) -> list[list[Request]]:
        """Consecutive runs (sorted by length) of at most ``prefill_tokens`` padded tokens."""
        chunks: list[list[Request]] = []
        for request in requests:
            width = int(request.prompt_ids.size)  # the longest so far: sorted ascending
            if chunks and (len(chunks[-1]) + 1) * width <= self.prefill_tokens:
                chunks[-1].append(request)
            else:
                chunks.append([request])
        return chunks

    def _prefill(self, rows: list[int], requests: list[Request]) -> None:
        self._grow(max(self._need(r) for r in requests))
        tokens, margins, tops = self._host(*self._choose(self._prefill_logits(rows, [r.prompt_ids for r in requests])))
        for i, (row, request) in enumerate(zip(rows, requests)):
            gen = Generation(request=request, stats=self._new_stats())
            self.slots[row] = gen
            self.length[row] = request.prompt_ids.size  # its first token, at position P, is not cached yet
            self._commit(row, [int(tokens[i])], margins[i: i + 1], tops[i: i + 1], advance=0)

    def _prefill_logits(self, rows: list[int], prompts: list[np.ndarray]) -> Tensor:
        """The prefill of ``prompts`` into cache ``rows``: each row's last logits ``[R, V]``."""
        out = self.target.prefill(rows, prompts, features=self.uses_features, compiled=self.use_compile)
        self._prefilled(torch.as_tensor(rows, device=self.device), out)
        return out.logits

    def _prefilled(self, rows: Tensor, out) -> None:
        """Hook after a prefill (the speculative decoder feeds the drafter)."""

    def _new_stats(self) -> AcceptanceStats | None:
        return None

    def _choose(self, logits: Tensor) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """logits ``[..., V]`` -> (token, margin, top-1 logit) ``[...]``; margins only when greedy."""
        if self.sampling.greedy:
            return greedy_top2(logits)
        return sample(probabilities(logits, self.sampling), self.generator), None, None

    def _host(self, tokens: Tensor, margins: Tensor | None, tops: Tensor | None):
        """One device -> host copy: (tokens int64, margins, tops) as numpy (NaN margins when sampling).
        Token ids travel as float32, exact below 2**24."""
        parts = [tokens.float()] + ([margins, tops] if margins is not None else [])
        host = torch.stack(parts).cpu().numpy()
        nan = np.full(tokens.shape, np.nan, dtype=np.float32)
        return host[0].astype(np.int64), (host[1] if margins is not None else nan), \
            (host[2] if margins is not None else nan)

    def _commit(self, row: int, tokens: list[int], margins, tops, *, advance: int) -> None:
        """Append committed tokens to a row, its cache length ``advance`` positions on (the tokens
        the step ran and kept); finish it on a stop token or a full budget."""
        gen = self.slots[row]
        gen.tokens += tokens
        if self.sampling.greedy:
            gen.margins += [float(m) for m in margins[: len(tokens)]]
            gen.top_logits += [float(t) for t in tops[: len(tokens)]]
        self.length[row] += advance
        self.last[row] = tokens[-1]
        gen.stopped = tokens[-1] in self.stops
        if gen.stopped or len(gen.tokens) >= gen.request.max_new_tokens:
            self._finish(row)

    def _finish(self, row: int) -> None:
        gen, self.slots[row] = self.slots[row], None
        self.done.append(gen)
        self.num_done_tokens += len(gen.tokens)
        self.source.finished(gen)
        if self.progress is not None:
            self.progress.update(len(self.done), self.num_done_tokens)

    def _compact_if_sparse(self) -> None:
        busy = [r for r, s in enumerate(self.slots) if s is not None]
        self._pull(1)
        if self.waiting or not busy or len(busy) > len(self.slots) // 2:
            return
        self._select_rows(torch.as_tensor(busy, device=self.device))
        self.slots = [self.slots[r] for r in busy]
        self.length, self.last = self.length[busy], self.last[busy]

    def _inputs(self) -> tuple[Tensor, Tensor, int]:
        """(newest tokens ``[B]``, cache lengths ``[B]``, max length) of every row, on the device."""
        both = torch.from_numpy(np.stack([self.last, self.length])).to(self.device)
        return both[0], both[1], int(self.length.max())

    def _step(self) -> None:
        raise NotImplementedError


class PlainDecoder:
    """One target forward per token for every row: the reference speculative decoding must equal.

    It runs on the decoding core (decode/engine.py), which regenerate's hf backend runs on too:
    a static row cache, rows refilled as sequences finish, the token chosen on the device and
    read back only every ``check_every`` steps, the step a CUDA graph on GPU. Greedy keeps each
    token's margin and top-1 logit for the lossless check. ``keep_cache``: the cache (and its
    graphs) stay for the next run; by default a run frees them, since the speculative decoder
    builds its own cache on the same target next."""

    def __init__(self, target: BatchedTarget, *, batch_size: int, sampling: Sampling = Sampling(),
                 prefill_tokens: int = PREFILL_TOKENS, progress=None, check_every: int = 16, graphs: str = "auto",
                 compile: str = "auto", keep_cache: bool = False) -> None:
        from dflash_ipc.decode.engine import DecodeEngine, EngineSettings
        from dflash_ipc.decode.sampler import TokenChoice

        if batch_size < 1:
            raise ConfigError(f"batch_size={batch_size} must be >= 1")
        self.target, self.sampling, self.progress, self.keep_cache = target, sampling, progress, keep_cache
        choice = TokenChoice(temperature=sampling.temperature, top_p=sampling.top_p, seed=sampling.seed)
        self.engine = DecodeEngine(target, choice, EngineSettings(
            max_rows=batch_size, prefill_tokens=prefill_tokens, check_every=check_every, graphs=graphs,
            compile=compile, keep_margins=sampling.greedy))

    def release(self) -> None:
        """Frees the cache and graphs a ``keep_cache`` decoder kept."""
        self.engine.release()

    def run(self, source: RequestSource) -> DecodeRun:
        forwards = self.target.num_forwards
        try:
            run = self.engine.run(source, self.progress)
        finally:
            if not self.keep_cache:
                self.engine.release()
        # The engine counts its forwards itself (a graph replay does not pass through the target).
        self.target.num_forwards = forwards + run.num_target_forwards
        return DecodeRun(run.generations, run.wall_s, run.num_target_forwards)


class SpeculativeDecoder(BatchedDecoder):
    """Draft a block per row, verify all blocks in one target forward, commit by acceptance.

    Greedy on CUDA (``graphs`` auto or on), the cycle (draft, verify, extend the drafter's
    context, accept) is a CUDA graph per (rows, key-span bucket), the decoding core's
    StepGraphs (decode/graphs.py): its inputs are copied into static buffers, its results
    land in static buffers, a cache that grows drops the graphs, and the tail of a run is not
    compacted (that would reallocate the caches, and drop them too). The host
    still reads each cycle's results once and commits them (acceptance.commit_block), as in
    the eager cycle, so the lossless check sees the same code path. Sampling steps eagerly
    (its generator's state is not registered with the graphs).

    Greedy cycles run one ahead of the host: a cycle also leaves the next cycle's inputs on the
    device (each row's last committed token and its new length, which the host would upload),
    so the next cycle is queued before the host reads this one's results, and the GPU does not
    wait while the host commits. That holds while every row is busy, ran in the cycle and has
    more than a block of budget left (so none can end in it but by a stop token); a row that
    stops has its share of the cycle ahead discarded, and the cycle after a stop, an admission
    or dropped graphs starts from the host's inputs. The tokens are those of one cycle at a
    time (tests/test_eval_batched.py).

    On CUDA a greedy cycle appends the drafter's context on a side stream from the moment the
    target's last captured layer has run, beside the rest of the verify pass
    (eval/overlapped_append.py; the same tokens, tests/test_overlapped_append.py)."""

    uses_features = True

    def __init__(self, target: BatchedTarget, drafter: DrafterContext, *, graphs: str = "auto", compile: str = "auto",
                 run_ahead: bool = True, **kwargs) -> None:
        super().__init__(target, **kwargs)
        from dflash_ipc.decode.compiled import compile_enabled
        from dflash_ipc.decode.engine import GRAPHS, graphs_enabled
        from dflash_ipc.decode.graphs import StepGraphs

        if graphs not in GRAPHS:
            raise ConfigError(f"graphs={graphs!r}; allowed: {list(GRAPHS)}")
        if graphs == "on" and self.device.type != "cuda":
            raise ConfigError(f"graphs='on' needs a CUDA device; got {self.device}")
        self.drafter = drafter
        self.block_size = drafter.block_size
        self.extra_positions = drafter.block_size
        on = graphs_enabled(graphs, self.device)
        self.graphs = StepGraphs(self._graphed_cycle, [], enabled=on and self.sampling.greedy)
        self.use_compile = compile_enabled(compile, self.device, self.graphs.enabled)
        self.prefill_graphs = PrefillGraphs(target, self._prefill_body, self._caches_allocated,
                                            enabled=on and prefill_graphs_enabled(self.device))
        """A prefill and the drafter's context of its prompts, captured together (decode/prefill_graphs.py)."""
        self._static: dict[str, Tensor] = {}
        self._caches = None  # (target cache, drafter cache) of the last run, which the next may reuse
        self.run_ahead = run_ahead
        """Greedy cycles queued one ahead of the host's commit (class docstring)."""
        self.num_ahead = 0
        """Cycles queued ahead so far (those discarded for a row that stopped included)."""
        self._ahead: LaunchedCycle | None = None  # a cycle queued before the last one was committed
        self._epoch = 0  # bumped when the graphs and their static buffers are dropped
        self._pinned: list[Tensor] = []  # two host buffers the launched cycles' results land in, in turn
        scope = target.compile_scope if self.use_compile else None
        beside = self.sampling.greedy and overlapped_append.enabled(self.device, scope)
        self.overlap = overlapped_append.OverlappedAppend(self.device) if beside else None
        """The drafter's context appended on a side stream beside the verify's last layers and head
        (eval/overlapped_append.py), else after them."""

    def _forget_graphs(self) -> None:
        self.graphs.clear()
        self.prefill_graphs.clear()
        self._static = {}
        self.graphs.state = []
        self._epoch += 1

    def release(self) -> None:
        """Free the graphs, their static buffers and this decoder's caches (the target's and the
        drafter's context, where they are still the ones it built) now; the next run builds them
        anew. A decoder dropped without it dies in a reference cycle (its graphs hold its bound
        cycle), and the garbage collector may then free its graphs inside another decoder's
        capture, which breaks that capture (decode/graphs.py ``collector_held``)."""
        self._drain()
        self._forget_graphs()
        if self._caches is not None:
            target_cache, drafter_kv = self._caches
            if self.target.cache is target_cache:
                self.target.cache = None
            if self.drafter.kv is drafter_kv:
                self.drafter.kv = None
        self._caches = None
        self._pinned = []
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def run(self, source: RequestSource) -> DecodeRun:
        self._ahead = None
        try:
            return super().run(source)
        finally:
            self._ahead = None

    def _drain(self) -> None:
        ahead, self._ahead = self._ahead, None  # a cycle queued for rows that all stopped
        if ahead is not None and ahead.event is not None:
            ahead.event.synchronize()  # its time is this run's, not the next one's

    def _new_stats(self) -> AcceptanceStats:
        stats = AcceptanceStats(block_size=self.block_size)
        stats.add_prefill(1)
        return stats

    def _reset(self, num_rows: int, capacity: int) -> None:
        if self._reusable(num_rows, capacity):
            # The last run's caches, still the target's and the drafter's: their graphs stay valid
            # (stale K/V past every row's length is masked, and each prefill overwrites its rows).
            self._reset_rows(num_rows)
            return
        super()._reset(num_rows, capacity)
        self.drafter.reset(num_rows, capacity)
        self._forget_graphs()
        self._caches = (self.target.cache, self.drafter.kv)

    def _reusable(self, num_rows: int, capacity: int) -> bool:
        caches = self._caches
        return (self.graphs.enabled and caches is not None and caches[0] is self.target.cache
                and caches[1] is self.drafter.kv
                and self.target.cache.kv.num_rows == num_rows and self.target.capacity >= capacity
                and self.drafter.kv.num_rows == num_rows and self.drafter.kv.capacity >= capacity)

    def _grow(self, capacity: int) -> None:
        before = self._capacities()
        super()._grow(capacity)
        self.drafter.kv.grow(capacity)
        if self._capacities() != before:
            self._forget_graphs()  # the caches were reallocated (still the ones _reset may reuse)

    def _capacities(self) -> tuple[int, int]:
        return self.target.capacity, self.drafter.kv.capacity

    def _select_rows(self, keep: Tensor) -> None:
        super()._select_rows(keep)
        self.drafter.kv.select_rows(keep)
        self._forget_graphs()
        self._caches = None

    def _compact_if_sparse(self) -> None:
        # Compaction reallocates both caches, which drops every graph; a graphed tail is cheaper
        # over idle rows (a verify of a few more rows) than recaptured for each smaller row count.
        if not self.graphs.enabled and self._ahead is None:  # a queued cycle holds the rows as they are
            super()._compact_if_sparse()

    def _prefilled(self, rows: Tensor, out) -> None:
        self.drafter.append(rows, out.features, out.write_pos, out.positions)

    def _prefill_logits(self, rows: list[int], prompts: list[np.ndarray]) -> Tensor:
        logits = self.prefill_graphs(rows, prompts)
        return super()._prefill_logits(rows, prompts) if logits is None else logits

    def _prefill_body(self, ids: Tensor, lengths: Tensor, rows: Tensor) -> Tensor:
        """A prefill and its drafter context from the device inputs (what a prefill graph captures)."""
        out = self.target.prefill_packed(ids, lengths, rows, features=True, compiled=self.use_compile)
        self._prefilled(rows, out)
        return out.logits

    def _caches_allocated(self) -> bool:
        """Whether every layer of the target's and the drafter's caches has its storage (a cache's
        first prefill allocates it)."""
        return self.target.cache.kv.keys[-1] is not None and self.drafter.kv.keys[-1] is not None

    def _step(self) -> None:
        if not self.sampling.greedy:
            accepted, tokens = self._cycle(*self._inputs())
            self._commit_cycle(self._split(torch.cat([accepted[:, None].float(), tokens.float()], dim=1).cpu().numpy()),
                               range(len(self.slots)))
            return
        cycle = self._ahead or self._launch(*self._inputs())
        self._ahead = None
        if self._can_run_ahead(cycle):
            self.num_ahead += 1
            # Every row busy and in ``cycle``: the host's lengths are ``cycle``'s starts (all before
            # it is committed), and a cycle moves a row at most a block on.
            self._ahead = self._launch(None, None, min(int(self.length.max()) + self.block_size,
                                                       self._start_limit()), after=cycle)
        stopped = self._commit_cycle(cycle.read(self), cycle.rows)
        if self._ahead is not None:
            self._ahead.rows -= stopped

    def _commit_cycle(self, host, rows) -> set[int]:
        """Commit one cycle's host results for ``rows``; the rows that finished."""
        finished = set()
        for row in sorted(rows):
            gen = self.slots[row]
            if gen is None:
                continue
            acc, toks, row_margins, row_tops = host[0][row], host[1][row], host[2][row], host[3][row]
            remaining = gen.request.max_new_tokens - len(gen.tokens)
            committed, cycle = commit_block(toks.tolist(), num_drafted=min(self.block_size - 1, remaining),
                                            num_accepted=int(acc), remaining=remaining, stop_token_ids=self.stops)
            gen.stats.add_cycle(cycle)
            # The anchor and the accepted drafts were verified and stay cached; the last token is new.
            self._commit(row, committed, row_margins, row_tops, advance=len(committed))
            if self.slots[row] is None:
                finished.add(row)
        return finished

    def _start_limit(self) -> int:
        """The largest cache length a cycle may start from: a block below both caches' capacity."""
        return min(self.target.capacity, self.drafter.kv.capacity) - self.block_size

    def _can_run_ahead(self, cycle: LaunchedCycle) -> bool:
        """Whether the cycle after ``cycle`` may be queued from the inputs it leaves on the device:
        every row is busy, ran in it and has more than a block of budget left (class docstring)."""
        if not self.run_ahead or cycle.epoch != self._epoch:  # the graphs' static inputs were dropped since
            return False
        # Every row busy (an idle row's inputs would drift on the device and widen the key span),
        # every one in the cycle (a row admitted since starts from the host's inputs).
        if any(g is None for g in self.slots) or cycle.rows != set(range(len(self.slots))):
            return False
        return all(g.request.max_new_tokens - len(g.tokens) > self.block_size for g in self.slots)

    def _launch(self, anchors: Tensor | None, starts: Tensor | None, max_start: int,
                after: LaunchedCycle | None = None) -> LaunchedCycle:
        """Queue a greedy cycle from ``anchors``/``starts`` (None: from the inputs the cycle ``after``
        left on the device; ``max_start`` bounds the starts either way) and its results' copy to
        the host."""
        if self.graphs.enabled:
            packed = self._replay(anchors, starts, max_start)
            following = None
        else:
            if anchors is None:  # the last cycle's outputs (its static inputs, if it ran as a graph that failed)
                anchors, starts = after.following or (self._static["anchors"].clone(), self._static["starts"].clone())
            packed, *following = greedy_accept_packed(*self._cycle(anchors, starts, max_start), starts,
                                                      self._start_limit())
            following = tuple(following) if self.run_ahead else None
        rows = {r for r, g in enumerate(self.slots) if g is not None}
        if after is not None:
            rows &= after.rows
        if self.device.type != "cuda":  # a copy: a graph's static row is rewritten by the cycle ahead
            return LaunchedCycle(packed.clone(), None, rows, following, self._epoch)
        if not self._pinned or self._pinned[0].shape != packed.shape:
            self._pinned = [torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True) for _ in range(2)]
        self._pinned.reverse()  # the other buffer than the last launch's, which may still be read
        host = self._pinned[0]
        host.copy_(packed, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return LaunchedCycle(host, event, rows, following, self._epoch)

    def _cycle(self, anchors: Tensor, starts: Tensor, max_start: int):
        """Draft, verify, extend the drafter's context, all on the device: greedy, the drafts
        ``[B, bs-1]`` and the target's tokens, margins and top logits ``[B, bs]`` (accepted by
        decode/accept.py); sampling, the accepted drafts ``[B]`` and the tokens ``[B, bs]``."""
        draft_logits = self.drafter.draft_logits(anchors, starts, max_start)  # [B, bs-1, V]
        if self.sampling.greedy:
            draft_probs, drafted = None, greedy_top2(draft_logits)[0]
        else:
            draft_probs = probabilities(draft_logits, self.sampling)
            drafted = sample(draft_probs, self.generator)  # [B, bs-1]
        block = torch.cat([anchors[:, None], drafted], dim=1)  # [B, bs] at positions s..s+bs-1
        positions = starts[:, None] + aranges.arange(self.block_size, self.device)
        rows = aranges.arange(len(self.slots), self.device)

        def append(feats: Tensor) -> None:
            self.drafter.append(rows, feats, positions, positions)
        try:
            if self.overlap is None:
                logits, feats = self.target.extend(block, starts, max_start, compiled=self.use_compile)
                append(feats)
            else:
                logits, feats = self._verify_beside_append(block, starts, max_start, append)
            if self.sampling.greedy:
                return (drafted, *greedy_top2(logits))
            return speculative_accept(drafted, draft_probs, probabilities(logits, self.sampling), self.generator)
        finally:
            if self.overlap is not None:  # the side stream's inputs (feats, positions, rows) live until it is done
                self.overlap.join()

    def _verify_beside_append(self, block: Tensor, starts: Tensor, max_start: int, append):
        """The verify forward, the drafter's context appended on the side stream from the moment its
        features are ready (eval/overlapped_append.py); after the forward if they never were."""
        overlap = self.overlap
        with self.target.capture.handing_on(lambda feats: overlap.fork(lambda: append(feats))):
            logits, feats = self.target.extend(block, starts, max_start, compiled=self.use_compile)
        if not overlap.pending:
            append(feats)
        return logits, feats

    def _replay(self, anchors: Tensor, starts: Tensor, max_start: int):
        """The greedy cycle through its graph: inputs into the static buffers (None: the ones the
        last replay left there), one replay (or, where a capture failed, the same cycle
        eagerly), the static results."""
        from dflash_ipc.decode.engine import span_bucket

        bs, rows = self.block_size, len(self.slots)
        if anchors is None and not self._static:
            raise RuntimeError("SpeculativeDecoder: a cycle ahead needs the static inputs of the cycle before it")
        if not self._static:
            self._static = {"anchors": torch.zeros_like(anchors), "starts": torch.zeros_like(starts)}
            # A capture's eager warm-up runs the cycle, which leaves the next inputs in these:
            # StepGraphs puts them back before the replay.
            self.graphs.state = [self._static["anchors"], self._static["starts"]]
        if anchors is not None:  # else: the inputs the last replay left (a cycle ahead)
            self._static["anchors"].copy_(anchors)
            self._static["starts"].copy_(starts)
        span = span_bucket(max_start + bs, min(self.target.capacity, self.drafter.kv.capacity))
        forwards = self.target.num_forwards
        self.graphs.run((rows, span))
        self.target.num_forwards = forwards + 1  # one verify forward, however many the capture ran
        return self._static["packed"]

    def _graphed_cycle(self, rows: int, span: int) -> None:
        """The body a graph captures: the greedy cycle over the static inputs (a key span of
        ``span``), its host row into a static output (allocated at the first capture's eager
        warm-up) and the next cycle's inputs into the static inputs, which a cycle ahead reads
        (else the host's overwrite them)."""
        s, bs = self._static, self.block_size
        verdict = self._cycle(s["anchors"], s["starts"], span - bs)
        if "packed" not in s:
            s["packed"] = torch.empty(rows, 1 + 3 * bs, dtype=torch.float32, device=self.device)
        greedy_accept_packed(*verdict, s["starts"], self._start_limit(), out=(s["packed"], s["anchors"], s["starts"]))

    def _split(self, host: np.ndarray):
        """A cycle's host row (greedy: decode/accept.py's ``packed``; sampling: accepted and
        tokens, token ids as float32) -> (accepted [B], tokens [B, bs], margins, tops)."""
        bs = self.block_size
        nan = np.full((host.shape[0], bs), np.nan, dtype=np.float32)
        kept = host.shape[1] > 1 + bs
        return (host[:, 0].astype(np.int64), host[:, 1: 1 + bs].astype(np.int64),
                host[:, 1 + bs: 1 + 2 * bs].copy() if kept else nan, host[:, 1 + 2 * bs:].copy() if kept else nan)
