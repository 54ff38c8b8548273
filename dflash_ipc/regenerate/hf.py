"""The hf backend: transformers `generate` on batches of length-bucketed, left-padded prompts.

`Generator` is the model on one device: it runs one batch (left padding, an attention mask,
a static KV cache sized to the batch where transformers offers one) and returns each prompt's
new tokens up to its first stop token. A batch that runs out of GPU memory is split in
halves and retried; a prompt that fails alone is reported as that row's error.

`HFBackend` renders each request with the target's chat template, queues it in a
`BatchScheduler`, runs the batches on one device in this process, or on several through
`devices.DevicePool` (one process per device, each pulling the next batch when it is free),
and decodes the replies.

Greedy means the argmax of the target's logits: the generation config is built here, so a
model's own generation_config.json (Qwen3 ships do_sample, temperature 0.6, top_k 20) does
not change it. Sampling is seeded per batch: reproducible for the same batches.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from dataclasses import dataclass, field

from dflash_ipc.data.chat import render
from dflash_ipc.data.messages import Conversation, RowRejected, check_special_tokens
from dflash_ipc.errors import ConfigError, DataError
from dflash_ipc.machine import require_device
from dflash_ipc.regenerate.conversation import Reply, Request
from dflash_ipc.regenerate.options import GenerationOptions
from dflash_ipc.regenerate.scheduler import BatchScheduler

log = logging.getLogger(__name__)

CACHES = ("auto", "static", "dynamic")
"""auto: static on CUDA (pre-sized, no re-allocation as the cache grows), dynamic on CPU."""


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
    per_device: dict = field(default_factory=dict)

    def add(self, other: "BatchStats", device: str = "") -> None:
        for name in ("batches", "prompts", "prompt_tokens", "prompt_slots", "new_tokens", "new_slots", "seconds"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        if device:
            self.per_device[device] = self.per_device.get(device, 0) + other.batches

    @property
    def padding_share(self) -> float:
        """Share of computed token slots (prompt and new) that held no real token."""
        slots = self.prompt_slots + self.new_slots
        return 1.0 - (self.prompt_tokens + self.new_tokens) / slots if slots else 0.0


class Generator:
    """The target on one device; `generate` runs one batch."""

    def __init__(self, settings: GeneratorSettings, device: str, model=None):
        import torch
        from transformers import AutoModelForCausalLM

        from dflash_ipc.dtypes import resolve_dtype

        if settings.num_threads and device.startswith("cpu"):
            torch.set_num_threads(settings.num_threads)
        self.settings = settings
        self.device = device
        if model is None:
            model = AutoModelForCausalLM.from_pretrained(settings.model_dir, dtype=resolve_dtype(settings.dtype, device))
            model.to(device)
        self.model = model.eval()
        self._stops = torch.as_tensor(sorted(settings.stop_ids), dtype=torch.long, device=device)
        cache = settings.cache if settings.cache != "auto" else ("static" if device.startswith("cuda") else "dynamic")
        self._cache = cache

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

    def generate(self, prompts: list[list[int]], max_new_tokens: list[int]) -> tuple[list[tuple[list[int], bool]], BatchStats]:
        """Per prompt: (new tokens up to and including the first stop token, whether one was
        hit), in order; and the batch's stats. Splits the batch on out-of-memory."""
        import torch
        try:
            return self._generate(prompts, max_new_tokens)
        except torch.OutOfMemoryError:
            if len(prompts) == 1:
                raise
            torch.cuda.empty_cache()
            half = len(prompts) // 2
            log.warning("%s: out of memory on a batch of %d; splitting it", self.device, len(prompts))
            a, sa = self.generate(prompts[:half], max_new_tokens[:half])
            b, sb = self.generate(prompts[half:], max_new_tokens[half:])
            sa.add(sb)
            return a + b, sa

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
                           new_slots=int(new.shape[1]) * len(prompts), seconds=time.perf_counter() - started)
        return results, stats

    def _cut(self, row, limit: int) -> tuple[list[int], bool]:
        import torch
        row = row[:limit]
        hits = torch.isin(row, self._stops).nonzero()
        if hits.numel():
            return row[: int(hits[0, 0]) + 1].tolist(), True
        return row.tolist(), False


def _batch_seed(seed: int, prompts: list[list[int]]) -> int:
    """A seed for one batch from the run's seed and the batch's prompts."""
    h = hashlib.blake2b(str(seed).encode(), digest_size=8)
    for p in prompts:
        h.update(len(p).to_bytes(4, "little") + bytes(str(p[-8:]), "ascii"))
    return int.from_bytes(h.digest(), "little") >> 1


