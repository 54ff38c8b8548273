"""The export's model card: Hub YAML front matter read back by huggingface_hub's own parser,
markdown with the training config, data, steps and the latest eval; the export's config.json
keys untouched."""

import json
import os

import pytest
import torch
import yaml
from click.testing import CliRunner
from huggingface_hub import ModelCard

from dflash_ipc.cli import main
from dflash_ipc.config.load import dump_config, load_config
from dflash_ipc.drafter.inference_format import CONFIG_KEYS, save_inference_checkpoint
from dflash_ipc.export.model_card import base_model_of
from dflash_ipc.run.eval_results import save_eval_results
from test_drafter_export import tiny_model

HUB_TARGET = "models--Qwen--Qwen3-8B/snapshots/0123abcd"


@pytest.fixture
def run_dir(tmp_path):
    """A run directory as a job leaves it: config.yaml, dataset meta, a checkpoint, evals."""
    run = tmp_path / "run"
    data = tmp_path / "data"
    data.mkdir()
    (data / "meta.json").write_text(json.dumps({"num_samples": 384, "num_tokens": 51234, "num_loss_tokens": 30001}))
    target = tmp_path / "hub" / HUB_TARGET
    cfg = load_config(None, [f"run.run_dir={run}", f"data.path={data}", f"target.path={target}", "data.num_epochs=3",
                             "drafter.num_workers=2", "objective.anchors_per_step=512", "optimizer.lr=3e-4"])
    run.mkdir()
    dump_config(cfg, str(run / "config.yaml"))
    save_inference_checkpoint(tiny_model(), str(run / "checkpoints" / "step_00000042"))
    (run / "checkpoints" / "latest.json").write_text(json.dumps({"step": 42, "path": "step_00000042"}))
    save_eval_results(str(run), [{"label": "old", "tau": 1.5, "acceptance_per_position": [0.4, 0.1, 0.0]}])
    trained = f"trained ({run}/checkpoints/step_00000042)"
    save_eval_results(str(run), [
        {"label": "untrained", "prompt_set": "held-out", "tau": 1.0, "acceptance_per_position": [0.0, 0.0, 0.0]},
        {"label": trained, "prompt_set": "held-out", "tau": 2.25, "acceptance_per_position": [0.75, 0.5, None],
         "num_prompts": 16, "max_new_tokens": 64, "sampling": {"temperature": 0.0}, "speedup": 1.8},
        {"label": "untrained", "prompt_set": "gsm8k", "tau": 1.0, "acceptance_per_position": [0.0, 0.0, 0.0]},
        {"label": trained, "prompt_set": "gsm8k", "tau": 1.5, "acceptance_per_position": [0.5, 0.25, 0.0],
         "num_prompts": 8, "tokens_per_s": 1234.5}], baseline=[True, False, True, False])
    return run


def _export(*args):
    result = CliRunner().invoke(main, ["export", *map(str, args)])
    assert result.exit_code == 0, result.output
    return result


def test_card_of_a_run_parses_and_names_the_base_model(run_dir, tmp_path):
    out = tmp_path / "qwen3-8b-dflash"
    result = _export(run_dir / "checkpoints", out)
    assert "README.md" in result.output
    assert sorted(os.listdir(out)) == ["README.md", "config.json", "model.safetensors"]
    config = json.loads((out / "config.json").read_text())
    assert tuple(config) == CONFIG_KEYS  # the serving format: no key added without --with-code
    card = ModelCard.load(out / "README.md")  # the Hub's own front-matter parser
    assert card.data.base_model == "Qwen/Qwen3-8B"  # from the Hub cache path of the target
    assert card.data.tags == ["dflash", "speculative-decoding", "draft-model", "block-diffusion", "dflash-ipc"]
    assert card.data.library_name is None and card.data.pipeline_tag is None
    text = card.text
    headings = [line for line in text.splitlines() if line.startswith("#")]
    assert headings == ["# qwen3-8b-dflash", "## Use", "## Training", "## Evaluation"]
    assert "--speculative-draft-model-path qwen3-8b-dflash" in text and '"num_speculative_tokens": 3' in text
    assert "- optimizer steps: 42" in text
    assert "- data: `data`, 384 samples, 51234 tokens (30001 with loss), 3 epoch(s)" in text
    assert "- drafter ranks: 2 (1 node(s)), 512 anchors per rank and step" in text
    config_block = text.split("```yaml\n")[1].split("```")[0]
    sections = yaml.safe_load(config_block)
    assert sections["optimizer"]["lr"] == 3e-4 and sections["target"]["path"] == "Qwen/Qwen3-8B"  # no local paths
    assert sections["data"]["path"] == "data" and "builtin" not in sections
    assert "run" not in sections and "dispatch" not in sections
    # every prompt set of the latest evaluation, trained results only, no local path
    assert "`dflash-ipc eval` of trained (step_00000042): speculative decoding (greedy, up to 64 new" in text
    assert str(run_dir) not in text
    assert "| held-out | 16 | **2.25** | - | 1.80x |" in text and "| gsm8k | 8 | **1.50** | 1,234 | - |" in text
    assert "| prompt set | 1 | 2 | 3 |" in text
    assert "| held-out | 0.75 | 0.50 | - |" in text and "| gsm8k | 0.50 | 0.25 | 0.00 |" in text
    assert "1.00" not in text.split("## Evaluation")[1]  # not the untrained baselines beside them


