"""The target on one device, generating one batch: what the hf backend runs in this process or
in each device process (`devices.py`).

`Generator` runs one batch and returns each prompt's new tokens up to its first stop token,
through one of two decoders (DECODERS):

  engine    the decoding core (decode/engine.py): a static row cache, rows refilled as
            replies finish (continuous batching within the batch, which hf.py makes several
            times the engine's rows), token choice on the device, CUDA graphs on GPU
  generate  transformers' `generate` on the whole batch (left padding, an attention mask, a
            static KV cache sized to the batch where transformers offers one): every
            architecture transformers generates with (multimodal, linear attention)

A batch that runs out of GPU memory is split in halves and retried; a prompt that fails
alone is reported as that row's error.

Greedy means the argmax of the target's logits: the choice is made here, so a model's own
generation_config.json (Qwen3 ships do_sample, temperature 0.6, top_k 20) does not change
it. Sampling: the engine seeds each request by (seed, row index, turn, sample), so a reply
does not depend on its batch; generate seeds per batch (reproducible for the same batches).
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass, field

from dflash_ipc.errors import DataError

log = logging.getLogger(__name__)

CACHES = ("auto", "static", "dynamic")
"""The generate decoder's cache. auto: static on CUDA (pre-sized, no re-allocation as the
cache grows), dynamic on CPU. The engine's cache is always static."""
DECODERS = ("auto", "engine", "generate")
"""auto: the engine where the target allows (attention layers only, a text-only causal LM), else generate."""
_KV_SHARE_OF_FREE = 0.6
"""Share of the GPU memory free after loading the model that the engine's cache may take by default."""


def default_max_batch_size(decoder: str, *, cpu: bool) -> int:
    """Rows in flight (engine) or prompts per `generate` call when the user names none. On a GPU
    the engine's decode step reads the weights once for all its rows, so more rows make more
    tokens per step until attention over the rows' caches dominates: 512 rows made 1.06x the
    tokens/s of 256 at the Qwen3-1.7B shape, one run (docs/benchmarks.md). The cache's memory share
    (`_KV_SHARE_OF_FREE`) caps the rows where 512 do not fit."""
    if cpu:
        return 64
    return 256 if decoder == "generate" else 512


@dataclass(frozen=True, slots=True)
class GeneratorSettings:
    """What a device process needs to build its Generator (picklable)."""

    model_dir: str
    dtype: str = "auto"
    cache: str = "auto"
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    stop_ids: tuple = ()
    pad_id: int = 0
    num_threads: int = 0  # CPU: torch threads of this process (0: leave as is)
    decoder: str = "auto"  # DECODERS
    max_rows: int = 64  # engine: rows in flight at most
    kv_tokens: int | None = None  # engine: cached positions of all rows (None: CPU 16384, GPU from free memory)
    check_every: int = 16  # engine: steps between looks for stop tokens
    graphs: str = "auto"  # engine: CUDA graphs (decode.engine.GRAPHS)
    compile: str = "auto"  # engine: torch.compile of the target's decode forward (decode.compiled.COMPILE)
    continuous: bool = True  # engine: refill rows as they finish (False: static batches, for benchmarks)
    refill_rows: int | None = None  # engine: free rows a refill waits for (None: an eighth of the rows)


