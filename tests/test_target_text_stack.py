"""Finding a target's text stack: config truncation, the decoder search, the load report."""

import json
import logging

import pytest
import torch
import transformers
from torch import nn

from dflash_ipc.errors import ConfigError, DataError
from architectures import ARCHITECTURES, build_tiny_target_of, tiny_config
from dflash_ipc.builtin.tiny import build_tiny_tokenizer
from dflash_ipc.hf.target_config import load_target_config
from dflash_ipc.target.capture import FeatureCapture
from dflash_ipc.hf.text_stack import (find_text_stack, has_recurrent_layers, load_causal_lm, num_text_layers,
                                          text_config, truncated_config)

from target_helpers import drop_weight

torch.set_num_threads(1)


def config_of(key):
    return tiny_config(ARCHITECTURES[key], build_tiny_tokenizer())


def test_truncation_cuts_every_per_layer_list_of_the_text_config_and_copies():
    for key, kinds in (("qwen3_next", ["linear_attention", "full_attention", "linear_attention"]),
                       ("gpt_oss", ["sliding_attention", "full_attention", "sliding_attention"]),
                       ("gemma3", ["sliding_attention", "full_attention", "sliding_attention"])):
        config = config_of(key)
        cut = truncated_config(config, 3)
        assert num_text_layers(cut) == 3 and text_config(cut).layer_types == kinds, key
        assert num_text_layers(config) == 4 and len(text_config(config).layer_types) == 4  # original untouched
    multimodal = config_of("qwen3_vl")
    assert text_config(multimodal) is multimodal.text_config  # the nested object, not the wrapper
    assert num_text_layers(truncated_config(multimodal, 2)) == 2
    with pytest.raises(ConfigError, match="cannot keep 5 of the target's 4 layers"):
        truncated_config(multimodal, 5)


def test_recurrent_layers_are_told_from_attention_layers():
    assert has_recurrent_layers(config_of("qwen3_next"))
    assert not has_recurrent_layers(config_of("gpt_oss")) and not has_recurrent_layers(config_of("qwen3"))


def test_the_search_finds_a_multimodal_decoder_and_refuses_a_model_without_one():
    model = transformers.Qwen3VLForConditionalGeneration(config_of("qwen3_vl"))
    stack = find_text_stack(model)
    assert stack.name == "model.language_model" and len(stack.layers) == 4
    assert stack.embed_tokens is model.get_input_embeddings() and stack.lm_head is model.lm_head

    class VisionOnly(nn.Module):  # a block list but no token embedding beside it
        def __init__(self):
            super().__init__()
            self.config = config_of("qwen3")
            self.blocks = nn.ModuleList(nn.Linear(2, 2) for _ in range(4))
            self.patch = nn.Linear(2, 2)
    with pytest.raises(ConfigError, match="no text decoder found.*docs/targets.md"):
        find_text_stack(VisionOnly())


def test_capture_logs_one_line_instead_of_the_load_report(tmp_path, caplog):
    target = build_tiny_target_of(ARCHITECTURES["gemma3"], str(tmp_path / "t"))
    caplog.set_level(logging.INFO)
    capture = FeatureCapture(target, layer_ids=[0, 1], dtype="float32", attn_implementation="sdpa", device="cpu")
    text = caplog.text
    assert "LOAD REPORT" not in text and "UNEXPECTED" not in text and "not sharded" not in text
    assert "Gemma3TextModel" in text and "loaded 2 of 4 layers; 26 tensors of layers 2..3 not read" in text
    assert type(capture.decoder).__name__ == "Gemma3TextModel"  # only the text stack was kept


def test_missing_text_stack_weights_stop_the_capture(tmp_path):
    target = build_tiny_target_of(ARCHITECTURES["qwen3"], str(tmp_path / "t"))
    drop_weight(target, "model.layers.0.mlp.up_proj.weight")
    with pytest.raises(DataError, match=r"1 weights of the text stack are missing.*layers\.0\.mlp\.up_proj"):
        FeatureCapture(target, layer_ids=[0, 1], dtype="float32", attn_implementation="sdpa", device="cpu")
    with pytest.raises(DataError, match="1 weights are missing"):
        load_causal_lm(target, dtype=torch.float32)


def test_an_attention_the_architecture_lacks_falls_back_with_a_warning(tmp_path, caplog):
    target = build_tiny_target_of(ARCHITECTURES["gpt_oss"], str(tmp_path / "t"))
    capture = FeatureCapture(target, layer_ids=[1], dtype="float32", attn_implementation="sdpa", device="cpu")
    assert capture.attn_implementation == "eager"
    assert "has no sdpa attention in transformers; using eager" in caplog.text


def test_an_unknown_architecture_is_a_config_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "not_a_real_arch", "auto_map": {}}))
    with pytest.raises(ConfigError, match="trust_remote_code are not supported"):
        load_target_config(str(tmp_path))


class _Planted:
    """Unpickled, it would create a file: proof that a pickle was (or was not) loaded."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_target_whose_only_weights_are_pickled_is_one_error_and_nothing_is_unpickled(tmp_path):
    import os
    import pickle
    target = build_tiny_target_of(ARCHITECTURES["qwen3"], str(tmp_path / "t"))
    os.unlink(os.path.join(target, "model.safetensors"))
    marker = tmp_path / "unpickled"
    with open(os.path.join(target, "pytorch_model.bin"), "wb") as f:
        pickle.dump(_Planted(str(marker)), f)
    with pytest.raises(DataError, match=r"no model.safetensors .*it holds only pytorch_model.bin: pickled weights, "
                                        r"never loaded") as info:
        load_causal_lm(target, dtype=torch.float32)
    assert "\n" not in str(info.value)
    with pytest.raises(DataError, match="never loaded"):
        FeatureCapture(target, layer_ids=[0, 1], dtype="float32", attn_implementation="sdpa", device="cpu")
    assert not marker.exists()
