"""The unbatched speculative decoder: one prompt at a time, the drafter over its whole context.

Three uses: ``dflash-ipc eval`` on targets with linear-attention (recurrent) layers, which the
batched target (decode/target.py) does not run; the baseline ``dflash-ipc bench eval``
measures the batched decoders against (``legacy`` rows); an independent reference in tests. The loop, for one prompt of P
tokens (x = committed tokens, F = the captured target layers of each position):

    prefill  target(prompt) -> KV cache and F of positions 0..P-1, x[P] = greedy token
    cycle    s = position of the newest token x[s] (the anchor, not yet seen by the target)
      draft  drafter(context F[0..s-1], block [x[s], MASK x (bs-1)] at positions s..s+bs-1),
             recomputed from every context position each cycle
             -> d = min(bs-1, budget left) tokens for positions s+1..s+d
      verify target([x[s], drafted...]) on the cache of 0..s-1 -> its greedy tokens for
             s+1..s+d+1 and F of s..s+d
      commit longest matching prefix + the target's next token (acceptance.verify_block);
             keep F and the KV cache of positions s..s+c-1, drop the rest.

Each cycle reads its results back to the host token by token (``int()``, ``.cpu()``). Every
forward also keeps the target's top-1 minus top-2 logit of each position it returns
(``TargetLM.last_margins``), so ``--check-lossless`` can tell a near-tie from a mismatch here
as with the batched decoders.
A recurrent layer's state cannot be cut back to before a rejected draft, so on such targets
``truncate`` re-runs the kept prefix (exact; eval time grows with the context, tau does not move).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import time

import numpy as np
import torch
from torch import Tensor

from dflash_ipc.drafter.attention import BlockLayout, build_layer_masks
from dflash_ipc.drafter.model import DFlashDraftModel
from dflash_ipc.hf.target_head import FrozenTargetHead
from dflash_ipc.errors import ConfigError, DataError
from dflash_ipc.eval.acceptance import AcceptanceStats, verify_block
from dflash_ipc.eval.decoding import DecodeRun
from dflash_ipc.eval.report import SampleResult
from dflash_ipc.decode.requests import Generation, RequestSource
from dflash_ipc.decode.sampler import top2_margin
from dflash_ipc.eval.sampling import Sampling
from dflash_ipc.decode.target import TargetModel


class TargetLM(TargetModel):
    """A :class:`TargetModel` with one transformers ``DynamicCache`` (one sequence at a time)."""

    def __init__(self, target_dir: str, *, layer_ids: Sequence[int], device: str | torch.device = "cpu",
                 dtype: str = "auto") -> None:
        if not layer_ids:
            raise ConfigError(f"TargetLM for {target_dir}: no layer ids to capture")
        super().__init__(target_dir, layer_ids=layer_ids, device=device, dtype=dtype)
        self._cache = None
        self._ids: list[int] = []  # the tokens in the cache
        # Of the last prefill/extend, per position returned: top-1 minus top-2 logit, top-1 logit.
        self.last_margins: list[float] = []
        self.last_tops: list[float] = []

    def _forward(self, ids: Tensor, **kwargs) -> tuple[Tensor, Tensor]:
        """ids ``[k]`` after the cached positions -> (logits ``[k', V]``, features ``[k, F]``)."""
        out = self.model(input_ids=ids.to(self.device).reshape(1, -1), use_cache=True,
                         **{self.cache_kw: self._cache}, **kwargs)
        self.num_forwards += 1
        self._ids += ids.reshape(-1).tolist()
        logits = out.logits[0]  # [k', V]
        self.last_margins, self.last_tops = torch.stack(top2_margin(logits)).tolist()  # one copy to the host
        return logits, self.capture.take()[0]

    def _new_cache(self):
        from transformers import DynamicCache
        # Only a config builds the state layers of linear-attention layers; without one every
        # layer caches full K/V, which crops exactly (sliding-window layers included).
        return DynamicCache(config=self.model.config) if self.recurrent else DynamicCache()

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

    @property
    def cached_length(self) -> int:
        return 0 if self._cache is None else len(self._ids)

    def truncate(self, length: int) -> None:
        """Forget cached positions >= length (rejected drafts)."""
        remove = self.cached_length - length
        if remove < 0:
            raise DataError(f"TargetLM.truncate({length}) beyond the {self.cached_length} cached positions")
        if remove and self.recurrent:
            kept, self._cache, self._ids = self._ids[:length], self._new_cache(), []
            with torch.inference_mode():
                self._forward(torch.tensor(kept), logits_to_keep=1)
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
        config = self.model.config
        masks = build_layer_masks(layout, "dense", config.layer_types, config.sliding_window)
        return self.model(features, torch.arange(s, device=dev), self.head.embed(block_ids),
                          torch.arange(s, s + bs, device=dev), masks)


@torch.inference_mode()
def speculative_generate(target: TargetLM, proposer: Proposer, prompt_ids: Tensor | np.ndarray, *,
                         max_new_tokens: int, sample_id: int = -1,
                         margins: list[float] | None = None, tops: list[float] | None = None) -> SampleResult:
    """Greedy speculative decoding of one prompt ``[P]``; see the module docstring. ``margins``
    and ``tops``, when given, get the target's margin and top-1 logit of each token chosen."""
    margins, tops = (margins if margins is not None else []), (tops if tops is not None else [])
    if max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens={max_new_tokens} must be >= 1")
    prompt = torch.as_tensor(prompt_ids, dtype=torch.long).reshape(-1)  # [P]
    num_prompt, bs = int(prompt.numel()), proposer.block_size
    stats = AcceptanceStats(block_size=bs)
    first, feats = target.prefill(prompt)
    margins += target.last_margins[-1:]
    tops += target.last_tops[-1:]
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
        # Greedy: the committed tokens are the target's own choices at s+1..s+len(tokens).
        margins += target.last_margins[: len(tokens)]
        tops += target.last_tops[: len(tokens)]
        c = cycle.num_committed
        context[s : s + c] = block_feats[:c]  # the anchor and the accepted drafts before the bonus
        target.truncate(s + c)
        out += tokens
        stopped = cycle.stopped
    return SampleResult(sample_id=sample_id, prompt_len=num_prompt, output_ids=out, stats=stats, stopped=stopped)


@torch.inference_mode()
def greedy_generate(target: TargetLM, prompt_ids: Tensor | np.ndarray, *, max_new_tokens: int,
                    margins: list[float] | None = None, tops: list[float] | None = None) -> list[int]:
    """Plain greedy decoding, one target forward per token (the losslessness reference);
    ``margins`` and ``tops`` as in ``speculative_generate``."""
    if max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens={max_new_tokens} must be >= 1")
    margins, tops = (margins if margins is not None else []), (tops if tops is not None else [])
    prompt = torch.as_tensor(prompt_ids, dtype=torch.long).reshape(-1)
    first, _ = target.prefill(prompt)
    out = [first]
    margins += target.last_margins[-1:]
    tops += target.last_tops[-1:]
    while len(out) < max_new_tokens and out[-1] not in target.stop_token_ids:
        nxt, _ = target.extend(torch.tensor([out[-1]]))
        out.append(int(nxt[0]))
        margins += target.last_margins
        tops += target.last_tops
    return out




class UnbatchedDecoder:
    """The batched decoders' interface (``run(source) -> DecodeRun``) over one prompt at a time:
    speculative with a ``proposer``, plain greedy without. Greedy only."""

    def __init__(self, target: TargetLM, proposer: Proposer | None = None, *, sampling: Sampling = Sampling(),
                 progress=None, **_batched_options) -> None:
        if not sampling.greedy:
            raise ConfigError(f"the unbatched decoder (targets with linear-attention layers) is greedy only; got "
                              f"temperature={sampling.temperature} (use --temperature 0)")
        self.target, self.proposer, self.progress = target, proposer, progress

    @torch.inference_mode()
    def run(self, source: RequestSource) -> DecodeRun:
        started, forwards = time.perf_counter(), self.target.num_forwards
        done: list[Generation] = []
        while (request := source.next_request()) is not None:
            margins, tops = [], []
            if self.proposer is None:
                tokens = greedy_generate(self.target, request.prompt_ids, max_new_tokens=request.max_new_tokens,
                                         margins=margins, tops=tops)
                gen = Generation(request=request, tokens=tokens, stopped=tokens[-1] in self.target.stop_token_ids,
                                 margins=margins, top_logits=tops)
            else:
                result = speculative_generate(self.target, self.proposer, request.prompt_ids,
                                              max_new_tokens=request.max_new_tokens, margins=margins, tops=tops)
                gen = Generation(request=request, tokens=result.output_ids, stopped=result.stopped,
                                 stats=result.stats, margins=margins, top_logits=tops)
            done.append(gen)
            source.finished(gen)
            if self.progress:
                self.progress.update(len(done), sum(len(g.tokens) for g in done))
        return DecodeRun(done, time.perf_counter() - started, self.target.num_forwards - forwards)
