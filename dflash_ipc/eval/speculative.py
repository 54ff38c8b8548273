"""Greedy speculative decoding with a DFlash drafter, and the `dflash-ipc eval` entry points.

The loop, for one prompt of P tokens (x = committed tokens, features F = the captured
target layers, concatenated, of each position):

    prefill  target(prompt) -> KV cache and F of positions 0..P-1, x[P] = greedy token
    cycle    s = position of the newest token x[s] (the anchor, not yet seen by the target)
      draft  drafter(context F[0..s-1], block [x[s], MASK x (bs-1)] at positions s..s+bs-1)
             -> d = min(bs-1, budget left) tokens for positions s+1..s+d
      verify target([x[s], drafted...]) on the cache of 0..s-1 -> its greedy tokens for
             s+1..s+d+1 and F of s..s+d
      commit longest matching prefix + the target's next token (acceptance.verify_block);
             keep F and the KV cache of positions s..s+c-1 (the ones the committed tokens
             were verified with), drop the rest, so no extra target pass is ever needed.

This is the training layout exactly (objective.py): an anchor at position a sees context
positions < a, and block position k predicts x[a+k]. Every committed token is the target's
own greedy choice given the committed prefix, so the output equals plain greedy decoding
(up to floating-point ties between the block and the one-token forward).

Usage:
    report = evaluate("runs/cache/tiny-target", "runs/default/checkpoints", "runs/cache/data")
    print(report.format())
    untrained, trained = untrained_vs_trained(target_dir, checkpoints_dir, data_dir)
    print(format_comparison(untrained, trained))

Held-out prompts: by default the prompts the dataset declares held out (the built-in
synthetic data keeps prompts drawn like its samples but never written to the dataset, in
meta.json "extra.held_out"); for other data the last ``num_prompts`` usable samples (a
prompt is a sample's tokens before its first loss-mask token: the conversation up to and
including the assistant header). Such data is not split here; exclude those samples from
training to make them truly held out.
"""

from __future__ import annotations

import copy
import inspect
import logging
import os
import time
from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch
from torch import Tensor

from dflash_ipc.data.dataset import TokenDataset
from dflash_ipc.drafter.attention import BlockLayout, build_mask
from dflash_ipc.drafter.export import CONFIG_FILE, load_inference_checkpoint
from dflash_ipc.drafter.model import DFlashDraftModel
from dflash_ipc.data.stops import stop_token_ids
from dflash_ipc.drafter.target_head import FrozenTargetHead
from dflash_ipc.dtypes import TORCH_DTYPES as DTYPES
from dflash_ipc.errors import ConfigError, DataError
from dflash_ipc.eval.acceptance import AcceptanceStats, EvalReport, SampleResult, verify_block

logger = logging.getLogger(__name__)

DTYPE_CHOICES = ("auto", *DTYPES)
LATEST_FILE = "latest.json"  # written by DrafterTrainer.save_checkpoint in a checkpoints root


def resolve_dtype(dtype: str, device: str | torch.device) -> torch.dtype:
    """``auto``: float32 on CPU (bf16 is emulated there), bfloat16 on accelerators."""
    if dtype == "auto":
        return torch.float32 if torch.device(device).type == "cpu" else torch.bfloat16
    if dtype not in DTYPES:
        raise ConfigError(f"eval dtype {dtype!r} not in {DTYPE_CHOICES}")
    return DTYPES[dtype]


