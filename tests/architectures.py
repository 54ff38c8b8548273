"""The rows of the target support table (docs/targets.md), each with a tiny target built here.

For every architecture the table lists as tested, `build_tiny_target_of` writes a random-weight
model of that architecture (4 decoder layers, hidden 64, the tiny word-level tokenizer with
its ChatML chat template, dflash_ipc/builtin/tiny.py) through the real `save_pretrained`, so
tests run it through the real path: prepare, capture, training, export, evaluation
(tests/test_support_table.py). Multimodal rows get a one-block vision tower: what is
captured is their text stack. `UNSUPPORTED` are the rows that cannot work, with the reason.

    arch = ARCHITECTURES["qwen3_moe"]
    if missing_reason(arch) is None:
        build_tiny_target_of(arch, "/tmp/qwen3-moe-tiny")
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from dflash_ipc.builtin.tiny import (ENDOFTEXT, IM_END, TINY_INITIALIZER_RANGE, build_tiny_tokenizer, tiny_vocab_size,
                                  write_random_model)

HIDDEN = 64
NUM_LAYERS = 4
_VISION_QWEN = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": HIDDEN}
_VISION_SIGLIP = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
                  "image_size": 28, "patch_size": 14}


@dataclass(frozen=True)
class Architecture:
    """One row of the support table."""

    key: str
    """Short id (test ids, `ARCHITECTURES` keys)."""
    name: str
    """The row's name in docs/targets.md."""
    model_class: str
    """The transformers class whose tiny instance is saved (a causal LM or an image-text model)."""
    config_class: str
    """Its config class; a row whose class the installed transformers lacks is reported as such."""
    examples: str
    """Real checkpoints of this architecture."""
    text: dict = field(default_factory=dict)
    """Text-config settings on top of the common tiny ones (experts, layer kinds, windows)."""
    vision: dict | None = None
    """A multimodal row's vision config (its text settings go into `text_config`)."""
    extra: dict = field(default_factory=dict)
    """Top-level settings of a multimodal config (its special token ids)."""
    layer_ids: tuple[int, ...] = (1, 2)
    """Captured in the tests: layer 2 is the deepest, so the capture truncates to 3 of 4 layers."""
    chat_data: bool = True
    """Tests prepare chats with the tiny chat template; False: pre-tokenized rows (transformers
    loads Qwen3.5's own BPE tokenizer class for its model type, whatever tokenizer.json holds,
    and that class cannot read the tiny word-level tokenizer)."""


