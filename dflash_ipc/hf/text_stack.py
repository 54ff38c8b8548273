"""The text stack of a HF checkpoint: its text config, decoder layers, embedding and LM head.

A plain causal LM keeps its text settings in its config and its layers under
`model.layers`; a multimodal checkpoint (Qwen2.5-VL, Qwen3-VL, Gemma 3 image-text, ...)
keeps them in `config.text_config` and under `model.language_model.layers`. Capture
(target/capture.py), the drafter's sizing (drafter/model.py) and evaluation
(eval/speculative.py) all go through these functions, so they agree on what "layer i" is:
the i-th entry of the decoder's layer list, whose output is HF `hidden_states[i + 1]`.

    text = text_config(config)              # the decoder's own config (the nested object)
    cut = truncated_config(config, keep=34) # layers and every per-layer list cut together
    model, report = load_pretrained(path, AutoModel, config=cut, dtype=torch.bfloat16)
    stack = find_text_stack(model)          # decoder module, its layers, embedding, LM head
"""

from __future__ import annotations

import contextlib
import copy
import os
import logging
import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dflash_ipc.errors import ConfigError, DataError

log = logging.getLogger(__name__)

PER_LAYER_KEYS = ("layer_types", "layers_block_type", "no_rope_layers", "block_configs")
"""Text-config lists with one entry per decoder layer: cut with the layers, or transformers
refuses the config (5.x checks len(layer_types) == num_hidden_layers) or builds the wrong
kind of layer (a hybrid model's linear-attention layers)."""

_LAYER_LIST_NAMES = ("layers", "h", "blocks")
_LAYER_KEY = re.compile(r"(?:^|\.)(?:layers|h|blocks)\.(\d+)\.")
_HEAD_KEYS = ("lm_head.", "output.", "embed_out.")
_LOAD_LOGGERS = ("transformers.modeling_utils", "transformers.distributed.tensor_parallel")


def text_config(config: Any) -> Any:
    """The decoder's text config: `config` itself for a plain LM, else its text sub-config.

    Returns the nested object (not a copy): edits to it are edits to `config`. Accepts a
    transformers config or a plain dict (config.json read as JSON).
    """
    if isinstance(config, dict):
        return config.get("text_config") or config
    get = getattr(config, "get_text_config", None)
    if not callable(get):
        return config
    try:
        return get(decoder=True)
    except TypeError:  # transformers without the decoder= argument
        return get()


def num_text_layers(config: Any) -> int:
    """Decoder layers of the text stack."""
    text = text_config(config)
    value = text.get("num_hidden_layers") if isinstance(text, dict) else getattr(text, "num_hidden_layers", None)
    if value is None:
        raise ConfigError(f"target config ({type(text).__name__}) has no num_hidden_layers in its text config")
    return int(value)


def has_recurrent_layers(config: Any) -> bool:
    """True when some layer keeps a recurrent state instead of attention K/V (Qwen3-Next's
    linear attention, Mamba blocks): such a state cannot be cut back to an earlier position."""
    text = text_config(config)
    kinds = [k for key in PER_LAYER_KEYS[:2] for k in (getattr(text, key, None) or ()) if isinstance(k, str)]
    return any(k == "linear_attention" or "attention" not in k for k in kinds)


def truncated_config(config: Any, keep: int) -> Any:
    """A copy of `config` whose text stack has only its first `keep` layers.

    Every per-layer list (`PER_LAYER_KEYS`) is cut to the same length, so hybrid models
    keep the kind of each kept layer (Qwen3-Next: linear / full attention; Gemma 3 and
    gpt-oss: sliding / full).
    """
    config = copy.deepcopy(config)
    text = text_config(config)
    total = num_text_layers(config)
    if not 1 <= keep <= total:
        raise ConfigError(f"cannot keep {keep} of the target's {total} layers (allowed: 1..{total})")
    text.num_hidden_layers = keep
    for key in PER_LAYER_KEYS:
        value = getattr(text, key, None)
        if isinstance(value, (list, tuple)) and len(value) == total:
            setattr(text, key, list(value)[:keep])
    return config