class TargetLM:
    """The full frozen target (with its LM head), a KV cache, and the captured layers.

    Forward hooks keep the outputs of ``layer_ids`` (HF ``hidden_states[id+1]``, the same
    tensors target/capture.py sends to training; ``output_hidden_states`` would instead
    give the final-normed state for the last layer).
    """

    def __init__(self, target_dir: str, *, layer_ids: Sequence[int], device: str | torch.device = "cpu",
                 dtype: str = "auto") -> None:
        from dflash_ipc.target.capture import load_target_config
        from dflash_ipc.target.text_stack import (find_text_stack, has_recurrent_layers, load_causal_lm,
                                                  num_text_layers, text_config)

        config = load_target_config(target_dir)
        text = text_config(config)
        self.num_layers = num_text_layers(config)
        self.hidden_size = int(text.hidden_size)
        self.layer_ids = [int(i) for i in layer_ids]
        if not self.layer_ids or not all(0 <= i < self.num_layers for i in self.layer_ids):
            raise ConfigError(f"drafter target_layer_ids={self.layer_ids}: allowed ids are 0..{self.num_layers - 1} "
                              f"for the target {target_dir}")
        self.device = torch.device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.model = load_causal_lm(target_dir, dtype=self.dtype)  # multimodal checkpoints too
        self.model.to(self.device).eval().requires_grad_(False)
        self.head = FrozenTargetHead(self.model.get_input_embeddings().weight,
                                     self.model.get_output_embeddings().weight)
        self.stop_token_ids = stop_token_ids(target_dir, self.model)
        self.feature_dim = self.hidden_size * len(self.layer_ids)
        params = inspect.signature(self.model.forward).parameters
        # transformers 5.x renamed past_key_values to cache; we own the cache object either way.
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._cache = None
        self._ids: list[int] = []  # the tokens in the cache
        # A recurrent (linear-attention) state cannot be cut back: truncate re-runs the kept prefix.
        self._recurrent = has_recurrent_layers(config)
        self._captured: dict[int, Tensor] = {}
        layers = find_text_stack(self.model).layers
        for layer_id in self.layer_ids:
            layers[layer_id].register_forward_hook(self._hook(layer_id))
        self.num_forwards = 0
        """Target forwards run so far (prefills and extends): the cost that tau amortises."""

    def _hook(self, layer_id: int):
        def keep_output(module, args, output):
            self._captured[layer_id] = output[0] if isinstance(output, tuple) else output
        return keep_output

    def _forward(self, ids: Tensor, **kwargs) -> tuple[Tensor, Tensor]:
        """ids ``[k]`` after the cached positions -> (logits ``[k', V]``, features ``[k, F]``)."""
        self._captured.clear()
        out = self.model(input_ids=ids.to(self.device).reshape(1, -1), use_cache=True,
                         **{self._cache_kw: self._cache}, **kwargs)
        self.num_forwards += 1
        self._ids += ids.reshape(-1).tolist()
        feats = torch.cat([self._captured[i][0] for i in self.layer_ids], dim=-1)  # [k, F]
        self._captured.clear()
        return out.logits[0], feats

    @torch.inference_mode()
    def prefill(self, prompt_ids: Tensor) -> tuple[int, Tensor]:
        """Start a new sequence: (the greedy token after the prompt, features ``[P, F]``)."""
        self._cache, self._ids = self._new_cache(), []
        logits, feats = self._forward(prompt_ids, logits_to_keep=1)  # [1, V]: a 150K vocab x P would not fit
        return int(logits[-1].argmax()), feats

    @torch.inference_mode()
    def extend(self, ids: Tensor) -> tuple[Tensor, Tensor]:
        """Run ``ids`` ``[k]`` after the cache: (greedy next token after each ``[k]``, features ``[k, F]``)."""
        if self._cache is None:
            raise DataError("TargetLM.extend before prefill")
        logits, feats = self._forward(ids)  # [k, V]
        return logits.argmax(-1), feats

    def _new_cache(self):
        from transformers import DynamicCache
        # Only a config builds the cache layers of linear-attention layers; without one every
        # layer caches full K/V, which crops exactly (sliding-window layers included).
        return DynamicCache(config=self.model.config) if self._recurrent else DynamicCache()

    @property
    def cached_length(self) -> int:
        return len(self._ids) if self._cache is not None else 0

    def truncate(self, length: int) -> None:
        """Forget cached positions >= length (rejected drafts)."""
        remove = self.cached_length - length
        if remove < 0:
            raise DataError(f"TargetLM.truncate({length}) beyond the {self.cached_length} cached positions")
        if remove and self._recurrent:
            kept, self._cache, self._ids = self._ids[:length], self._new_cache(), self._ids[:length]
            with torch.inference_mode():
                self.model(input_ids=torch.tensor([kept], device=self.device), use_cache=True,
                           logits_to_keep=1, **{self._cache_kw: self._cache})
        elif remove:
            # crop(-n) removes n positions in transformers 4.x and 5.x alike (5.x refuses crop(+n)).
            self._cache.crop(-remove)
            del self._ids[length:]


