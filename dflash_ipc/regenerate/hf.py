"""The hf backend: the target itself on batches of length-bucketed prompts.

`HFBackend` renders each request with the target's chat template, queues it in a
`BatchScheduler`, runs the batches on one device in this process (`generator.Generator`), or
on several through `devices.DevicePool` (one process per device, each pulling the next batch
when it is free), and decodes the replies. With the engine decoder a batch holds
`_QUEUE_FACTOR` x the engine's rows, so rows freed by short replies are refilled from it
(continuous batching) and only the batch's tail runs short of rows; with generate a batch is
what one `generate` call holds (token budget x max batch size).
"""

from __future__ import annotations

import logging
import os

from dflash_ipc.data.chat import render
from dflash_ipc.data.messages import Conversation, RowRejected, check_special_tokens, check_tools_rendered
from dflash_ipc.errors import ConfigError, DataError
from dflash_ipc.config.machine import check_device
from dflash_ipc.regenerate.conversation import Reply, Request
from dflash_ipc.regenerate.devices import DevicePool
from dflash_ipc.regenerate.generator import (CACHES, BatchStats, Generator, GeneratorSettings, default_max_batch_size,
                                             resolve_decoder)
from dflash_ipc.regenerate.options import GenerationOptions
from dflash_ipc.regenerate.scheduler import BatchScheduler

log = logging.getLogger(__name__)

_QUEUE_FACTOR = 4
"""Engine decoder: prompts per batch over the engine's rows (the queue rows are refilled from)."""
_UNBOUNDED = 1 << 62

class HFBackend:
    """Renders, batches, generates and decodes (see the module docstring)."""

    name = "hf"

    def __init__(self, model_dir: str, options: GenerationOptions, *, devices=("cpu",), dtype: str = "auto",
                 cache: str = "auto", token_budget: int | None = None, max_batch_size: int | None = None,
                 decoder: str = "auto", check_every: int = 16, graphs: str = "auto", model=None,
                 _throttle_s: dict | None = None):
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
        self.decoder = resolve_decoder(decoder, config)
        max_batch_size = max_batch_size or default_max_batch_size(self.decoder, cpu=cpu)
        self.scheduler = make_scheduler(self.decoder, token_budget, max_batch_size, cpu=cpu)
        self.settings = GeneratorSettings(model_dir, dtype, cache, options.temperature, options.top_p, options.top_k,
                                          options.seed, tuple(sorted(stops)), int(pad),
                                          num_threads=1 if cpu and len(self.devices) > 1 else 0,
                                          decoder=self.decoder, max_rows=max_batch_size,
                                          kv_tokens=token_budget if token_budget or not cpu else 16384,
                                          check_every=check_every, graphs=graphs)
        self.stats = BatchStats()
        self._specials = sorted(set(self.tokenizer.all_special_tokens), key=len, reverse=True)
        self._requests: dict = {}
        if len(self.devices) == 1:
            self._local, self._pool = Generator(self.settings, self.devices[0], model=model), None
        else:
            self._local, self._pool = None, DevicePool(self.settings, self.devices, throttle_s=_throttle_s)

    def describe(self) -> dict:
        """Settings the replies depend on, for the output's state file."""
        described = {"backend": "hf", "model_dir": self.settings.model_dir, "dtype": self.dtype(),
                     "stop_ids": list(self.settings.stop_ids)}
        if self.settings.temperature > 0:  # the decoders seed sampling differently (greedy is the same argmax)
            described["decoder"] = self.decoder
        return described

    def dtype(self) -> str:
        """The dtype the model runs in, `--dtype auto` resolved (float32 on CPU, bfloat16 on a
        GPU): what the replies depend on, so a CPU run resumed on a GPU is refused. In this
        process: the loaded model's own; device processes load it as resolve_dtype says, and
        devices of both kinds under auto run both ("bfloat16+float32")."""
        from dflash_ipc.config.dtypes import DTYPE_OF_TORCH, resolve_dtype
        model_dtype = getattr(self._local.model, "dtype", None) if self._local is not None else None
        if model_dtype in DTYPE_OF_TORCH:
            return DTYPE_OF_TORCH[model_dtype]
        return "+".join(sorted({DTYPE_OF_TORCH[resolve_dtype(self.settings.dtype, d)] for d in self.devices}))

    def prepare(self, request: Request) -> None:
        """Render the request's prompt; RowRejected when it cannot be (template, length)."""
        check_special_tokens(request.messages, self._specials)
        conv = Conversation(request.messages, request.tools)
        try:
            text = render(self.tokenizer, conv, add_generation_prompt=True, template_kwargs=self.options.template_kwargs)
        except Exception as e:  # jinja errors, template raise_exception()
            raise RowRejected("template_error", f"turn {request.key[1]}: {type(e).__name__}: {e}"[:500]) from None
        check_tools_rendered(conv, text)  # a template without tool support: the target would never see them
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
        if stats is not None:  # None: the batch failed in its device process (error says how)
            self.stats.add(stats, device)
        return self._replies(keys, outputs, error)

    def _run_local(self, keys: list) -> list[Reply]:
        reqs = [self._requests[k] for k in keys]
        # The device processes' rule (Generator.run_batch): rows rejected, or DeviceUnusable.
        outputs, stats, error = self._local.run_batch([r.prompt_ids for r in reqs], [r.max_new_tokens for r in reqs],
                                                      keys)
        if stats is not None:
            self.stats.add(stats, self._local.device)
        return self._replies(keys, outputs, error)

    def _replies(self, keys: list, outputs, error: str | None) -> list[Reply]:
        replies = []
        stops = set(self.settings.stop_ids)
        for i, key in enumerate(keys):
            request = self._requests.pop(key)
            if error is not None:
                replies.append(Reply(key, error=error))
                continue
            if isinstance(outputs[i], str):  # this prompt alone ran out of memory
                replies.append(Reply(key, error=outputs[i]))
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


def make_scheduler(decoder: str, token_budget: int | None, max_batch_size: int, *, cpu: bool) -> BatchScheduler:
    """The batches a decoder gets: the engine sizes its rows to token_budget itself (default:
    CPU 16384, GPU memory) and takes `_QUEUE_FACTOR` x its rows per batch, prompts of every
    length together (scheduler.py says why); generate takes one
    `generate` call's worth (token budget: default 131072 GPU, 16384 CPU)."""
    if decoder == "engine":
        return BatchScheduler(token_budget=_UNBOUNDED, max_batch_size=_QUEUE_FACTOR * max_batch_size, bucketed=False)
    return BatchScheduler(token_budget=token_budget or (16384 if cpu else 131072), max_batch_size=max_batch_size)


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
        check_device(d, "--devices")
    return devices