@dataclass(slots=True)
class BatchStats:
    """Token slots of the batches run: real prompt / padded prompt, real / computed new."""

    batches: int = 0
    prompts: int = 0
    prompt_tokens: int = 0
    prompt_slots: int = 0
    new_tokens: int = 0
    new_slots: int = 0
    seconds: float = 0.0
    steps: int = 0  # decode steps (forwards after the prefills)
    kv_positions_read: int | None = 0  # engine: rows x key span summed over steps; None: not counted (generate)
    captures: int = 0  # engine: CUDA graphs captured
    shared_prompts: int = 0  # engine: prompts another request's prefill computed (samples of one prompt)
    per_device: dict = field(default_factory=dict)

    def add(self, other: "BatchStats", device: str = "") -> None:
        if self.kv_positions_read is None or other.kv_positions_read is None:
            self.kv_positions_read = other.kv_positions_read = None
        for name in ("batches", "prompts", "prompt_tokens", "prompt_slots", "new_tokens", "new_slots", "seconds",
                     "steps", "captures", "shared_prompts", *(("kv_positions_read",) if self.kv_positions_read is not None else ())):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        if device:
            self.per_device[device] = self.per_device.get(device, 0) + other.batches

    @property
    def padding_share(self) -> float:
        """Share of computed token slots (prompt and new) that held no real token."""
        slots = self.prompt_slots + self.new_slots
        return 1.0 - (self.prompt_tokens + self.new_tokens) / slots if slots else 0.0


class DeviceUnusable(DataError):
    """A batch failed and left its device unusable: a CUDA error (an illegal address, a
    device-side assert, ECC) sticks to the process, and every later batch would fail too."""