@dataclass
class TextStack:
    """The parts of a loaded model that capture and evaluation use."""

    decoder: nn.Module
    """Embeds token ids and runs the layers: `decoder(input_ids=..., attention_mask=...)`."""
    layers: nn.ModuleList
    """The decoder layers; layer i's output is HF `hidden_states[i + 1]`."""
    embed_tokens: nn.Embedding
    """The token embedding table `[vocab, hidden]`."""
    lm_head: nn.Module | None
    """The LM head, or None for a bare decoder (`AutoModel`)."""
    name: str
    """Dotted name of `decoder` in the model ('' for the model itself), for messages."""


def find_text_stack(model: nn.Module, num_layers: int | None = None) -> TextStack:
    """The text decoder of `model`: the outermost module holding both a list of
    `num_layers` modules (default: the text config's layer count) and the token embedding.

    A search rather than a table of names, so it finds `model.layers` (Llama, Qwen3, gpt-oss,
    Mistral), `model.language_model.layers` (Qwen-VL, Gemma 3), `transformer.h` (GPT-2
    style) alike; a vision tower's block list has no token embedding beside it.
    """
    config = getattr(model, "config", None)
    if num_layers is None:
        num_layers = num_text_layers(config)
    vocab = getattr(text_config(config), "vocab_size", None) if config is not None else None
    for name, module in model.named_modules():
        layers = {n: c for n, c in module.named_children() if isinstance(c, nn.ModuleList) and len(c) == num_layers}
        embeds = [c for c in module.children() if isinstance(c, nn.Embedding)
                  and (vocab is None or c.num_embeddings == vocab)]
        if len(layers) > 1:  # another per-layer list beside the layers: take the one named so
            layers = {n: c for n, c in layers.items() if n in _LAYER_LIST_NAMES}
        if len(layers) == 1 and embeds:
            head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
            return TextStack(decoder=module, layers=next(iter(layers.values())), embed_tokens=embeds[0],
                             lm_head=head, name=name)
    raise ConfigError(f"target {type(model).__name__}: no text decoder found (no module holds {num_layers} "
                      f"decoder layers next to a token embedding of {vocab} rows); this architecture is not "
                      "supported (docs/targets.md lists the supported ones)")


def input_device(stack: TextStack) -> torch.device:
    """Where token ids go: the embedding's device (a sharded target may spread its layers)."""
    return stack.embed_tokens.weight.device


@contextlib.contextmanager
def _quiet_transformers_load():
    """transformers' loading report (a table of every unexpected key) and progress bars off:
    the caller summarises the report in one line instead."""
    from transformers.utils import logging as hf_logging

    # transformers 5.24 runs its tensor-parallel plan check (more warnings) exactly when the
    # loader's level is WARNING or above, so that module is quieted too.
    loggers = [logging.getLogger(name) for name in _LOAD_LOGGERS]
    levels, bars = [lg.level for lg in loggers], hf_logging.is_progress_bar_enabled()
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
        if bars:
            hf_logging.enable_progress_bar()


_PICKLED_WEIGHTS = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


def check_safetensors_weights(path: str) -> None:
    """DataError unless the model directory `path` holds safetensors weights: pickled ones
    (pytorch_model.bin) can run code when loaded, and are never read."""
    if not os.path.isdir(path):
        return  # not a local directory: from_pretrained's own error names it
    names = os.listdir(path)
    if any(n.endswith(".safetensors") or n.endswith(".safetensors.index.json") for n in names):
        return
    pickled = sorted(n for n in names if n.endswith(_PICKLED_WEIGHTS))
    found = f"it holds only {', '.join(pickled[:3])}: pickled weights, never loaded (unpickling can run " \
            "code); convert them to safetensors where you trust them (save_pretrained writes safetensors)" \
        if pickled else "it holds no weights"
    raise DataError(f"{path}: no model.safetensors (or model.safetensors.index.json); {found}")


