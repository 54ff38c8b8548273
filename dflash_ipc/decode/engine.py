"""The decoding core: a static cache of rows, continuously refilled, stepped without host syncs.

Run manual:
    target = BatchedTarget("models/Qwen3-8B", device="cuda:0", dtype="bfloat16")
    engine = DecodeEngine(target, TokenChoice(temperature=0.7, top_p=0.9), EngineSettings(max_rows=256))
    run = engine.run(RequestList(requests))      # requests.py: Request / Generation / RequestSource
    for g in run.generations: ...                 # in finishing order

The loop (host side), one round:

    harvest  one device -> host copy of every row's (done, tokens so far); the finished rows'
             tokens come back (a second copy) and go to the source, which may make new
             requests ready (a multi-turn conversation's next turn)
    admit    free rows take the next waiting requests (continuous batching): one left-padded
             prefill per chunk of prompts, the first token chosen on the device (a chunk of few
             tokens, such as one prompt at batch 1, replays a CUDA graph: prefill_graphs.py).
             While other rows are busy, a refill waits for ``refill_rows`` free rows (or every
             waiting request): each refill is a prefill forward between decode steps, so a
             refill of one prompt per finished reply would cost a forward per reply. Requests
             of one prompt in a refill (regenerate's --samples-per-prompt) share its prefill:
             the prompt is computed once and its K/V copied into the other rows, each of
             which then draws its own tokens
    compact  when nothing waits and the busy rows fit a smaller rows bucket, they move to
             the front of the cache in place
    step     k decode steps over the rows bucket ``[:B]``, each on the device alone: forward
             (the newest token of every row at its position), choose the next token, append it
             to the row's output, advance its length, mark it done on a stop token or a full
             budget. No step reads anything back: k = ``check_every``, or fewer when rows
             reach their budgets sooner (the host knows budgets; only stop tokens need a look):
             with requests waiting, when enough rows for a refill have; otherwise, when the
             first one has

A done row stops advancing (its steps are idle slots until the next harvest frees it). On
CUDA each step shape (rows bucket, key-span bucket) is a CUDA graph (graphs.py), optionally of
the target's forward compiled by torch.compile (``compile``, compiled.py); on CPU the same step
runs eagerly. The key span is the host's upper bound of the longest row (a row
admitted k steps ago is at most prompt + k long), rounded up to a bucket, so a step reads
keys up to there and no further.

``continuous=False`` admits only into an empty cache: static batching, the same engine
otherwise (what bench regenerate compares against). The cache is built for the requests at
hand (capacity: the longest prompt + budget among those pulled ahead, rounded up; rows:
max_rows within kv_tokens, no more than the requests) and kept across runs; a request that
does not fit waits until the rows drain, then the cache is rebuilt bigger.
"""

from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from dflash_ipc.decode.cache import StaticRowKV, kv_bytes_per_token, static_cache
from dflash_ipc.decode.compiled import COMPILE, compile_enabled
from dflash_ipc.decode.graphs import StepGraphs
from dflash_ipc.decode.prefill_graphs import PrefillGraphs, enabled as prefill_graphs_enabled
from dflash_ipc.decode.requests import Generation, Request, RequestSource
from dflash_ipc.decode.sampler import TokenChoice, choose, top2_margin
from dflash_ipc.decode.top2 import greedy_top2
from dflash_ipc.errors import ConfigError

log = logging.getLogger(__name__)

GRAPHS = ("auto", "on", "off")
"""auto: CUDA graphs where `AUTO_GRAPHS` allows them; on: CUDA graphs (refused without CUDA); off: eager."""
AUTO_GRAPHS = True
"""What `auto` picks on a CUDA device. The captured decode and speculative steps replay the eager
ones token for token on an H200 (tests/test_decode_engine.py, tests/test_eval_batched.py, `-m
gpu`); a capture that fails logs once and the run steps eagerly."""


def graphs_enabled(setting: str, device) -> bool:
    """Whether `setting` (GRAPHS) captures CUDA graphs on `device`."""
    return setting == "on" or (setting == "auto" and AUTO_GRAPHS and torch.device(device).type == "cuda")
