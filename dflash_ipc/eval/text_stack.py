"""Where a loaded HF causal LM keeps its text stack: config, decoder layers, embedding, LM head.

Evaluation needs the decoder layers (forward hooks capture the drafter's features), the
embedding and LM head (the drafter shares them) and the text config (layer types, sliding
window). All of it is looked up in :func:`find_text_stack` alone, so one function knows
model layouts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from dflash_ipc.errors import ConfigError


@dataclass(frozen=True, slots=True)
class TextStack:
    """The parts of a causal LM that evaluation touches."""

    config: Any
    """The text config (``get_text_config()`` of a multimodal config, else the config)."""
    layers: nn.ModuleList
    """Decoder layers in order; layer i's output is HF ``hidden_states[i + 1]``."""
    embed: nn.Module
    """Token embedding (``.weight`` ``[V, H]``)."""
    lm_head: nn.Module
    """Output projection (``.weight`` ``[V, H]``; the embedding itself when tied)."""


def find_text_stack(model: nn.Module, *, source: str = "target") -> TextStack:
    """The text stack of ``model``; ConfigError naming ``source`` when a part is missing."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", None)
    layers = getattr(decoder, "layers", None)
    embed, lm_head = model.get_input_embeddings(), model.get_output_embeddings()
    missing = [name for name, part in (("decoder layers", layers), ("input embeddings", embed),
                                       ("output embeddings (LM head)", lm_head)) if part is None]
    if missing:
        raise ConfigError(f"{source}: {type(model).__name__} has no {', '.join(missing)} where evaluation "
                          "looks for them (get_decoder().layers, get_input_embeddings(), get_output_embeddings())")
    return TextStack(config=config, layers=layers, embed=embed, lm_head=lm_head)