class Generator:
    """The target on one device; `generate` runs one batch, `run_batch` adds the failure rule."""

    def __init__(self, settings: GeneratorSettings, device: str, model=None):
        import torch

        from dflash_ipc.config.dtypes import resolve_dtype
        from dflash_ipc.hf.text_stack import load_causal_lm

        if settings.num_threads and device.startswith("cpu"):
            torch.set_num_threads(settings.num_threads)
        self.settings = settings
        self.device = device
        if model is None:
            # The image-text class for multimodal targets (Qwen3-VL, Gemma 3); missing weights refused.
            model = load_causal_lm(settings.model_dir, dtype=resolve_dtype(settings.dtype, device))
            model.to(device)
        self.model = model.eval()
        self._stops = torch.as_tensor(sorted(settings.stop_ids), dtype=torch.long, device=device)
        cache = settings.cache if settings.cache != "auto" else ("static" if device.startswith("cuda") else "dynamic")
        self._cache = cache
        self.decoder = resolve_decoder(settings.decoder, self.model.config)
        self.engine = self._engine() if self.decoder == "engine" else None

    def _engine(self):
        from dflash_ipc.decode.cache import kv_bytes_per_token
        from dflash_ipc.decode.engine import DecodeEngine, EngineSettings
        from dflash_ipc.decode.sampler import TokenChoice
        from dflash_ipc.decode.target import BatchedTarget

        s = self.settings
        target = BatchedTarget(s.model_dir, device=self.device, model=self.model)
        target.stop_token_ids = frozenset(s.stop_ids)  # the backend's (tokenizer's included), not the model's alone
        kv_tokens = s.kv_tokens
        if kv_tokens is None and self.device.startswith("cuda"):
            import torch
            torch.cuda.empty_cache()  # memory cached by this process's allocator counts as used here
            free, _ = torch.cuda.mem_get_info(torch.device(self.device))
            kv_tokens = max(1, int(_KV_SHARE_OF_FREE * free / kv_bytes_per_token(target.text_config, target.dtype)))
        choice = TokenChoice(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, seed=s.seed)
        return DecodeEngine(target, choice, EngineSettings(max_rows=s.max_rows, kv_tokens=kv_tokens or 16384,
                                                           check_every=s.check_every, graphs=s.graphs,
                                                           compile=s.compile, continuous=s.continuous, refill_rows=s.refill_rows))

    def run_batch(self, prompts: list[list[int]], max_new_tokens: list[int],
                  keys: list | None = None) -> tuple[list | None, BatchStats | None, str | None]:
        """(outputs, stats, None) of `generate`; for a batch that fails on a device that still
        works, (None, None, error): its rows are rejected, the run goes on. A batch that leaves
        the device unusable raises DeviceUnusable: the run stops (rows written are kept)."""
        try:
            outputs, stats = self.generate(prompts, max_new_tokens, keys)
            return outputs, stats, None
        except Exception as e:  # noqa: BLE001 - a model error of any kind is this batch's
            error = f"{type(e).__name__}: {e}"[:500]
        if not self.device_usable():
            raise DeviceUnusable(f"regenerate: a batch failed on {self.device} and left the device unusable "
                                 f"({error}); rows written so far are kept, rerun to resume")
        return None, None, error

    def device_usable(self) -> bool:
        """False when this process's CUDA context is broken: an illegal address, a device-side
        assert or an ECC error sticks to the context, and every later call fails the same way
        (fast, so a device process that went on would reject most of the remaining rows)."""
        if not self.device.startswith("cuda"):
            return True
        import torch
        try:
            return torch.ones(1, device=self.device).add_(1).item() == 2.0  # .item() synchronizes
        except Exception:  # noqa: BLE001 - any failure here means the context is gone
            return False

    def _config(self, max_new_tokens: int):
        from transformers import GenerationConfig

        s = self.settings
        sample = s.temperature > 0
        # Every field that changes the choice of token is set: a None would be filled from the
        # model's own generation_config.json.
        return GenerationConfig(
            max_new_tokens=max_new_tokens, min_new_tokens=0, do_sample=sample,
            # greedy: the global defaults, which sampling alone reads (other values would be warned about)
            temperature=s.temperature if sample else 1.0, top_p=s.top_p if sample else 1.0,
            top_k=s.top_k if sample else 50, min_p=None, typical_p=1.0, repetition_penalty=1.0,
            no_repeat_ngram_size=0, num_beams=1, eos_token_id=list(s.stop_ids) or None, pad_token_id=s.pad_id,
            cache_implementation="static" if self._cache == "static" else None, disable_compile=True,
        )

    def generate(self, prompts: list[list[int]], max_new_tokens: list[int],
                 keys: list | None = None) -> tuple[list, BatchStats]:
        """Per prompt, in order: (new tokens up to and including the first stop token, whether one
        was hit), or an error string for a prompt that runs out of memory even alone (only its
        row is rejected); and the batch's stats. Splits the batch in halves on out-of-memory.
        ``keys``: each prompt's request key (the engine seeds sampling with it; default: its place)."""
        import torch
        keys = list(keys) if keys is not None else list(range(len(prompts)))
        try:
            if self.engine is not None:
                return self._run_engine(prompts, max_new_tokens, keys)
            return self._generate(prompts, max_new_tokens)
        except torch.OutOfMemoryError as e:
            message = str(e).splitlines()[0] if str(e) else "OutOfMemoryError"
        # Retried only here, past the except block: inside it the exception's traceback keeps
        # the failed attempt's frames, and their GPU tensors, alive.
        if self.engine is not None:
            self.engine.release()  # the retry builds a cache sized to its half
        torch.cuda.empty_cache()
        if len(prompts) == 1:
            log.warning("%s: out of memory on one prompt of %d tokens (+%d new); its row is rejected",
                        self.device, len(prompts[0]), max_new_tokens[0])
            return [f"out of memory on its own ({len(prompts[0])} prompt tokens + {max_new_tokens[0]} new "
                    f"tokens): {message}"[:500]], BatchStats()
        half = len(prompts) // 2
        log.warning("%s: out of memory on a batch of %d; splitting it", self.device, len(prompts))
        a, sa = self.generate(prompts[:half], max_new_tokens[:half], keys[:half])
        b, sb = self.generate(prompts[half:], max_new_tokens[half:], keys[half:])
        sa.add(sb)
        return a + b, sa

    def _run_engine(self, prompts: list[list[int]], max_new_tokens: list[int], keys: list):
        from dflash_ipc.decode.requests import Request, RequestList

        requests = [Request(key=k, prompt_ids=p, max_new_tokens=m) for k, p, m in zip(keys, prompts, max_new_tokens)]
        run = self.engine.run(RequestList(requests))
        by_key = {g.request.key: (g.tokens, g.stopped) for g in run.generations}
        s = run.stats
        return [by_key[k] for k in keys], BatchStats(
            batches=1, prompts=s.prompts, prompt_tokens=s.prompt_tokens, prompt_slots=s.prompt_slots,
            new_tokens=s.new_tokens, new_slots=s.new_slots, seconds=s.seconds, steps=s.steps,
            kv_positions_read=s.kv_positions_read, captures=s.captures, shared_prompts=s.shared_prompts)

    def _generate(self, prompts: list[list[int]], max_new_tokens: list[int]):
        import torch
        started = time.perf_counter()
        width, most_new = max(len(p) for p in prompts), max(max_new_tokens)
        ids = torch.full((len(prompts), width), self.settings.pad_id, dtype=torch.long)  # [B, P]
        attention = torch.zeros((len(prompts), width), dtype=torch.long)  # [B, P]
        for i, p in enumerate(prompts):  # left padding: every prompt ends at column P-1
            ids[i, width - len(p):] = torch.as_tensor(p, dtype=torch.long)
            attention[i, width - len(p):] = 1
        with torch.random.fork_rng(devices=[self.device] if self.device.startswith("cuda") else [],
                                   enabled=self.settings.temperature > 0), torch.inference_mode():
            # Sampling: seeded per batch, without moving the caller's RNG.
            if self.settings.temperature > 0:
                torch.manual_seed(_batch_seed(self.settings.seed, prompts))
            out = self.model.generate(input_ids=ids.to(self.device), attention_mask=attention.to(self.device),
                                      generation_config=self._config(most_new))
        new = out[:, width:]  # [B, n]
        results = [self._cut(new[i], max_new_tokens[i]) for i in range(len(prompts))]
        stats = BatchStats(batches=1, prompts=len(prompts), prompt_tokens=sum(map(len, prompts)),
                           prompt_slots=width * len(prompts), new_tokens=sum(len(r[0]) for r in results),
                           new_slots=int(new.shape[1]) * len(prompts), seconds=time.perf_counter() - started,
                           steps=max(0, int(new.shape[1]) - 1), kv_positions_read=None)
        return results, stats

    def _cut(self, row, limit: int) -> tuple[list[int], bool]:
        import torch
        row = row[:limit]
        hits = torch.isin(row, self._stops).nonzero()
        if hits.numel():
            return row[: int(hits[0, 0]) + 1].tolist(), True
        return row.tolist(), False