class HFBackend:
    """Renders, batches, generates and decodes (see the module docstring)."""

    name = "hf"

    def __init__(self, model_dir: str, options: GenerationOptions, *, devices=("cpu",), dtype: str = "auto",
                 cache: str = "auto", token_budget: int | None = None, max_batch_size: int | None = None,
                 model=None, _throttle_s: dict | None = None):
        from dflash_ipc.data.prepare import load_tokenizer
        from dflash_ipc.data.stops import stop_token_ids

        if cache not in CACHES:
            raise ConfigError(f"--cache {cache!r}; allowed: {list(CACHES)}")
        self.devices = _check_devices(devices)
        self.options = options
        model_dir = os.path.abspath(model_dir)
        self.tokenizer = load_tokenizer(model_dir)
        config = _model_config(model_dir) if model is None else model.config
        stops = stop_token_ids(model_dir, model if model is not None else _ConfigHolder(model_dir, config),
                               tokenizer=self.tokenizer)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else min(stops, default=0)
        self.max_positions = getattr(config.get_text_config() if hasattr(config, "get_text_config") else config,
                                     "max_position_embeddings", None)
        cpu = all(d.startswith("cpu") for d in self.devices)
        self.scheduler = BatchScheduler(token_budget=token_budget or (16384 if cpu else 131072),
                                        max_batch_size=max_batch_size or (64 if cpu else 256))
        self.settings = GeneratorSettings(model_dir, dtype, cache, options.temperature, options.top_p, options.top_k,
                                          options.seed, tuple(sorted(stops)), int(pad),
                                          num_threads=1 if cpu and len(self.devices) > 1 else 0)
        self.stats = BatchStats()
        self._specials = sorted(set(self.tokenizer.all_special_tokens), key=len, reverse=True)
        self._requests: dict = {}
        if len(self.devices) == 1:
            self._local, self._pool = Generator(self.settings, self.devices[0], model=model), None
        else:
            from dflash_ipc.regenerate.devices import DevicePool
            self._local, self._pool = None, DevicePool(self.settings, self.devices, throttle_s=_throttle_s)

    def describe(self) -> dict:
        """Settings the replies depend on, for the output's state file."""
        return {"backend": "hf", "model_dir": self.settings.model_dir, "dtype": self.settings.dtype,
                "stop_ids": list(self.settings.stop_ids)}

    def prepare(self, request: Request) -> None:
        """Render the request's prompt; RowRejected when it cannot be (template, length)."""
        check_special_tokens(request.messages, self._specials)
        conv = Conversation(request.messages, request.tools)
        try:
            text = render(self.tokenizer, conv, add_generation_prompt=True, template_kwargs=self.options.template_kwargs)
        except Exception as e:  # jinja errors, template raise_exception()
            raise RowRejected("template_error", f"turn {request.key[1]}: {type(e).__name__}: {e}"[:500]) from None
        request.prompt_ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if self.max_positions:  # a reply may use what is left of the model's context
            request.max_new_tokens = min(request.max_new_tokens, self.max_positions - len(request.prompt_ids))
            if request.max_new_tokens < 1:
                raise RowRejected("too_long", f"turn {request.key[1]}: {len(request.prompt_ids)} prompt tokens fill "
                                              f"the model's {self.max_positions} positions")

    def submit(self, request: Request) -> None:
        """Queue a prepared request."""
        self._requests[request.key] = request
        self.scheduler.add(request.key, len(request.prompt_ids), request.max_new_tokens)

    def pending(self) -> int:
        """Requests submitted and not yet answered."""
        return len(self._requests)

    def poll(self, *, flush: bool, timeout_s: float = 1.0) -> list[Reply]:
        """Run (or collect) batches; returns the replies that are ready."""
        if self._pool is None:
            keys = self.scheduler.next_batch(flush=flush)
            if keys is None:
                return []
            return self._run_local(keys)
        while self._pool.free_slots() > 0:
            keys = self.scheduler.next_batch(flush=flush)
            if keys is None:
                break
            self._pool.put(keys, [self._requests[k].prompt_ids for k in keys],
                           [self._requests[k].max_new_tokens for k in keys])
        done = self._pool.get(timeout_s)
        if done is None:
            return []
        keys, outputs, stats, device, error = done
        self.stats.add(stats, device)
        return self._replies(keys, outputs, error)

    def _run_local(self, keys: list) -> list[Reply]:
        reqs = [self._requests[k] for k in keys]
        try:
            outputs, stats = self._local.generate([r.prompt_ids for r in reqs], [r.max_new_tokens for r in reqs])
        except Exception as e:  # a batch of one that fails (out of memory alone, a model error)
            if len(keys) > 1:
                raise
            return self._replies(keys, None, f"{type(e).__name__}: {e}"[:500])
        self.stats.add(stats, self._local.device)
        return self._replies(keys, outputs, None)

    def _replies(self, keys: list, outputs, error: str | None) -> list[Reply]:
        replies = []
        stops = set(self.settings.stop_ids)
        for i, key in enumerate(keys):
            request = self._requests.pop(key)
            if error is not None:
                replies.append(Reply(key, error=error))
                continue
            tokens, stopped = outputs[i]
            body = tokens[:-1] if stopped and tokens and tokens[-1] in stops else tokens
            text = self.tokenizer.decode(body, skip_special_tokens=False)
            replies.append(Reply(key, text=text, num_tokens=len(tokens),
                                 truncated=not stopped and len(tokens) >= request.max_new_tokens))
        return replies

    def close(self) -> None:
        """Stop the device processes (if any)."""
        if self._pool is not None:
            self._pool.close()


class _ConfigHolder:
    """A stand-in with the model's configs, for stop-token discovery without loading weights."""

    def __init__(self, model_dir: str, config):
        from transformers import GenerationConfig
        self.config = config
        try:
            self.generation_config = GenerationConfig.from_pretrained(model_dir, local_files_only=True)
        except OSError:
            self.generation_config = None


def _model_config(model_dir: str):
    from transformers import AutoConfig
    try:
        return AutoConfig.from_pretrained(model_dir, local_files_only=True)
    except Exception as e:
        raise DataError(f"{model_dir}: cannot read the model's config.json ({type(e).__name__}: {str(e)[:300]})") from None


def _check_devices(devices) -> list[str]:
    devices = [d.strip() for d in (devices.split(",") if isinstance(devices, str) else devices) if d.strip()]
    if not devices:
        raise ConfigError("--devices: give at least one device (cpu, cuda:0, cuda:0,cuda:1, ...)")
    for d in devices:
        if d != "cpu" and not (d.startswith("cuda:") and d[5:].isdigit()):
            raise ConfigError(f"--devices: {d!r}; allowed: cpu or cuda:N, comma-separated")
        require_device(d, "--devices")
    return devices