def load_pretrained(path: str, auto_class, *, config: Any, dtype: torch.dtype,
                    attn_implementation: str | None = None, extra: dict | None = None) -> tuple[nn.Module, dict]:
    """`auto_class.from_pretrained(path, config=config, **extra)` with the load report returned,
    not printed (`extra`: e.g. the tensor-parallel arguments of target/tensor_parallel.py).

    An attention implementation the architecture lacks (gpt-oss has no sdpa: its attention
    sinks need eager or flash kernels) falls back to the architecture's default with one
    warning. Returns (model, loading info: missing / unexpected / mismatched keys).
    """
    check_safetensors_weights(path)
    # use_safetensors: transformers never falls back to a pickled pytorch_model.bin (torch.load
    # of a file someone else made), whatever the directory holds.
    kwargs: dict[str, Any] = {"config": config, "dtype": dtype, "output_loading_info": True,
                              "use_safetensors": True, **(extra or {})}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    with _quiet_transformers_load():
        try:
            model, info = auto_class.from_pretrained(path, **kwargs)
        except ValueError as exc:
            if not attn_implementation or "attention" not in str(exc).lower():
                raise
            del kwargs["attn_implementation"]
            model, info = auto_class.from_pretrained(path, **kwargs)
            log.warning("target %s: %s has no %s attention in transformers; using %s (set "
                        "target.attn_implementation to choose)", path, type(model).__name__, attn_implementation,
                        model.config._attn_implementation)
    return model, info


def check_load_report(path: str, info: dict, *, stack: TextStack, keep: int, total: int) -> str:
    """One line saying what the truncated load skipped; DataError if text-stack weights are missing.

    Expected: the checkpoint's layers `keep..total-1` and its LM head are not loaded (they
    are never run). Missing weights of the text stack would be random numbers in every
    captured feature, so they stop the worker.
    """
    missing = sorted(info.get("missing_keys") or ())
    prefix = f"{stack.name}." if stack.name else ""
    stack_missing = [k for k in missing if k.startswith(prefix)]
    if stack_missing:
        raise DataError(f"{path}: {len(stack_missing)} weights of the text stack are missing from the checkpoint "
                        f"(e.g. {', '.join(stack_missing[:3])}): it does not match its config.json")
    if missing:
        log.warning("target %s: %d weights outside the text stack are missing (not used by capture): %s",
                    path, len(missing), ", ".join(missing[:3]))
    later = skipped_head = 0
    other: list[str] = []
    for key in sorted(info.get("unexpected_keys") or ()):
        match = _LAYER_KEY.search(key)
        if match and int(match.group(1)) >= keep:
            later += 1
        elif key.startswith(_HEAD_KEYS):
            skipped_head += 1
        else:
            other.append(key)
    if other:
        log.warning("target %s: %d checkpoint tensors match no module and were ignored: %s",
                    path, len(other), ", ".join(other[:5]))
    if keep == total and not skipped_head:
        return f"loaded all {total} layers"
    layers = f"layer {keep}" if keep == total - 1 else f"layers {keep}..{total - 1}"
    what = " and ".join(part for part in (f"{later} tensors of {layers}" if later else "",
                                          "the LM head" if skipped_head else "") if part)
    return f"loaded {keep} of {total} layers; {what} not read (expected: capture runs no further)"


def load_causal_lm(path: str, *, dtype: torch.dtype, attn_implementation: str | None = None) -> nn.Module:
    """The whole target with its LM head: a causal LM, or a multimodal model's text-generating
    class (`AutoModelForImageTextToText`) where transformers has no causal-LM class for it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    auto_class = AutoModelForCausalLM
    if type(config) not in AutoModelForCausalLM._model_mapping:
        from transformers import AutoModelForImageTextToText
        auto_class = AutoModelForImageTextToText
    model, info = load_pretrained(path, auto_class, config=config, dtype=dtype,
                                  attn_implementation=attn_implementation)
    if info.get("missing_keys"):
        raise DataError(f"{path}: {len(info['missing_keys'])} weights are missing from the checkpoint "
                        f"(e.g. {', '.join(sorted(info['missing_keys'])[:3])})")
    return model

