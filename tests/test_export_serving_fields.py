"""The sliding-window fields of an export's config.json, read as SGLang and vLLM read them
(through transformers' AutoConfig, then their per-layer rules: serving_loaders.py), give every
layer the attention it was trained with; and `dflash-ipc export` says what serving needs."""

import json

import pytest
import torch
from click.testing import CliRunner
from transformers import AutoConfig, Qwen3Config

from dflash_ipc.cli import main
from dflash_ipc.drafter.inference_format import save_inference_checkpoint
from dflash_ipc.drafter.model import qwen2_max_window_layers
from dflash_ipc.export.serving_notes import sliding_layout_notes
from serving_loaders import sglang_layers, trained_layers, vllm_layers
from test_drafter_export import tiny_model

torch.set_num_threads(1)

S, F = "sliding_attention", "full_attention"
# Keys that would override the loaders' per-layer defaults (which are the trainer's rule).
OVERRIDES = ("is_causal", "use_swa", "swa_window_size", "causal")


def _export(tmp_path, layer_types=None, window=None):
    out = tmp_path / "export"
    save_inference_checkpoint(tiny_model(layer_types=layer_types, sliding_window=window), str(out),
                              dtype=torch.float32)
    return out, json.loads((out / "config.json").read_text())


def test_an_ssf_export_carries_the_window_sglang_and_vllm_apply_per_layer(tmp_path):
    out, d = _export(tmp_path, [S, S, F], window=6)
    assert d["layer_types"] == [S, S, F]
    assert (d["use_sliding_window"], d["sliding_window"], d["max_window_layers"]) == (True, 6, 3)
    assert d["dflash_config"] == {"mask_token_id": 60, "target_layer_ids": [0, 2]}
    assert not set(OVERRIDES) & (set(d) | set(d["dflash_config"]))
    hf = AutoConfig.from_pretrained(str(out))  # what both servers hold
    assert isinstance(hf, Qwen3Config) and hf.sliding_window == 6 and hf.layer_types == [S, S, F]
    assert getattr(hf, "is_causal", None) is None  # transformers adds none either
    assert sglang_layers(hf) == [(5, True), (5, True), (-1, False)]
    assert vllm_layers(hf) == trained_layers([S, S, F], 6) == [(6, True), (6, True), (None, False)]


def test_the_fields_the_export_leaves_out_would_change_what_the_servers_run(tmp_path):
    """Why is_causal, use_sliding_window: false or a dflash_config window must not be written."""
    out, d = _export(tmp_path, [S, S, F], window=6)

    def loaded(**changes):
        (out / "config.json").write_text(json.dumps(dict(d, **changes)))
        return AutoConfig.from_pretrained(str(out))
    causal = loaded(is_causal=True)  # one value for every layer: the full one turns causal
    assert sglang_layers(causal)[2] == (-1, True) and vllm_layers(causal)[2] == (None, True)
    gated = loaded(use_sliding_window=False)
    assert gated.sliding_window is None  # transformers drops the window without the flag
    with pytest.raises(ValueError, match="require config.sliding_window"):
        sglang_layers(gated)
    # vLLM reads a dflash_config window before sliding_window; SGLang does not read it at all.
    other = loaded(dflash_config=dict(d["dflash_config"], swa_window_size=9))
    assert vllm_layers(other)[0] == (9, True) and sglang_layers(other)[0] == (5, True)


def test_a_full_attention_export_has_no_window_for_any_loader(tmp_path):
    out, d = _export(tmp_path)
    assert d["layer_types"] == [F, F]
    assert (d["use_sliding_window"], d["sliding_window"], d["max_window_layers"]) == (False, None, 2)
    assert not set(OVERRIDES) & (set(d) | set(d["dflash_config"]))
    hf = AutoConfig.from_pretrained(str(out))
    assert hf.sliding_window is None
    assert sglang_layers(hf) == [(-1, False), (-1, False)]
    assert vllm_layers(hf) == trained_layers([F, F], None) == [(None, False), (None, False)]
    assert sliding_layout_notes(d) == []


@pytest.mark.parametrize("layer_types, qwen2", [
    ([F, F, F], 3), ([F, S, S], 1), ([S, S, S], 0), ([S, S, F], None), ([S, F, S], None),
])
def test_max_window_layers_states_the_layout_in_qwen2_form_where_it_can(tmp_path, layer_types, qwen2):
    """Qwen2's form: layer i slides iff i >= max_window_layers (transformers' Qwen3Config builds
    layer_types from it when a config has none); other layouts write the layer count."""
    assert qwen2_max_window_layers(layer_types) == qwen2
    _, d = _export(tmp_path, layer_types, window=None if S not in layer_types else 4)
    assert d["max_window_layers"] == (3 if qwen2 is None else qwen2)
    if qwen2 is not None and S in layer_types:
        without = {k: v for k, v in d.items() if k != "layer_types"}
        assert Qwen3Config.from_dict(without).layer_types == layer_types


def test_the_notes_name_what_serving_a_sliding_layout_needs():
    def notes(layer_types):
        return sliding_layout_notes({"layer_types": layer_types, "sliding_window": 2048,
                                     "max_window_layers": len(layer_types)})
    mixed = notes([S, S, S, S, F])
    assert mixed[0].startswith("layers 0, 1, 2, 3: sliding window 2048 (causal in the block); layer 4: full attention")
    assert any("V2 model runner" in n for n in mixed)
    assert any("--speculative-draft-window-size" in n for n in mixed)
    assert any(n.startswith("max_window_layers is 5: Qwen2's form") for n in mixed)
    every = notes([S, S])  # no full layer: nothing for vLLM's runner or SGLang's draft window
    assert len(every) == 1 and every[0].startswith("layers 0, 1: sliding window 2048")


def test_export_prints_the_notes_for_a_sliding_drafter_only(tmp_path):
    for name, kinds in (("sliding", [S, F]), ("full", None)):
        src = tmp_path / f"{name}-src"
        save_inference_checkpoint(tiny_model(layer_types=kinds, sliding_window=5 if kinds else None), str(src),
                                  dtype=torch.float32)
        result = CliRunner().invoke(main, ["export", str(src), str(tmp_path / name)])
        assert result.exit_code == 0, result.output
        lines = [line for line in result.output.splitlines() if line.startswith("note: ")]
        if kinds:
            assert lines[0] == ("note: layer 0: sliding window 5 (causal in the block); layer 1: full attention, "
                                "in config.json's layer_types, use_sliding_window and sliding_window, which SGLang "
                                "and vLLM apply per layer")
            assert len(lines) == 4
        else:
            assert lines == []
