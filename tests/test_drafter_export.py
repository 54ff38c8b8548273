"""Inference export: exact config keys and tensor names (Qwen3-8B shape on meta), round trip."""

import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import Qwen3Config

from dflash_ipc.drafter.attention import build_layer_masks
from dflash_ipc.drafter.inference_format import (
    CONFIG_KEYS,
    expected_tensor_shapes,
    export_training_checkpoint,
    inference_config,
    load_inference_checkpoint,
    save_inference_checkpoint,
)
from dflash_ipc.drafter.model import DFlashConfig, DFlashDraftModel
from dflash_ipc.drafter.objective import build_training_batch
from dflash_ipc.errors import ConfigError, DataError

torch.set_num_threads(1)

QWEN3_8B = dict(hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                head_dim=128, intermediate_size=12288, vocab_size=151936, rms_norm_eps=1e-6,
                rope_theta=1000000, max_position_embeddings=40960)

WANT_KEYS = (
    "architectures", "model_type", "block_size", "dflash_config", "num_target_layers", "hidden_size",
    "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "hidden_act", "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters", "max_position_embeddings",
    "vocab_size", "attention_bias", "attention_dropout", "tie_word_embeddings", "layer_types",
    "use_sliding_window", "sliding_window", "max_window_layers", "initializer_range", "use_cache",
    "torch_dtype", "dtype",
)
PER_LAYER = ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
             "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
             "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
             "input_layernorm.weight", "post_attention_layernorm.weight"]


def qwen3_8b_drafter_config() -> DFlashConfig:
    return DFlashConfig.from_target_config(Qwen3Config(**QWEN3_8B), mask_token_id=151669)


def test_qwen3_8b_config_json_exact():
    d = inference_config(qwen3_8b_drafter_config())
    assert tuple(d) == WANT_KEYS == CONFIG_KEYS
    assert d["architectures"] == ["DFlashDraftModel"] and d["model_type"] == "qwen3"
    assert d["dflash_config"] == {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]}
    assert (d["block_size"], d["num_target_layers"], d["num_hidden_layers"]) == (16, 36, 5)
    assert (d["hidden_size"], d["intermediate_size"], d["head_dim"], d["vocab_size"]) == (4096, 12288, 128, 151936)
    assert (d["num_attention_heads"], d["num_key_value_heads"]) == (32, 8)
    assert d["layer_types"] == ["full_attention"] * 5 and d["use_sliding_window"] is False
    assert d["hidden_act"] == "silu" and d["attention_bias"] is False and d["tie_word_embeddings"] is False
    assert d["torch_dtype"] == d["dtype"] == "bfloat16"
    assert d["rope_theta"] == 1e6 and d["rope_scaling"] is None
    assert d["rope_parameters"] == {"rope_type": "default", "rope_theta": 1e6}
    json.dumps(d)  # serialisable as is


def test_config_json_loads_as_transformers_qwen3_config():
    hf = Qwen3Config.from_dict(inference_config(qwen3_8b_drafter_config()))
    assert (hf.hidden_size, hf.num_hidden_layers, hf.head_dim, hf.num_key_value_heads) == (4096, 5, 128, 8)
    assert hf.dflash_config["target_layer_ids"] == [1, 9, 17, 25, 33]
    rope = getattr(hf, "rope_parameters", None) or {"rope_theta": hf.rope_theta}
    assert rope["rope_theta"] == 1e6


def test_qwen3_8b_tensor_names_and_shapes_on_meta():
    cfg = qwen3_8b_drafter_config()
    with torch.device("meta"):
        model = DFlashDraftModel(cfg)
    got = {n: tuple(t.shape) for n, t in model.state_dict().items()}
    names = {"fc.weight", "hidden_norm.weight", "norm.weight"} | {
        f"layers.{i}.{p}" for i in range(5) for p in PER_LAYER}
    assert set(got) == names and got == expected_tensor_shapes(cfg)
    assert got["fc.weight"] == (4096, 5 * 4096)
    assert got["layers.4.self_attn.k_proj.weight"] == (1024, 4096)
    assert got["layers.0.mlp.down_proj.weight"] == (4096, 12288)
    assert got["layers.2.self_attn.q_norm.weight"] == (128,)
    per_layer = 2 * 4096 * 4096 + 2 * 1024 * 4096 + 3 * 4096 * 12288 + 2 * 128 + 2 * 4096
    assert model.num_parameters() == 5 * per_layer + 4096 * 20480 + 2 * 4096  # 1.05B, as in DESIGN.md
    assert not any(t.is_floating_point() and t.device.type != "meta" for t in model.parameters())


