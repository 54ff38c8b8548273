"""The target's frozen token embedding and LM head, shared by the drafter.

DFlash embeds block tokens with the target's ``embed_tokens`` and scores the drafter's
output with the target's ``lm_head``; neither is trained nor saved in the drafter
checkpoint. Only these two tensors are read from the target's safetensors (a single
``model.safetensors`` or a sharded ``model.safetensors.index.json``), so a 150K x 4K
vocabulary costs two tensors of memory, not the whole target.
"""

from __future__ import annotations

import json
import logging
import os

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dflash_ipc.errors import DataError

logger = logging.getLogger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
EMBED_SUFFIX = "embed_tokens.weight"
LM_HEAD_SUFFIX = "lm_head.weight"


class FrozenTargetHead(nn.Module):
    """Frozen ``embed_tokens`` ``[V, H]`` and ``lm_head`` ``[V, H]`` of the target.

    Held as non-persistent buffers: they follow ``.to()`` but never appear in a
    ``state_dict`` and never receive gradients. With tied embeddings ``lm_head_weight``
    is the embedding tensor itself.
    """

    def __init__(self, embed_weight: Tensor, lm_head_weight: Tensor | None = None) -> None:
        super().__init__()
        if embed_weight.dim() != 2:
            raise DataError(f"embed_tokens.weight must be 2-D [vocab, hidden], got {tuple(embed_weight.shape)}")
        if lm_head_weight is not None and lm_head_weight.shape != embed_weight.shape:
            raise DataError(
                f"lm_head.weight {tuple(lm_head_weight.shape)} does not match "
                f"embed_tokens.weight {tuple(embed_weight.shape)}"
            )
        self.tied = lm_head_weight is None
        self.register_buffer("embed_weight", embed_weight.detach(), persistent=False)
        # Tied: no second buffer, so .to() cannot split the pair into two copies.
        untied = None if lm_head_weight is None else lm_head_weight.detach()
        self.register_buffer("_untied_head", untied, persistent=False)
        self.requires_grad_(False)

    @property
    def lm_head_weight(self) -> Tensor:
        """``[V, H]``: the LM head, which is the embedding itself when tied."""
        return self.embed_weight if self._untied_head is None else self._untied_head

    @property
    def vocab_size(self) -> int:
        return int(self.embed_weight.shape[0])

    @property
    def hidden_size(self) -> int:
        return int(self.embed_weight.shape[1])

    @torch.no_grad()
    def embed(self, ids: Tensor) -> Tensor:
        """Token ids ``[...]`` -> embeddings ``[..., H]`` (no gradient)."""
        return F.embedding(ids, self.embed_weight)

    def logits(self, hidden: Tensor) -> Tensor:
        """Hidden ``[N, H]`` -> logits ``[N, V]`` in the head's dtype; grads flow to ``hidden`` only."""
        weight = self.lm_head_weight
        return F.linear(hidden.to(weight.dtype), weight)

    @classmethod
    def from_pretrained(
        cls, target_dir: str, *, dtype: torch.dtype, device: torch.device | str
    ) -> "FrozenTargetHead":
        """Read only the embedding and LM head tensors of a HF checkpoint directory."""
        names_to_file = _tensor_files(target_dir)
        embed_name = _find_name(names_to_file, EMBED_SUFFIX)
        head_name = _find_name(names_to_file, LM_HEAD_SUFFIX)
        if embed_name is None:
            raise DataError(
                f"{target_dir}: no tensor named '*{EMBED_SUFFIX}' in {_source_name(target_dir)}"
            )
        tied = _tie_word_embeddings(target_dir)
        if tied is None:
            tied = head_name is None
        if not tied and head_name is None:
            raise DataError(
                f"{target_dir}: tie_word_embeddings is false but there is no '*{LM_HEAD_SUFFIX}' "
                f"in {_source_name(target_dir)}"
            )
        embed = _read_tensor(target_dir, names_to_file, embed_name, dtype, device)
        head = None if tied else _read_tensor(target_dir, names_to_file, head_name, dtype, device)
        logger.info(
            "target head from %s: %s%s, vocab %d, hidden %d",
            target_dir, embed_name, " (tied)" if tied else f" + {head_name}", *embed.shape,
        )
        return cls(embed, head)


def _source_name(target_dir: str) -> str:
    index = os.path.join(target_dir, INDEX_FILE)
    return index if os.path.exists(index) else os.path.join(target_dir, SINGLE_FILE)


def _tensor_files(target_dir: str) -> dict[str, str]:
    """tensor name -> safetensors file (absolute path), from the index or the single file."""
    from safetensors import safe_open

    index = os.path.join(target_dir, INDEX_FILE)
    single = os.path.join(target_dir, SINGLE_FILE)
    if os.path.exists(index):
        try:
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, ValueError, KeyError) as e:
            raise DataError(f"{index}: cannot read 'weight_map' ({e})") from e
        return {name: os.path.join(target_dir, shard) for name, shard in weight_map.items()}
    if os.path.exists(single):
        with safe_open(single, framework="pt") as f:
            return {name: single for name in f.keys()}
    raise DataError(f"{target_dir}: neither {INDEX_FILE} nor {SINGLE_FILE} exists")


def _find_name(names: dict[str, str], suffix: str) -> str | None:
    """The tensor whose name ends with ``suffix``; the shortest wins (plain over nested)."""
    hits = [n for n in names if n == suffix or n.endswith("." + suffix)]
    if not hits:
        return None
    return min(hits, key=len)


def _tie_word_embeddings(target_dir: str) -> bool | None:
    """config.json's tie_word_embeddings (top level, else text_config); None if unset."""
    path = os.path.join(target_dir, "config.json")
    if not os.path.exists(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise DataError(f"{path}: not valid JSON ({e})") from e
    if "tie_word_embeddings" in cfg:
        return bool(cfg["tie_word_embeddings"])
    text = cfg.get("text_config") or {}
    if "tie_word_embeddings" in text:
        return bool(text["tie_word_embeddings"])
    return None


def _read_tensor(
    target_dir: str, names: dict[str, str], name: str, dtype: torch.dtype, device: torch.device | str
) -> Tensor:
    from safetensors import safe_open

    path = names[name]
    if not os.path.exists(path):
        raise DataError(f"{_source_name(target_dir)}: shard {path} for tensor '{name}' is missing")
    with safe_open(path, framework="pt") as f:
        if name not in f.keys():
            raise DataError(f"{path}: tensor '{name}' listed in the index is not in the shard")
        return f.get_tensor(name).to(device=device, dtype=dtype)