CAPACITY_ALIGN = 256
"""Cache capacity is rounded up to this: a later request a little longer still fits."""
_MIN_SPAN = 128
_LOOK_AHEAD = 8
"""Requests pulled ahead, in rows: the ones the cache is sized for when it is built."""


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineSettings:
    """How the engine batches and steps."""

    max_rows: int = 64
    """Rows (sequences in flight) at most; fewer when ``kv_tokens`` / capacity is smaller."""
    kv_tokens: int | None = None
    """Cached positions of all rows together at most (rows x capacity); None: max_rows rows."""
    check_every: int = 16
    """Decode steps between two looks at which rows hit a stop token (one host sync each)."""
    prefill_tokens: int = 16384
    """Padded prompt tokens per prefill forward."""
    continuous: bool = True
    """A finished row's place goes to the next request; False: only when all rows are free."""
    refill_rows: int | None = None
    """With ``continuous``: free rows that start a refill while other rows are busy (fewer when
    fewer requests wait). A refill is one prefill forward outside the captured steps, so taking
    several prompts at once amortises it, while a free row idles until then; None: an eighth of
    the rows (at least 1)."""
    graphs: str = "auto"
    """CUDA graphs of the decode step (GRAPHS)."""
    compile: str = "auto"
    """torch.compile of the target's decode forward (decode/compiled.py COMPILE; auto: where the
    step is a CUDA graph, so on a GPU; one decoder layer compiled, ~10 s: docs/benchmarks.md)."""
    keep_margins: bool = False
    """Record each chosen token's top-1 minus top-2 logit and its top-1 logit (eval's lossless check)."""

    def __post_init__(self) -> None:
        for name in ("max_rows", "check_every", "prefill_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"decode {name}={getattr(self, name)}: must be >= 1")
        if self.refill_rows is not None and self.refill_rows < 1:
            raise ConfigError(f"decode refill_rows={self.refill_rows}: must be >= 1 (or None: an eighth of the rows)")
        if self.kv_tokens is not None and self.kv_tokens < 1:
            raise ConfigError(f"decode kv_tokens={self.kv_tokens}: must be >= 1 (or None)")
        if self.graphs not in GRAPHS:
            raise ConfigError(f"decode graphs={self.graphs!r}; allowed: {list(GRAPHS)}")
        if self.compile not in COMPILE:
            raise ConfigError(f"decode compile={self.compile!r}; allowed: {list(COMPILE)}")


@dataclass(slots=True)
class EngineStats:
    """Counters of the runs so far (token slots as regenerate's BatchStats counts them)."""

    prompts: int = 0
    prompt_tokens: int = 0
    """Prompt tokens the prefills computed (a shared prompt once)."""
    prompt_slots: int = 0
    """Padded prompt positions the prefills computed."""
    shared_prompts: int = 0
    """Requests whose prompt another row's prefill computed (the same prompt ids in one refill)."""
    new_tokens: int = 0
    new_slots: int = 0
    """Row-steps computed (every row of the bucket, busy or not), plus one per prefilled row."""
    steps: int = 0
    prefills: int = 0
    harvests: int = 0
    kv_positions_read: int = 0
    """Sum over steps of rows x key span: the cached positions attention read."""
    rebuilds: int = 0
    compactions: int = 0
    captures: int = 0
    """CUDA graphs captured, steps' and prefills' (each costs an eager warm-up run and the capture)."""
    seconds: float = 0.0

    def add(self, other: "EngineStats") -> None:
        for name in self.__slots__:
            setattr(self, name, getattr(self, name) + getattr(other, name))

    @property
    def mean_rows(self) -> float:
        """Rows per decode step (the bucket, idle rows included)."""
        return (self.new_slots - self.prompts) / self.steps if self.steps else 0.0


@dataclass(slots=True)
class EngineRun:
    """What one ``run`` produced."""

    generations: list[Generation]
    """In finishing order."""
    wall_s: float
    num_target_forwards: int
    stats: EngineStats

    @property
    def num_generated(self) -> int:
        return sum(len(g.tokens) for g in self.generations)

    @property
    def tokens_per_s(self) -> float:
        return self.num_generated / self.wall_s if self.wall_s > 0 else float("nan")


def span_bucket(n: int, capacity: int) -> int:
    """Key span for a longest row needing ``n`` keys: 2^k or 1.5 x 2^k (>= 128), at most capacity."""
    span = _MIN_SPAN
    while span < n:
        span = span * 3 // 2 if span & (span - 1) == 0 else span * 4 // 3
    return min(span, capacity)


def rows_bucket(n: int, max_rows: int) -> int:
    """Rows a step runs over for ``n`` rows in use: the next power of two, at most max_rows."""
    b = 1
    while b < n:
        b *= 2
    return min(b, max_rows)


class DecodeEngine:
    """See the module docstring. ``target`` is a BatchedTarget (target.py: prefill / extend over a cache)."""

    def __init__(self, target, choice: TokenChoice = TokenChoice(), settings: EngineSettings = EngineSettings()):
        self.target, self.choice, self.settings = target, choice, settings
        self.device = torch.device(target.device)
        if settings.graphs == "on" and self.device.type != "cuda":
            raise ConfigError(f"decode graphs='on' needs a CUDA device; got {self.device}")
        self.use_graphs = graphs_enabled(settings.graphs, self.device)
        self.use_compile = compile_enabled(settings.compile, self.device, self.use_graphs)
        self.stops = torch.as_tensor(sorted(target.stop_token_ids), dtype=torch.long, device=self.device)
        self._stop_set = set(int(s) for s in target.stop_token_ids)
        self.kv: StaticRowKV | None = None
        self.cache = None
        self.graphs: StepGraphs | None = None
        self.prefill_graphs: PrefillGraphs | None = None
        self.total = EngineStats()
        self.kv_bytes_per_token = kv_bytes_per_token(target.text_config, target.dtype)
        self._over_budget_said = False

    # --- the loop --------------------------------------------------------------------------

    @torch.inference_mode()
    def run(self, source: RequestSource, progress=None) -> EngineRun:
        started, self.stats = time.perf_counter(), EngineStats()
        self._forget_rows()  # rows an interrupted run left behind (an out-of-memory error) are not ours
        if self.kv is not None:
            self.target.cache = self.cache  # another decoder may have given the target its own since
        self.source, self.progress = source, progress
        self.waiting: collections.deque[Request] = collections.deque()
        self.finished: list[Generation] = []
        self._num_done_tokens = 0
        # Every ready request (a bounded look ahead): the cache is sized for the longest of them,
        # so one a little longer than the first rows does not drain the rows and rebuild later.
        self._pull(_LOOK_AHEAD * self.settings.max_rows)
        while True:
            self._harvest()
            self._admit()
            busy = self._busy()
            if not busy:
                if not self.waiting:
                    break
                continue  # _admit rebuilt the cache for the head request; admit again
            self._compact_if_sparse(busy)
            self._steps(self._num_steps())
        self.stats.seconds = time.perf_counter() - started
        self.total.add(self.stats)
        return EngineRun(self.finished, self.stats.seconds, self.stats.steps + self.stats.prefills, self.stats)

    def _forget_rows(self) -> None:
        if self.kv is not None:
            self.slots = [None] * len(self.slots)
            self.done.fill_(True)
            self.upper[:] = self.remaining[:] = 0

    def release(self) -> None:
        """Free the cache, the row state and the graphs (the next run builds them anew, sized to it)."""
        for graphs in (self.graphs, self.prefill_graphs):
            if graphs is not None:
                graphs.clear()
        if self.kv is not None and self.target.cache is self.cache:
            self.target.cache = None
        self.graphs = self.prefill_graphs = self.kv = self.cache = None
        for name in ("last", "length", "n_out", "budget", "keys", "done", "out", "margins", "tops"):
            setattr(self, name, None)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _pull(self, n: int) -> None:
        while len(self.waiting) < n:
            request = self.source.next_request()
            if request is None:
                return
            self.waiting.append(request)

    def _busy(self) -> list[int]:
        """Rows holding a request (none before the first cache is built)."""
        return [r for r, s in enumerate(self.slots) if s is not None] if self.kv is not None else []

    @staticmethod
    def _need(request: Request) -> int:
        """Cache positions a request uses: its prompt, its budget (the last token is never fed)."""
        return int(request.prompt_ids.size) + request.max_new_tokens

    # --- the cache and the row state -----------------------------------------------------------

    def _rebuild(self, need: int) -> None:
        """A cache for requests of up to ``need`` positions (only with no row in use)."""
        capacity = self._capacity(need)
        rows = self._rows(capacity)
        self.release()
        self.cache = static_cache(self.target.num_layers, rows, capacity)
        self.target.cache, self.kv = self.cache, self.cache.kv
        dev, long = self.device, torch.long
        self.last = torch.zeros(rows, dtype=long, device=dev)  # the newest token: the next step's input
        self.length = torch.zeros(rows, dtype=long, device=dev)  # its position = cached positions
        self.n_out = torch.zeros(rows, dtype=long, device=dev)  # tokens generated
        self.budget = torch.ones(rows, dtype=long, device=dev)
        self.keys = torch.zeros(rows, dtype=long, device=dev)  # the sampler's row keys
        self.done = torch.ones(rows, dtype=torch.bool, device=dev)  # free rows are done: they never advance
        width = self.kv.capacity + 1  # the last column: where idle rows write
        self.out = torch.zeros(rows, width, dtype=long, device=dev)  # [rows, capacity + 1] tokens
        state = [self.last, self.length, self.n_out, self.done, self.out]
        if self.settings.keep_margins:
            self.margins = torch.zeros(rows, width, device=dev)
            self.tops = torch.zeros(rows, width, device=dev)
            state += [self.margins, self.tops]
        self.graphs = StepGraphs(self._step, state, enabled=self.use_graphs)
        self.prefill_graphs = PrefillGraphs(
            self.target, self._prefill_body, lambda: self.kv.keys[-1] is not None,
            enabled=self.use_graphs and prefill_graphs_enabled(self.device))
        self.slots: list[Generation | None] = [None] * rows
        self.refill = min(rows, self.settings.refill_rows or max(1, rows // 8))
        self.upper = np.zeros(rows, dtype=np.int64)  # host bound of each row's length
        self.remaining = np.zeros(rows, dtype=np.int64)  # host bound of each row's steps left to its budget
        self.stats.rebuilds += 1
        log.info("decode: cache of %d rows x %d positions (%.1f GiB once every layer is written)", rows,
                 self.kv.capacity, rows * (self.kv.capacity + 1) * self.kv_bytes_per_token / 2**30)

    def _capacity(self, need: int) -> int:
        return -(-max(need, *map(self._need, self.waiting)) // CAPACITY_ALIGN) * CAPACITY_ALIGN

    def _rows(self, capacity: int) -> int:
        """Rows of a cache of ``capacity``: max_rows, within kv_tokens, no more than the requests at hand."""
        s = self.settings
        rows = s.max_rows if s.kv_tokens is None else min(s.max_rows, s.kv_tokens // capacity)
        if rows < 1 and not self._over_budget_said:
            # One row still runs (a request is never refused for the budget), over it: said once.
            self._over_budget_said = True
            log.warning("decode: the longest waiting request needs %d cached positions (its prompt and reply "
                        "budget; a cache of %d, rounded up to %d), above the token budget of %d (--token-budget, "
                        "else what free GPU memory holds); it runs alone in one row, over the budget",
                        max(map(self._need, self.waiting), default=capacity), capacity, CAPACITY_ALIGN, s.kv_tokens)
        return max(1, min(rows, len(self.waiting)))

    def _fits(self) -> bool:
        """Whether the cache serves the waiting requests: the head fits, and rows are not fewer
        than a new cache would have (a cache built for a small run is rebuilt for a larger one)."""
        if self.kv is None or self._need(self.waiting[0]) > self.kv.capacity:
            return False
        return self.kv.max_rows >= self._rows(self.kv.capacity)

    # --- admit -------------------------------------------------------------------------------

    def _admit(self) -> None:
        """Free rows take waiting requests (see the module docstring); a head request too long for
        the cache (or no cache yet) rebuilds it once every row is free."""
        self._pull(1)
        if not self.waiting:
            return
        busy = self._busy()
        if not busy and not self._fits():
            self._pull(_LOOK_AHEAD * self.settings.max_rows)
            self._rebuild(self._need(self.waiting[0]))
        if self._need(self.waiting[0]) > self.kv.capacity:
            return  # it waits for the rows to drain
        if busy and not self.settings.continuous:
            return
        free = [r for r, s in enumerate(self.slots) if s is None]
        self._pull(max(len(free), self.refill))
        if busy and len(free) < min(self.refill, len(self.waiting)):
            return  # too few free rows for a refill yet: _num_steps steps until there are enough
        batch = []
        while self.waiting and len(batch) < len(free) and self._need(self.waiting[0]) <= self.kv.capacity:
            batch.append(self.waiting.popleft())
        batch.sort(key=lambda r: r.prompt_ids.size)
        for chunk in self._chunks(batch):
            rows, free = free[: len(chunk)], free[len(chunk):]
            self._prefill(rows, chunk)

    def _chunks(self, requests: list[Request]) -> list[list[Request]]:
        """Consecutive runs (sorted by length) of at most ``prefill_tokens`` padded tokens."""
        chunks: list[list[Request]] = []
        for request in requests:
            width = int(request.prompt_ids.size)
            if chunks and (len(chunks[-1]) + 1) * width <= self.settings.prefill_tokens:
                chunks[-1].append(request)
            else:
                chunks.append([request])
        return chunks

    def _prefill(self, rows: list[int], requests: list[Request]) -> None:
        dev = self.device
        first: dict[bytes, int] = {}  # prompt ids -> the index of its first request here
        source = [first.setdefault(r.prompt_ids.tobytes(), i) for i, r in enumerate(requests)]
        unique = sorted(first.values())
        captured = self.prefill_graphs.num_captures
        unique_rows, prompts = [rows[i] for i in unique], [requests[i].prompt_ids for i in unique]
        logits = self.prefill_graphs(unique_rows, prompts)  # [U, V]; None: not a captured shape
        if logits is None:
            logits = self.target.prefill(unique_rows, prompts, features=False, compiled=self.use_compile).logits
        self.stats.captures += self.prefill_graphs.num_captures - captured
        if len(unique) < len(requests):  # the other rows of a shared prompt: its K/V and its logits
            dups = [i for i, s in enumerate(source) if s != i]
            self.kv.copy_rows(torch.as_tensor([rows[source[i]] for i in dups], device=dev),
                              torch.as_tensor([rows[i] for i in dups], device=dev),
                              int(max(requests[i].prompt_ids.size for i in dups)))
            position = {i: u for u, i in enumerate(unique)}
            logits = logits[torch.as_tensor([position[s] for s in source], device=dev)]  # [R, V]
            self.stats.shared_prompts += len(dups)
        host = np.array([[r.prompt_ids.size, r.max_new_tokens, self.choice.row_key(r.key)] for r in requests])
        meta = torch.from_numpy(host).to(dev)
        idx = torch.as_tensor(rows, device=dev)
        tokens, margin, top = self._choose(logits, meta[:, 2], torch.zeros_like(meta[:, 0]))
        self.last[idx], self.length[idx], self.n_out[idx] = tokens, meta[:, 0], 1
        self.budget[idx], self.keys[idx] = meta[:, 1], meta[:, 2]
        self.out[idx, 0] = tokens
        self.done[idx] = self._is_stop(tokens) | (meta[:, 1] <= 1)
        if self.settings.keep_margins:
            self.margins[idx, 0], self.tops[idx, 0] = margin, top
        for row, request in zip(rows, requests):
            self.slots[row] = Generation(request=request)
            self.upper[row] = request.prompt_ids.size
            self.remaining[row] = request.max_new_tokens - 1
        width = int(max(r.prompt_ids.size for r in requests))
        self.stats.prompts += len(requests)
        self.stats.prompt_tokens += int(host[unique, 0].sum())
        self.stats.prompt_slots += width * len(unique)
        self.stats.new_slots += len(requests)
        self.stats.prefills += 1

    def _prefill_body(self, ids: Tensor, lengths: Tensor, rows: Tensor) -> Tensor:
        """A prefill from its device inputs (what a prefill graph captures): the logits ``[R, V]``."""
        return self.target.prefill_packed(ids, lengths, rows, features=False, compiled=self.use_compile).logits

    def _choose(self, logits: Tensor, keys: Tensor, index: Tensor) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """The next token of each row of logits ``[R, V]`` and, with ``keep_margins``, its margin and
        top logit (greedy: the three in one pass, decode/top2.py)."""
        if self.settings.keep_margins and self.choice.greedy:
            return greedy_top2(logits)
        tokens = choose(logits, self.choice, keys, index)
        return (tokens, *top2_margin(logits)) if self.settings.keep_margins else (tokens, None, None)

    def _is_stop(self, tokens: Tensor) -> Tensor:
        return (tokens[:, None] == self.stops[None]).any(-1)

    # --- step --------------------------------------------------------------------------------

    def _num_steps(self) -> int:
        """Steps until the next harvest: check_every, or fewer when budgets end sooner: those of
        enough rows for a refill while requests wait (continuous), else the first one's. Stop
        tokens may free rows sooner; the next look sees them."""
        busy = [r for r, s in enumerate(self.slots) if s is not None]
        if not busy:
            return 1
        left = np.sort(self.remaining[busy])
        ends = 1  # the row whose budget end is waited for, in order of ending
        if self.settings.continuous and self.waiting:
            free = len(self.slots) - len(busy)
            ends = min(max(min(self.refill, len(self.waiting)) - free, 1), len(left))
        return max(1, min(self.settings.check_every, int(left[ends - 1])))

    def _steps(self, k: int) -> None:
        busy = np.array([s is not None for s in self.slots])
        hi = int(np.flatnonzero(busy).max()) + 1
        rows = rows_bucket(hi, len(self.slots))
        for _ in range(k):
            span = span_bucket(int(self.upper[:rows].max()) + 1, self.kv.capacity)
            self.kv.num_rows = rows
            captured = self.graphs.num_captures
            self.graphs.run((rows, span))
            self.stats.captures += self.graphs.num_captures - captured
            self.upper[busy] = np.minimum(self.upper[busy] + 1, self.upper[busy] + self.remaining[busy])
            self.remaining[busy] = np.maximum(self.remaining[busy] - 1, 0)
            self.stats.steps += 1
            self.stats.new_slots += rows
            self.stats.kv_positions_read += rows * span

    def _step(self, rows: int, span: int) -> None:
        """One decode step of rows ``[:rows]`` on the device (the body a CUDA graph captures)."""
        last, length, n_out, done = self.last[:rows], self.length[:rows], self.n_out[:rows], self.done[:rows]
        logits, _ = self.target.extend(last[:, None], length, span - 1, features=False, compiled=self.use_compile)
        logits = logits[:, -1]  # [B, V]
        tokens, margin, top = self._choose(logits, self.keys[:rows], n_out)
        active = ~done
        tokens = torch.where(active, tokens, last)
        col = torch.where(active, n_out, self.out.shape[1] - 1)[:, None]  # idle rows: the scratch column
        self.out[:rows].scatter_(1, col, tokens[:, None])
        if self.settings.keep_margins:
            self.margins[:rows].scatter_(1, col, margin[:, None])
            self.tops[:rows].scatter_(1, col, top[:, None])
        step = active.long()
        n_out.add_(step)
        length.add_(step)
        last.copy_(tokens)
        done.logical_or_(active & (self._is_stop(tokens) | (n_out >= self.budget[:rows])))

    # --- harvest and compact -----------------------------------------------------------------

    def _harvest(self) -> None:
        """Hand finished rows back to the source (two device -> host copies when any finished)."""
        busy = self._busy()
        if not busy:
            return
        hi = max(busy) + 1
        flags = torch.stack([self.done[:hi].long(), self.n_out[:hi]]).cpu().numpy()
        self.stats.harvests += 1
        ended = [r for r in busy if flags[0, r]]
        if not ended:
            return
        n = int(flags[1, ended].max())
        idx = torch.as_tensor(ended, device=self.device)
        parts = [self.out[idx, :n].float()]  # token ids travel as float32: exact below 2**24
        if self.settings.keep_margins:
            parts += [self.margins[idx, :n], self.tops[idx, :n]]
        host = torch.stack(parts).cpu().numpy()
        for i, row in enumerate(ended):
            gen, self.slots[row] = self.slots[row], None
            self.upper[row] = self.remaining[row] = 0  # a free row must not widen the key span
            count = int(flags[1, row])
            gen.tokens = host[0, i, :count].astype(np.int64).tolist()
            gen.stopped = gen.tokens[-1] in self._stop_set
            if self.settings.keep_margins:
                gen.margins = host[1, i, :count].tolist()
                gen.top_logits = host[2, i, :count].tolist()
            self.finished.append(gen)
            self.stats.new_tokens += count
            self._num_done_tokens += count
            self.source.finished(gen)
        if self.progress is not None:
            self.progress.update(len(self.finished), self._num_done_tokens)

    def _compact_if_sparse(self, busy: list[int]) -> None:
        """With nothing waiting, move the busy rows to the front when that shrinks the rows bucket."""
        self._pull(1)
        total = len(self.slots)
        if self.waiting or rows_bucket(len(busy), total) >= rows_bucket(max(busy) + 1, total):
            return
        n = len(busy)
        keep = torch.as_tensor(busy, device=self.device)
        self.kv.compact(keep, int(self.upper[busy].max()) + 1)
        for t in [self.last, self.length, self.n_out, self.budget, self.keys, self.done, self.out] + \
                ([self.margins, self.tops] if self.settings.keep_margins else []):
            t[:n] = t.index_select(0, keep)
        self.done[n:] = True
        self.slots = [self.slots[r] for r in busy] + [None] * (total - n)
        self.stats.compactions += 1
        for a in (self.upper, self.remaining):
            a[:n] = a[busy]
            a[n:] = 0  # the rows left free: a stale bound there would widen a later step's key span