# Special ids of the multimodal rows: spare embedding rows (the tokenizer never writes them).
_MM_IDS = {"image_token_id": 1016, "video_token_id": 1017, "vision_start_token_id": 1018, "vision_end_token_id": 1019}
_SLIDE_FULL = ["sliding_attention", "full_attention"] * (NUM_LAYERS // 2)

ARCHITECTURES: dict[str, Architecture] = {a.key: a for a in (
    Architecture("llama", "Llama", "LlamaForCausalLM", "LlamaConfig", "Llama 3.1 / 3.2 / 3.3",
                 text={"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                        "high_freq_factor": 4.0, "original_max_position_embeddings": 512},
                       "rope_theta": 500000.0}),
    Architecture("qwen3", "Qwen3 (dense)", "Qwen3ForCausalLM", "Qwen3Config", "Qwen3-0.6B ... Qwen3-32B"),
    Architecture("qwen3_moe", "Qwen3-MoE", "Qwen3MoeForCausalLM", "Qwen3MoeConfig", "Qwen3-30B-A3B, Qwen3-Coder-30B-A3B",
                 text={"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                       "mlp_only_layers": [0]}),
    Architecture("qwen3_next", "Qwen3-Next (hybrid linear attention)", "Qwen3NextForCausalLM", "Qwen3NextConfig",
                 "Qwen3-Next-80B-A3B",
                 text={"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                       "shared_expert_intermediate_size": 32, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
                       "linear_key_head_dim": 16, "linear_value_head_dim": 16,
                       "layer_types": ["linear_attention", "full_attention"] * (NUM_LAYERS // 2)}),
    Architecture("gpt_oss", "gpt-oss", "GptOssForCausalLM", "GptOssConfig", "gpt-oss-20b",
                 text={"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 8,
                       "layer_types": _SLIDE_FULL}),
    Architecture("mistral", "Mistral", "MistralForCausalLM", "MistralConfig", "Mistral-7B, Mistral-Small",
                 text={"sliding_window": 4096}),
    Architecture("gemma3_text", "Gemma 3 (text)", "Gemma3ForCausalLM", "Gemma3TextConfig", "gemma-3-1b",
                 text={"sliding_window": 8, "layer_types": _SLIDE_FULL}),
    Architecture("qwen3_vl", "Qwen3-VL (image-text; text stack captured)", "Qwen3VLForConditionalGeneration", "Qwen3VLConfig",
                 "Qwen3-VL-8B", vision=dict(_VISION_QWEN, deepstack_visual_indexes=[0]), extra=_MM_IDS,
                 text={"rope_scaling": {"rope_type": "default", "mrope_section": [2, 3, 3], "mrope_interleaved": True}}),
    Architecture("gemma3", "Gemma 3 (image-text; text stack captured)", "Gemma3ForConditionalGeneration", "Gemma3Config",
                 "gemma-3-4b ... gemma-3-27b", vision=_VISION_SIGLIP,
                 extra={"mm_tokens_per_image": 4, "boi_token_index": 1016, "eoi_token_index": 1017,
                        "image_token_index": 1018},
                 text={"sliding_window": 8, "layer_types": _SLIDE_FULL}),
    Architecture("qwen3_5", "Qwen3.5 (hybrid linear attention, image-text)", "Qwen3_5ForConditionalGeneration", "Qwen3_5Config",
                 "Qwen3.5", vision=_VISION_QWEN, extra=_MM_IDS,
                 text={"linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
                       "linear_value_head_dim": 16,
                       "layer_types": ["linear_attention", "full_attention"] * (NUM_LAYERS // 2)},
                 chat_data=False),
)}

UNSUPPORTED: dict[str, str] = {
    "Checkpoints that need trust_remote_code": "refused: no code shipped with a checkpoint is ever run; "
    "the architecture must be in the installed transformers",
    "Encoder-decoder models (T5, BART)": "no decoder-only text stack: DFlash drafts from a causal LM's layers",
}
"""Rows that cannot work, and why (docs/targets.md lists them)."""


def missing_reason(arch: Architecture) -> str | None:
    """Why this row cannot be built with the installed transformers, or None."""
    import transformers
    missing = [name for name in (arch.config_class, arch.model_class) if not hasattr(transformers, name)]
    if missing:
        return f"transformers {transformers.__version__} has no {' / '.join(missing)}"
    return None


def tiny_config(arch: Architecture, tokenizer):
    """The tiny transformers config of `arch` for the tiny tokenizer."""
    import transformers
    text = {"vocab_size": tiny_vocab_size(tokenizer), "hidden_size": HIDDEN, "intermediate_size": 2 * HIDDEN,
            "num_hidden_layers": NUM_LAYERS, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "max_position_embeddings": 4096, "initializer_range": TINY_INITIALIZER_RANGE,
            "bos_token_id": None, "eos_token_id": tokenizer.convert_tokens_to_ids(IM_END),
            "pad_token_id": tokenizer.convert_tokens_to_ids(ENDOFTEXT), **arch.text}
    config_class = getattr(transformers, arch.config_class)
    if arch.vision is None:
        return config_class(**text)
    return config_class(text_config=text, vision_config=dict(arch.vision), **arch.extra)


def build_tiny_target_of(arch: Architecture, out_dir: str, *, seed: int = 0) -> str:
    """Write a random-weight tiny `arch` model (float32) and the tiny tokenizer to out_dir."""
    import torch
    import transformers

    reason = missing_reason(arch)
    if reason:
        raise RuntimeError(f"{arch.name}: {reason}")
    tokenizer = build_tiny_tokenizer()
    config = tiny_config(arch, tokenizer)
    write_random_model(out_dir, lambda: getattr(transformers, arch.model_class)(config).to(torch.float32).eval(),
                       tokenizer, seed=seed)
    with open(os.path.join(out_dir, "dflash_arch.json"), "w") as f:
        json.dump({"row": arch.name, "model_class": arch.model_class, "seed": seed}, f)
    return out_dir
