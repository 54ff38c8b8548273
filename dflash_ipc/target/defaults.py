"""What a job derives from its target when the config leaves it open, and checks it is given.

`resolve.resolve_job` calls these. Captured layers: the paper's spacing
`round(1 + i*(L-4)/(n-1))` over the target's L text layers (so pointing a config at a
36-layer target captures [1, 9, 17, 25, 33] without editing ids made for another target);
given ids that look wrong for the target's depth get a warning. Mask token: the tokenizer's,
else the first embedding row no token id reaches (Qwen3 pads 151,669 ids to 151,936 rows);
with neither, the error lists special tokens the prepared data never uses.

    ids = captured_layer_ids(36, 5)            # [1, 9, 17, 25, 33]
    for line in layer_id_warnings([1, 2], 36, 5): log.warning(line)
    mask = derive_mask_token_id(target_dir, vocab_size=151936, dataset=TokenDataset(data_dir))
"""

from __future__ import annotations

import logging

import numpy as np

from dflash_ipc.hf.layer_ids import captured_layer_ids, layer_id_warnings
from dflash_ipc.errors import ConfigError

log = logging.getLogger(__name__)

MAX_LISTED = 12  # candidate mask ids named in the error
_COUNT_CHUNK = 4096  # samples counted per bincount


def derive_mask_token_id(target_path: str, *, vocab_size: int, dataset=None) -> int:
    """The tokenizer's mask token, else the first embedding row past every token id; a
    ConfigError listing candidates (special tokens unused in `dataset`) when there is neither."""
    from transformers import AutoTokenizer
    try:
        tokenizer = AutoTokenizer.from_pretrained(target_path)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"model.mask_token_id is not set and no tokenizer loads from {target_path} "
                          f"({exc}); set model.mask_token_id") from None
    if tokenizer.mask_token_id is not None:
        return int(tokenizer.mask_token_id)
    first_spare = max(tokenizer.get_vocab().values()) + 1
    if first_spare < vocab_size:
        log.info("model.mask_token_id: the tokenizer in %s has no mask token; using %d, the first of the %d "
                 "embedding rows that no token id reaches", target_path, first_spare, vocab_size - first_spare)
        return first_spare
    raise ConfigError(f"model.mask_token_id is not set, the tokenizer in {target_path} has no mask token and "
                      f"its embedding has no spare row ({vocab_size} rows, token ids up to {first_spare - 1}); "
                      f"set model.mask_token_id to an id the data never uses. "
                      f"{_candidates_text(tokenizer, dataset, vocab_size)}")


def _special_ids(tokenizer) -> dict[int, str]:
    ids = {int(i): tok for i, tok in zip(tokenizer.all_special_ids, tokenizer.all_special_tokens)}
    for i, added in getattr(tokenizer, "added_tokens_decoder", {}).items():
        if getattr(added, "special", False):
            ids.setdefault(int(i), str(added))
    return ids


def token_counts(dataset, vocab_size: int) -> np.ndarray:
    """How often each id occurs in the prepared dataset: int64 [vocab_size]."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for start in range(0, len(dataset), _COUNT_CHUNK):
        chunk = [dataset.sample(i)[0] for i in range(start, min(start + _COUNT_CHUNK, len(dataset)))]
        ids = np.concatenate(chunk) if chunk else np.zeros(0, np.int32)
        counts += np.bincount(ids[ids < vocab_size], minlength=vocab_size)
    return counts


def _candidates_text(tokenizer, dataset, vocab_size: int) -> str:
    special = {i: t for i, t in _special_ids(tokenizer).items() if 0 <= i < vocab_size}
    if dataset is None:
        listed = ", ".join(f"{i} {t!r}" for i, t in sorted(special.items())[:MAX_LISTED])
        return f"Special tokens of the tokenizer: {listed or 'none'}."
    counts = token_counts(dataset, vocab_size)
    unused = [(i, t) for i, t in sorted(special.items()) if counts[i] == 0]
    listed = ", ".join(f"{i} {t!r}" for i, t in unused[:MAX_LISTED])
    more = f" and {len(unused) - MAX_LISTED} more" if len(unused) > MAX_LISTED else ""
    if not unused:
        return (f"Every one of the tokenizer's {len(special)} special tokens occurs in {dataset.path}; "
                "add a token to the tokenizer and a row to the embedding, or use a rarely used id.")
    return (f"Candidates: {len(unused)} of the tokenizer's {len(special)} special tokens never occur in the "
            f"{int(counts.sum()):,} tokens of {dataset.path}: {listed}{more}.")


# --- the calls resolve_job makes -------------------------------------------------------------


def fill_layer_ids(model_cfg, target_config) -> None:
    """`model.target_layer_ids`: derived when unset, checked against the depth when given."""
    from dflash_ipc.hf.target_config import check_layer_ids
    from dflash_ipc.hf.text_stack import num_text_layers
    num_layers = num_text_layers(target_config)
    if model_cfg.target_layer_ids is None:
        model_cfg.target_layer_ids = captured_layer_ids(num_layers, model_cfg.num_layers)
        log.info("model.target_layer_ids: %s (the paper's spacing over the target's %d layers)",
                 model_cfg.target_layer_ids, num_layers)
        return
    check_layer_ids(model_cfg.target_layer_ids, num_layers)
    for line in layer_id_warnings(list(model_cfg.target_layer_ids), num_layers, model_cfg.num_layers):
        log.warning(line)


def fill_mask_token_id(model_cfg, target_config, target_path: str, dataset) -> None:
    """`model.mask_token_id`: derived when unset (see derive_mask_token_id), then range-checked."""
    from dflash_ipc.hf.text_stack import text_config
    vocab = int(text_config(target_config).vocab_size)
    if model_cfg.mask_token_id is None:
        model_cfg.mask_token_id = derive_mask_token_id(target_path, vocab_size=vocab, dataset=dataset)
    if not 0 <= model_cfg.mask_token_id < vocab:
        raise ConfigError(f"model.mask_token_id: {model_cfg.mask_token_id} outside the target's "
                          f"vocabulary [0, {vocab})")


def warn_beyond_positions(max_length: int, target_config) -> None:
    """A warning when sequences may be longer than the target was trained for."""
    from dflash_ipc.hf.text_stack import text_config
    limit = getattr(text_config(target_config), "max_position_embeddings", None)
    if limit and max_length > int(limit):
        log.warning("data.bucket_boundaries[-1]=%d exceeds the target's max_position_embeddings=%d: features "
                    "past that position come from a target beyond its trained context", max_length, int(limit))