def tiny_model(seed=0, layer_types=None, sliding_window=None) -> DFlashDraftModel:
    torch.manual_seed(seed)
    num_layers = len(layer_types) if layer_types else 2
    cfg = DFlashConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=num_layers, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=8, vocab_size=61, mask_token_id=60,
                       target_layer_ids=[0, 2], num_target_layers=3, block_size=4,
                       rope_scaling={"rope_type": "linear", "factor": 2.0}, layer_types=layer_types,
                       sliding_window=sliding_window)
    model = DFlashDraftModel(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)  # norms away from 1 so a lost norm weight shows
    return model


def forward(model):
    gen = torch.Generator().manual_seed(1)
    cfg = model.config
    ids = torch.randint(0, 60, (20,), generator=gen)
    batch = build_training_batch(ids, torch.ones(20, dtype=torch.bool), torch.tensor([0, 12, 20]),
                                 [torch.tensor([0, 5, 9]), torch.tensor([2])], block_size=4,
                                 mask_token_id=cfg.mask_token_id, gamma=7.0)
    features = torch.randn(20, 2 * cfg.hidden_size, generator=gen)
    embeds = torch.randn(len(batch.block_ids), cfg.hidden_size, generator=gen)
    dtype = next(model.parameters()).dtype
    with torch.no_grad():
        return model(features.to(dtype), batch.context_positions, embeds.to(dtype), batch.block_positions,
                     build_layer_masks(batch.layout, "dense", cfg.layer_types, cfg.sliding_window))


def test_round_trip_float32_is_exact(tmp_path):
    model = tiny_model()
    out = tmp_path / "export"
    save_inference_checkpoint(model, str(out), dtype=torch.float32)
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    assert [p for p in os.listdir(tmp_path) if p != "export"] == []  # no temp dirs left behind
    # The weights are as readable as the config beside them (a server may run as another user).
    assert os.stat(out / "model.safetensors").st_mode & 0o777 == os.stat(out / "config.json").st_mode & 0o777
    loaded = load_inference_checkpoint(str(out))
    assert loaded.config == model.config
    torch.testing.assert_close(forward(loaded), forward(model), rtol=0, atol=0)


def test_sliding_layers_export_the_fields_servers_read_and_round_trip(tmp_path):
    """layer_types per layer and sliding_window (SGLang, vLLM), use_sliding_window (without it
    transformers' Qwen3Config drops the window); the model reads back with its layer types."""
    model = tiny_model(layer_types=["sliding_attention", "full_attention"], sliding_window=5)
    d = inference_config(model.config)
    assert d["layer_types"] == ["sliding_attention", "full_attention"]
    assert (d["use_sliding_window"], d["sliding_window"]) == (True, 5)
    hf = Qwen3Config.from_dict(d)
    assert hf.layer_types == ["sliding_attention", "full_attention"] and hf.sliding_window == 5
    out = tmp_path / "export"
    save_inference_checkpoint(model, str(out), dtype=torch.float32)
    loaded = load_inference_checkpoint(str(out))
    assert loaded.config == model.config and [layer.layer_type for layer in loaded.layers] == d["layer_types"]
    torch.testing.assert_close(forward(loaded), forward(model), rtol=0, atol=0)
    assert not torch.equal(forward(model), forward(tiny_model()))  # the window changed the output
    d["use_sliding_window"] = False
    with pytest.raises(ConfigError, match="sliding_attention layers but use_sliding_window is false"):
        DFlashConfig.from_hf_dict(d)
    with pytest.raises(ConfigError, match="drafter layers of type \\['sliding_attention'\\] got no mask"):
        model(torch.zeros(2, 64), torch.arange(2), torch.zeros(4, 32), torch.arange(2, 6),
              torch.ones(4, 6, dtype=torch.bool))


def test_round_trip_bfloat16_and_overwrite(tmp_path):
    out = tmp_path / "export"
    save_inference_checkpoint(tiny_model(seed=1), str(out))  # an older export to replace
    model = tiny_model(seed=2)
    save_inference_checkpoint(model, str(out))
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert set(f.keys()) == set(expected_tensor_shapes(model.config))
        assert all(f.get_slice(k).get_dtype() == "BF16" for k in f.keys())
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    loaded = load_inference_checkpoint(str(out), dtype=torch.float32)
    torch.testing.assert_close(forward(loaded), forward(model.to(torch.bfloat16).float()), rtol=0, atol=0)
    assert sorted(os.listdir(tmp_path)) == ["export"]