def test_base_model_and_repo_given_and_with_code(run_dir, tmp_path):
    out = tmp_path / "export"
    _export(run_dir / "checkpoints" / "step_00000042", out, "--with-code", "--base-model", "org/target",
            "--repo-id", "me/drafter")
    config = json.loads((out / "config.json").read_text())
    assert tuple(config) == (*CONFIG_KEYS, "auto_map")
    assert config["auto_map"] == {"AutoModel": "modeling_dflash.DFlashDraftModel"}
    card = ModelCard.load(out / "README.md")
    assert (card.data.base_model, card.data.library_name) == ("org/target", "transformers")
    assert 'AutoModel.from_pretrained("me/drafter", trust_remote_code=True' in card.text
    assert "vllm serve org/target" in card.text


def test_card_outside_a_run_directory(tmp_path):
    step = tmp_path / "somewhere" / "step_00000007"
    save_inference_checkpoint(tiny_model(), str(step), dtype=torch.float32)
    out = tmp_path / "export"
    _export(step, out)
    card = ModelCard.load(out / "README.md")
    assert card.data.base_model is None  # unknown: left out rather than guessed
    assert "- optimizer steps: 7" in card.text and "no training record" in card.text
    assert "No evaluation was saved" in card.text
    assert "sliding-window" not in card.text


def test_card_of_a_drafter_with_sliding_layers_says_so(tmp_path):
    step = tmp_path / "somewhere" / "step_00000007"
    model = tiny_model(layer_types=["sliding_attention", "full_attention"], sliding_window=5)
    save_inference_checkpoint(model, str(step), dtype=torch.float32)
    out = tmp_path / "export"
    _export(step, out)
    text = ModelCard.load(out / "README.md").text
    assert "Layer(s) 0 use sliding-window attention (window 5, causal in the block" in text


@pytest.mark.parametrize("path,hub_id", [
    ("/cache/hub/models--meta-llama--Llama-3.1-8B/snapshots/abc", "meta-llama/Llama-3.1-8B"),
    ("Qwen/Qwen3-8B", "Qwen/Qwen3-8B"),          # a Hub id given as the target path
    ("/models/Qwen3-8B", None), (None, None),    # a plain local directory says nothing
])
def test_base_model_of(path, hub_id):
    assert base_model_of(path) == hub_id


def test_a_run_without_a_local_dataset_reads_no_meta_json_of_the_working_directory(tmp_path, monkeypatch):
    from dflash_ipc.export.model_card import _dataset_meta
    (tmp_path / "meta.json").write_text(json.dumps({"num_samples": 7}))
    monkeypatch.chdir(tmp_path)
    assert _dataset_meta(None) is None and _dataset_meta("") is None and _dataset_meta("builtin:synthetic") is None
    assert _dataset_meta(str(tmp_path)) == {"num_samples": 7}
    (tmp_path / "meta.json").write_text("[" * 100_000)  # damaged: no card facts, no crash
    assert _dataset_meta(str(tmp_path)) is None