class Proposer(Protocol):
    """Drafts one block. ``features`` ``[s, F]`` are the context of the anchor at position s."""

    block_size: int

    def propose(self, features: Tensor, anchor_token: int) -> Tensor:
        """-> ``[block_size-1]`` long: proposals for positions s+1 .. s+block_size-1."""
        ...


class DFlashProposer:
    """A DFlashDraftModel plus the target's embedding and LM head: one pass drafts a block."""

    def __init__(self, model: DFlashDraftModel, head: FrozenTargetHead) -> None:
        self.model = model.eval()
        self.head = head
        self.block_size = model.config.block_size
        self.mask_token_id = model.config.mask_token_id

    @torch.inference_mode()
    def propose(self, features: Tensor, anchor_token: int) -> Tensor:
        hidden = self.block_hidden(features, anchor_token)  # [bs, H]
        return self.head.logits(hidden[1:]).argmax(-1)  # [bs-1]

    @torch.inference_mode()
    def block_hidden(self, features: Tensor, anchor_token: int) -> Tensor:
        """Drafter output ``[bs, H]`` for the block ``[anchor, MASK...]`` at positions s..s+bs-1."""
        s, bs, dev = int(features.shape[0]), self.block_size, features.device
        block_ids = torch.full((bs,), self.mask_token_id, dtype=torch.long, device=dev)  # [bs]
        block_ids[0] = anchor_token
        zeros_q = torch.zeros(bs, dtype=torch.int32, device=dev)
        # One sequence, one block: the training layout with a single anchor at s.
        layout = BlockLayout(query_seq=zeros_q, query_anchor=zeros_q + s, query_block=zeros_q,
                             ctx_seq=torch.zeros(s, dtype=torch.int32, device=dev),
                             ctx_pos=torch.arange(s, dtype=torch.int32, device=dev),
                             cu_seqlens=torch.tensor([0, s], dtype=torch.int32, device=dev), block_size=bs)
        return self.model(features, torch.arange(s, device=dev), self.head.embed(block_ids),
                          torch.arange(s, s + bs, device=dev), build_mask(layout, "dense"))


@torch.inference_mode()
def speculative_generate(target: TargetLM, proposer: Proposer, prompt_ids: Tensor | np.ndarray, *,
                         max_new_tokens: int, sample_id: int = -1) -> SampleResult:
    """Greedy speculative decoding of one prompt ``[P]``; see the module docstring."""
    if max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens={max_new_tokens} must be >= 1")
    prompt = torch.as_tensor(prompt_ids, dtype=torch.long).reshape(-1)  # [P]
    num_prompt, bs = int(prompt.numel()), proposer.block_size
    stats = AcceptanceStats(block_size=bs)
    first, feats = target.prefill(prompt)
    stats.add_prefill(1)
    context = feats.new_empty(num_prompt + max_new_tokens, feats.shape[1])  # [P+N, F] grows in place
    context[:num_prompt] = feats
    out, stopped = [first], first in target.stop_token_ids
    while len(out) < max_new_tokens and not stopped:
        s = num_prompt + len(out) - 1  # the anchor's position
        remaining = max_new_tokens - len(out)
        drafted = proposer.propose(context[:s], out[-1])[: min(bs - 1, remaining)].to(target.device)  # [d]
        block = torch.cat([torch.tensor([out[-1]], device=target.device), drafted])  # [d+1]
        target_next, block_feats = target.extend(block)  # [d+1], [d+1, F]
        tokens, cycle = verify_block(drafted, target_next, remaining=remaining,
                                     stop_token_ids=target.stop_token_ids)
        stats.add_cycle(cycle)
        c = cycle.num_committed
        context[s : s + c] = block_feats[:c]  # the anchor and the accepted drafts before the bonus
        target.truncate(s + c)
        out += tokens
        stopped = cycle.stopped
    return SampleResult(sample_id=sample_id, prompt_len=num_prompt, output_ids=out, stats=stats, stopped=stopped)


