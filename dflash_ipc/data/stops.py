"""The token ids at which a target's reply ends: what generation stops on.

Shared by regeneration (replies end there) and evaluation (decoding stops there), so the
data a drafter is trained on and the decoding it is measured on end at the same tokens.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

EXTRA_STOP_TOKENS = ("<|im_end|>", "<|endoftext|>")  # ChatML end of turn / of text, when in the vocab


def stop_token_ids(target_dir: str, model=None, tokenizer=None) -> frozenset[int]:
    """EOS ids of the model and generation configs and the tokenizer, plus ChatML ends.

    model: a loaded HF model (its `config` and `generation_config` are read); tokenizer: the
    target's tokenizer, loaded from target_dir when not given.
    """
    ids: set[int] = set()
    for cfg in (getattr(model, "generation_config", None), getattr(model, "config", None)):
        eos = getattr(cfg, "eos_token_id", None)
        ids.update([eos] if isinstance(eos, int) else list(eos or []))
    if tokenizer is None:
        try:
            from transformers import AutoTokenizer
            tokenizer = AutoTokenizer.from_pretrained(target_dir)
        except (OSError, ValueError) as exc:
            log.warning("%s: no tokenizer (%s); stop tokens from the configs only: %s", target_dir, exc, sorted(ids))
            return frozenset(ids)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    vocab = tokenizer.get_vocab()
    ids.update(int(vocab[t]) for t in EXTRA_STOP_TOKENS if t in vocab)
    if not ids:
        log.warning("%s: no stop token found; every generation runs to max_new_tokens", target_dir)
    return frozenset(ids)