def test_load_rejects_incomplete_exports(tmp_path):
    model = tiny_model()
    out = tmp_path / "export"
    with pytest.raises(DataError, match="config.json"):
        load_inference_checkpoint(str(out))
    save_inference_checkpoint(model, str(out), dtype=torch.float32)
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "norm.weight"}
    save_file(state, str(out / "model.safetensors"))
    with pytest.raises(DataError, match="norm.weight"):
        load_inference_checkpoint(str(out))
    state["norm.weight"] = torch.ones(31)
    save_file(state, str(out / "model.safetensors"))
    with pytest.raises(DataError, match=r"norm.weight has shape \(31,\)"):
        load_inference_checkpoint(str(out))


def _int_weights(out):
    state = {k: v.to(torch.int32) for k, v in tiny_model().state_dict().items()}
    save_file(state, str(out / "model.safetensors"))


def _edit_config(out, **kw):
    config = json.loads((out / "config.json").read_text())
    config.update(kw)
    (out / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("damage, needle", [
    (lambda o: (o / "config.json").write_text("[" * 100_000), r"config.json: drafter config unreadable \(nested"),
    (lambda o: (o / "config.json").write_text("[1]"), "config.json: drafter config is not a JSON object"),
    (lambda o: (o / "config.json").write_bytes(b"\xff\xfe\xfd"), "config.json: drafter config is not"),
    (lambda o: (o / "config.json").write_text('{"rms_norm_eps": NaN}'), "NaN is not a JSON number"),
    (lambda o: _edit_config(o, hidden_size="wide"), "config.json: hidden_size must be an integer, got .wide."),
    (lambda o: _edit_config(o, dflash_config={"target_layer_ids": 5}), "config.json"),
    (lambda o: (o / "model.safetensors").write_bytes(b"garbage"), "model.safetensors: unreadable"),
    (lambda o: (o / "model.safetensors").write_bytes((10**15).to_bytes(8, "little") + b"{}"),
     "model.safetensors: unreadable"),
    (lambda o: os.truncate(o / "model.safetensors", os.path.getsize(o / "model.safetensors") // 2),
     "model.safetensors: unreadable"),
    (_int_weights, "is torch.int32, not a floating-point tensor"),
])
def test_a_damaged_or_crafted_export_is_one_line_naming_the_file(tmp_path, damage, needle):
    out = tmp_path / "export"
    save_inference_checkpoint(tiny_model(), str(out), dtype=torch.float32)
    damage(out)
    with pytest.raises(DataError, match=needle) as info:
        load_inference_checkpoint(str(out))
    assert "\n" not in str(info.value) and len(str(info.value)) < 500



def test_a_config_claiming_more_layers_than_the_weights_is_refused_before_allocating(tmp_path):
    import tracemalloc
    out = tmp_path / "export"
    save_inference_checkpoint(tiny_model(), str(out), dtype=torch.float32)
    exported = json.loads((out / "config.json").read_text())
    for layers, layer_types in ((1_000_000, "as exported"), (100_000_000, "as exported"), (100_000_000, None),
                                (1, None)):
        config = dict(exported, num_hidden_layers=layers)
        if layer_types is None:
            del config["layer_types"]  # DFlashConfig would make one entry per claimed layer
        (out / "config.json").write_text(json.dumps(config))
        tracemalloc.start()
        with pytest.raises(DataError, match=f"holds 2 layers, but config.json beside it says num_hidden_layers "
                                            f"{layers}"):
            load_inference_checkpoint(str(out))
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert peak < 16 << 20, peak  # nothing sized by the claim


@pytest.mark.timeout(10)
def test_an_export_file_that_is_not_a_regular_file_inside_the_export_is_refused(tmp_path):
    out = tmp_path / "export"
    save_inference_checkpoint(tiny_model(), str(out), dtype=torch.float32)
    elsewhere = tmp_path / "elsewhere.safetensors"
    os.replace(out / "model.safetensors", elsewhere)
    for make, needle in ((lambda p: os.symlink("/dev/zero", p), "is a character device"),
                         (os.mkfifo, "is a FIFO"),
                         (lambda p: os.symlink(elsewhere, p), "is a symlink to .*, outside")):
        make(out / "model.safetensors")
        with pytest.raises(DataError, match=f"model.safetensors: a drafter export file {needle}"):
            load_inference_checkpoint(str(out))
        os.unlink(out / "model.safetensors")
    os.symlink("../elsewhere.safetensors", out / "model.safetensors")
    with pytest.raises(DataError, match="outside"):
        load_inference_checkpoint(str(out))
    os.unlink(out / "model.safetensors")
    os.replace(elsewhere, out / "real.safetensors")
    os.symlink("real.safetensors", out / "model.safetensors")  # a symlink inside the export is fine
    assert load_inference_checkpoint(str(out)).config == tiny_model().config


def test_export_never_removes_a_directory_that_is_not_an_earlier_export(tmp_path):
    from dflash_ipc.drafter.inference_format import EXPORT_FILES, export_step_dir
    from dflash_ipc.export.hub_code import MODELING_FILE
    from dflash_ipc.export.model_card import CARD_FILE
    assert set(EXPORT_FILES) == {"config.json", "model.safetensors", CARD_FILE, MODELING_FILE}
    src = tmp_path / "src"
    save_inference_checkpoint(tiny_model(), str(src), dtype=torch.float32)
    mine = tmp_path / "mine"
    mine.mkdir()
    for name in ("notes.txt", "data.bin", "config.json"):
        (mine / name).write_text(name)
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (foreign / "model.safetensors").write_bytes(b"weights of another model")
    for out, needle in ((mine, "it holds data.bin, notes.txt"),
                        (foreign, r"its config.json has architectures \['LlamaForCausalLM'\]")):
        before = {p.name: p.read_bytes() for p in out.iterdir()}
        for write in (lambda: export_step_dir(str(src), str(out)), lambda: save_inference_checkpoint(tiny_model(), str(out))):
            with pytest.raises(DataError, match=f"exists and is not an earlier export .*{needle}.*nothing in it is removed"):
                write()
            assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    (tmp_path / "afile").write_text("x")
    with pytest.raises(DataError, match="exists and is not a directory"):
        save_inference_checkpoint(tiny_model(), str(tmp_path / "afile"))
    empty = tmp_path / "empty"
    empty.mkdir()
    export_step_dir(str(src), str(empty))  # an empty directory, then an earlier export, are written to
    (empty / "README.md").write_text("card")
    export_step_dir(str(src), str(empty))
    assert sorted(os.listdir(empty)) == ["config.json", "model.safetensors"]
    assert sorted(os.listdir(tmp_path)) == ["afile", "empty", "foreign", "mine", "src"]  # no temp dirs left

def test_export_training_checkpoint_prefers_full_precision_state(tmp_path):
    from safetensors.torch import save_file

    from dflash_ipc.run.checkpoints import STATE_TENSORS

    model = tiny_model(seed=3)
    step = tmp_path / "ckpt" / "step_00000007"
    save_inference_checkpoint(model, str(step))  # bf16, as the trainer writes it
    save_file({f"model.{n}": t.contiguous() for n, t in model.state_dict().items()}, str(step / STATE_TENSORS))
    (tmp_path / "ckpt" / "latest.json").write_text(json.dumps({"step": 7, "path": "step_00000007"}))
    for source in (tmp_path / "ckpt", step):  # the root (via latest.json) or the step itself
        out = tmp_path / f"out-{source.name}"
        assert export_training_checkpoint(str(source), str(out), dtype=torch.float32) == str(out)
        loaded = load_inference_checkpoint(str(out))
        for name, t in model.state_dict().items():
            torch.testing.assert_close(loaded.state_dict()[name], t, rtol=0, atol=0)  # not bf16-rounded
    with pytest.raises(DataError, match="latest.json"):
        export_training_checkpoint(str(tmp_path), str(tmp_path / "x"))


def test_a_hub_snapshot_may_link_to_its_own_blobs_and_nowhere_else(tmp_path):
    """The Hub cache stores a snapshot's files as links to `<repo>/blobs/`: those resolve inside the
    repository's cache folder and are read; a link out of the repository is still refused."""
    from dflash_ipc.errors import DataError
    from dflash_ipc.run.regular_file import regular_file
    repo = tmp_path / "models--org--drafter"
    snapshot = repo / "snapshots" / ("0" * 40)
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    (repo / "blobs" / "abc").write_bytes(b"{}")
    os.symlink("../../blobs/abc", snapshot / "config.json")
    assert regular_file(str(snapshot / "config.json"), "a drafter export file", inside=str(snapshot)) == 2
    (tmp_path / "elsewhere").write_bytes(b"x")
    os.symlink(str(tmp_path / "elsewhere"), snapshot / "model.safetensors")
    with pytest.raises(DataError, match="outside"):
        regular_file(str(snapshot / "model.safetensors"), "a drafter export file", inside=str(snapshot))