@torch.inference_mode()
def greedy_generate(target: TargetLM, prompt_ids: Tensor | np.ndarray, *, max_new_tokens: int) -> list[int]:
    """Plain greedy decoding, one target forward per token (the losslessness reference)."""
    if max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens={max_new_tokens} must be >= 1")
    prompt = torch.as_tensor(prompt_ids, dtype=torch.long).reshape(-1)
    first, _ = target.prefill(prompt)
    out = [first]
    while len(out) < max_new_tokens and out[-1] not in target.stop_token_ids:
        nxt, _ = target.extend(torch.tensor([out[-1]]))
        out.append(int(nxt[0]))
    return out


def held_out_prompts(dataset: TokenDataset, *, num_prompts: int,
                     sample_ids: Sequence[int] | None = None) -> list[tuple[int, np.ndarray]]:
    """(sample id, prompt ids ``[P]``) pairs: ``sample_ids`` of the dataset when given; else the
    first ``num_prompts`` prompts the dataset declares held out (never trained on); else the
    last ``num_prompts`` usable samples.

    A sample is usable when it has a loss-mask token after at least one prompt token.
    """
    from dflash_ipc.data.synthetic import held_out_prompts_of

    if num_prompts < 1:
        raise ConfigError(f"num_prompts={num_prompts} must be >= 1")
    declared = held_out_prompts_of(dataset.meta)
    if sample_ids is None and declared:
        if len(declared) < num_prompts:
            logger.warning("%s: only %d held-out prompts, %d asked", dataset.path, len(declared), num_prompts)
        return declared[:num_prompts]

    def prompt_of(i: int) -> np.ndarray | None:
        ids, mask = dataset.sample(i)
        first = int(np.argmax(mask)) if mask.any() else 0
        return ids[:first] if first > 0 else None

    if sample_ids is not None:
        picked = []
        for i in sample_ids:
            prompt = prompt_of(int(i))
            if prompt is None:
                raise DataError(f"{dataset.path}: sample {i} has no prompt before its first loss-mask token")
            picked.append((int(i), prompt))
        return picked
    picked = []
    for i in range(len(dataset) - 1, -1, -1):
        prompt = prompt_of(i)
        if prompt is not None:
            picked.append((i, prompt))
        if len(picked) == num_prompts:
            break
    if not picked:
        raise DataError(f"{dataset.path}: no sample has a prompt followed by loss-mask tokens")
    if len(picked) < num_prompts:
        logger.warning("%s: only %d usable prompts, %d asked", dataset.path, len(picked), num_prompts)
    return picked[::-1]


def load_drafter(drafter: str | DFlashDraftModel, *, device: str | torch.device,
                 dtype: torch.dtype) -> tuple[DFlashDraftModel, str]:
    """(model on device in dtype, a label). Accepts a model, an export or checkpoint step
    directory (config.json + model.safetensors), or a checkpoints root (its latest.json).
    A model already on ``device`` in ``dtype`` is used as is; otherwise a converted copy."""
    if isinstance(drafter, DFlashDraftModel):
        p = next(drafter.parameters())
        if p.device != torch.device(device) or p.dtype != dtype:
            drafter = copy.deepcopy(drafter).to(device=device, dtype=dtype)
        return drafter.eval(), "in-memory drafter"
    path = os.fspath(drafter)
    if os.path.isfile(os.path.join(path, LATEST_FILE)):
        from dflash_ipc.drafter.checkpoint_store import CheckpointStore
        path = CheckpointStore(path).latest()
    if not os.path.isfile(os.path.join(path, CONFIG_FILE)):
        raise DataError(f"{drafter}: not a drafter export, checkpoint step directory or checkpoints root "
                        f"(no {CONFIG_FILE}, no {LATEST_FILE})")
    return load_inference_checkpoint(path, device=device, dtype=dtype).eval(), path


def check_compatible(model: DFlashDraftModel, target: TargetLM, source: str) -> None:
    """ConfigError unless the drafter was made for this target's shape."""
    c = model.config
    for name, mine, theirs in (("hidden_size", c.hidden_size, target.hidden_size),
                               ("vocab_size", c.vocab_size, target.head.vocab_size),
                               ("num_target_layers", c.num_target_layers, target.num_layers)):
        if mine != theirs:
            raise ConfigError(f"{source}: drafter {name}={mine} but the target has {theirs}; "
                              "the drafter was trained for another target")