def resolve_decoder(name: str, config) -> str:
    """The decoder `name` (DECODERS) resolves to for a model of `config`; ConfigError for an
    engine it cannot run."""
    from dflash_ipc.errors import ConfigError
    from dflash_ipc.decode.ragged_attention import MASKED_LAYER_TYPES
    from dflash_ipc.hf.text_stack import has_recurrent_layers, text_config

    if name not in DECODERS:
        raise ConfigError(f"--decoder {name!r}; allowed: {list(DECODERS)}")
    if name == "generate":
        return name
    text = text_config(config)
    kinds = set(getattr(text, "layer_types", None) or ["full_attention"])
    why = ("it has linear-attention (recurrent) layers" if has_recurrent_layers(config)
           else "it is multimodal (its text config is nested)" if text is not config
           else f"its layer types {sorted(kinds)} are not all of {list(MASKED_LAYER_TYPES)}"
           if not kinds <= set(MASKED_LAYER_TYPES) else None)
    if why is None:
        return "engine"
    if name == "engine":
        raise ConfigError(f"--decoder engine: {type(config).__name__} is not supported ({why}); use --decoder generate")
    return "generate"


def _batch_seed(seed: int, prompts: list[list[int]]) -> int:
    """A seed for one batch from the run's seed and the batch's prompts."""
    h = hashlib.blake2b(str(seed).encode(), digest_size=8)
    for p in prompts:
        h.update(len(p).to_bytes(4, "little") + bytes(str(p[-8:]), "ascii"))
    return int.from_bytes(h.digest(), "little") >> 1