def run_eval(target: TargetLM, proposer: Proposer, prompts: Sequence[tuple[int, np.ndarray]], *,
             max_new_tokens: int, label: str, check_lossless: bool = False) -> EvalReport:
    """Speculative decoding of every prompt; with ``check_lossless`` also plain greedy decoding."""
    started = time.perf_counter()
    total = AcceptanceStats(block_size=proposer.block_size)
    samples = []
    for sample_id, prompt in prompts:
        result = speculative_generate(target, proposer, prompt, max_new_tokens=max_new_tokens, sample_id=sample_id)
        if check_lossless:
            result.lossless = result.output_ids == greedy_generate(target, prompt, max_new_tokens=max_new_tokens)
            if not result.lossless:
                logger.error("%s: sample %d differs from plain greedy decoding", label, sample_id)
        total.merge(result.stats)
        samples.append(result)
        logger.debug("%s: sample %d, %d prompt tokens, %d new, tau %.2f", label, sample_id, result.prompt_len,
                     len(result.output_ids), result.stats.tau)
    report = EvalReport(label=label, stats=total, samples=samples, max_new_tokens=max_new_tokens,
                        wall_s=time.perf_counter() - started)
    logger.info("%s: tau %.3f on %d prompts, %d tokens, %.1fs", label, total.tau, len(samples),
                total.num_generated, report.wall_s)
    return report


def _prepare(target_dir: str, drafter, data_dir: str, *, num_prompts: int, device, dtype: str,
             held_out: Sequence[int] | None):
    """(target, drafter model, its label, prompts): everything an evaluation loads."""
    model, source = load_drafter(drafter, device=device, dtype=resolve_dtype(dtype, device))
    dataset = TokenDataset(data_dir)
    dataset.check_tokenizer(target_dir)
    prompts = held_out_prompts(dataset, num_prompts=num_prompts, sample_ids=held_out)
    target = TargetLM(target_dir, layer_ids=model.config.target_layer_ids, device=device, dtype=dtype)
    check_compatible(model, target, source)
    return target, model, source, prompts


def evaluate(target_dir: str, drafter: str | DFlashDraftModel, data_dir: str, *, num_prompts: int = 16,
             max_new_tokens: int = 64, device: str = "cpu", held_out: Sequence[int] | None = None,
             dtype: str = "auto", check_lossless: bool = False, label: str | None = None) -> EvalReport:
    """Mean acceptance length of ``drafter`` with the target in ``target_dir`` on held-out prompts.

    ``held_out``: sample ids of ``data_dir`` to use (``num_prompts`` is then ignored); default
    ``num_prompts`` prompts the data declares held out, else its last usable samples
    (:func:`held_out_prompts`). ``drafter``: see :func:`load_drafter`.
    """
    target, model, source, prompts = _prepare(target_dir, drafter, data_dir, num_prompts=num_prompts,
                                              device=device, dtype=dtype, held_out=held_out)
    return run_eval(target, DFlashProposer(model, target.head), prompts, max_new_tokens=max_new_tokens,
                    label=label or f"drafter {source}", check_lossless=check_lossless)


def untrained_vs_trained(target_dir: str, drafter: str | DFlashDraftModel, data_dir: str, *,
                         num_prompts: int = 16, max_new_tokens: int = 64, device: str = "cpu",
                         held_out: Sequence[int] | None = None, dtype: str = "auto", seed: int = 0,
                         check_lossless: bool = False) -> tuple[EvalReport, EvalReport]:
    """(untrained, trained) reports on the same prompts with one loaded target.

    The untrained drafter has the trained one's config and a fresh initialisation from
    ``seed`` (the caller's RNG state is left alone). Print the pair with
    ``acceptance.format_comparison``.
    """
    target, trained, source, prompts = _prepare(target_dir, drafter, data_dir, num_prompts=num_prompts,
                                                device=device, dtype=dtype, held_out=held_out)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        untrained = DFlashDraftModel(trained.config)
    untrained = untrained.to(device=target.device, dtype=next(trained.parameters()).dtype)
    kwargs = {"max_new_tokens": max_new_tokens, "check_lossless": check_lossless}
    before = run_eval(target, DFlashProposer(untrained, target.head), prompts, label="untrained", **kwargs)
    after = run_eval(target, DFlashProposer(trained, target.head), prompts, label=f"trained ({source})", **kwargs)
    return before, after
