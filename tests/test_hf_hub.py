"""Hub ids wherever a model or a dataset is named, resolved through a local cache laid out as
huggingface_hub lays it out (tests/hub_cache.py), HF_HUB_OFFLINE=1: no network."""

import json
import os

import pytest

from hub_cache import cache_repo

from dflash_ipc.builtin.tiny import TINY_VOCAB_WORDS, build_tiny_tokenizer
from dflash_ipc.errors import ConfigError
from dflash_ipc.hf.hub import resolve_dataset, resolve_model

W = TINY_VOCAB_WORDS


@pytest.fixture
def hub(tmp_path, monkeypatch):
    cache = tmp_path / "hf-cache"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def _files(folder, files: dict) -> str:
    for name, text in files.items():
        os.makedirs(os.path.dirname(os.path.join(folder, name)), exist_ok=True)
        with open(os.path.join(folder, name), "w") as f:
            f.write(text)
    return str(folder)


def test_a_hub_id_is_its_cached_snapshot_and_a_local_path_stays_a_path(hub, tmp_path, monkeypatch):
    snapshot = cache_repo(hub, "org/model", _files(tmp_path / "m", {"config.json": "{}"}))
    data = cache_repo(hub, "org/chats", _files(tmp_path / "d", {"data/train.jsonl": "{}\n"}), repo_type="dataset")
    assert resolve_model("org/model", what="target.path") == snapshot
    assert resolve_dataset("org/chats", what="--input") == data
    assert open(os.path.join(data, "data", "train.jsonl")).read() == "{}\n"
    monkeypatch.chdir(tmp_path)
    os.makedirs("org/model")  # a local directory of that name wins over the Hub
    assert resolve_model("org/model", what="target.path") == "org/model"
    # a path that is neither: named, not left to transformers ("Repo id must be in the form ...")
    with pytest.raises(ConfigError, match=r"^target\.path: /abs/missing: no such model directory .*ORG/NAME"):
        resolve_model("/abs/missing", what="target.path")
    with pytest.raises(ConfigError, match=r"^--target: no-such-model: no such model directory"):
        resolve_model("no-such-model", what="--target")


def test_offline_and_not_cached_is_one_error_saying_how_to_download(hub):
    with pytest.raises(ConfigError) as err:
        resolve_model("Qwen/Qwen3-8B", what="target.path")
    message = str(err.value)
    assert message.startswith("target.path: Qwen/Qwen3-8B is not a local path and not in the Hugging Face cache")
    assert "HF_HUB_OFFLINE=1" in message and "`hf download Qwen/Qwen3-8B`" in message
    with pytest.raises(ConfigError, match=r"--input: org/none .*`hf download org/none --repo-type dataset`"):
        resolve_dataset("org/none", what="--input")


def test_target_path_is_resolved_before_the_job_reads_it(hub, tiny_cache, tmp_path):
    from dflash_ipc.config.load import load_config
    from dflash_ipc.errors import DataError
    from dflash_ipc.target.resolve import resolve_job
    snapshot = cache_repo(hub, "org/tiny", os.path.join(tiny_cache, "tiny-target"))
    cfg = load_config(None, ["target.path=org/tiny", f"data.path={tmp_path / 'no-data'}", "model.num_layers=2",
                             f"run.run_dir={tmp_path / 'run'}"])
    # Past the target (its config read from the snapshot), to the data: the next check.
    with pytest.raises(DataError, match="no-data"):
        resolve_job(cfg)
    with pytest.raises(ConfigError, match="target.path: org/absent is not a local path"):
        resolve_job(load_config(None, ["target.path=org/absent", f"data.path={tmp_path / 'no-data'}",
                                       f"run.run_dir={tmp_path / 'run'}"]))
    assert os.path.isfile(os.path.join(snapshot, "config.json"))


def test_prepare_takes_a_hub_model_and_a_hub_dataset(hub, tmp_path):
    from click.testing import CliRunner

    from dflash_ipc.cli import main
    from dflash_ipc.data.dataset import TokenDataset
    build_tiny_tokenizer().save_pretrained(str(tmp_path / "tok"))
    cache_repo(hub, "org/tiny", str(tmp_path / "tok"))
    rows = [{"messages": [{"role": "user", "content": f"{W[1]} {W[2]}"},
                          {"role": "assistant", "content": f"{W[3]} {W[i]}"}]} for i in range(4, 10)]
    cache_repo(hub, "org/chats", _files(tmp_path / "d", {"data/train-00000-of-00001.jsonl":
                                                         "".join(json.dumps(r) + "\n" for r in rows)}),
               repo_type="dataset")
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["prepare", "--model", "org/tiny", "--input", "org/chats", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert len(TokenDataset(str(out))) == len(rows)


def test_eval_prompts_from_a_hub_dataset(hub, tmp_path):
    from dflash_ipc.eval.speculative import prompt_sets
    rows = [{"question": f"{W[i]} ?"} for i in range(3)] + [{"turns": [W[5], W[6]]}]
    cache_repo(hub, "org/gsm", _files(tmp_path / "p", {"test.jsonl": "".join(json.dumps(r) + "\n" for r in rows)}),
               repo_type="dataset")
    (prompts,) = prompt_sets("unused", prompt_files=["org/gsm"])
    assert prompts.name == "gsm" and [c.turns for c in prompts.cases] == [[f"{W[i]} ?"] for i in range(3)] + [[W[5], W[6]]]
    (limited,) = prompt_sets("unused", prompt_files=["math=org/gsm"], num_prompts=2)
    assert limited.name == "math" and len(limited.cases) == 2


def test_init_from_a_hub_id(hub, tmp_path):
    import torch

    from dflash_ipc.config.load import load_config
    from dflash_ipc.drafter.inference_format import save_inference_checkpoint
    from dflash_ipc.drafter.model import DFlashConfig, DFlashDraftModel
    from dflash_ipc.drafter.warm_start import read_init_weights, resolve_init_from
    target = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4, "num_attention_heads": 2,
              "num_key_value_heads": 1, "head_dim": 16, "vocab_size": 64}
    job = DFlashConfig.from_target_config(target, num_draft_layers=1, block_size=4, mask_token_id=63,
                                          target_layer_ids=[0, 1])
    model = DFlashDraftModel(job)
    save_inference_checkpoint(model, str(tmp_path / "export"), dtype=torch.float32)
    snapshot = cache_repo(hub, "org/drafter", str(tmp_path / "export"))
    cfg = load_config(None, [f"run.run_dir={tmp_path / 'run'}", "drafter.init_from=org/drafter",
                             "model.num_layers=1", "model.block_size=4", "model.mask_token_id=63",
                             "model.target_layer_ids=[0,1]"])
    resolve_init_from(cfg, target)
    assert cfg.drafter.init_from == snapshot
    weights = read_init_weights("org/drafter", job)
    assert all(torch.equal(weights[n], t) for n, t in model.state_dict().items())


def test_regenerate_reads_a_hub_dataset_and_names_one_not_cached(hub, tmp_path):
    from dflash_ipc.errors import DataError
    from dflash_ipc.regenerate.options import GenerationOptions
    from dflash_ipc.regenerate.run import regenerate
    options = GenerationOptions(max_new_tokens=4)
    with pytest.raises(ConfigError, match=r"--input: org/none is not a local path and not in the Hugging Face cache"):
        regenerate("org/none", str(tmp_path / "out.jsonl"), None, options)
    snapshot = cache_repo(hub, "org/empty", _files(tmp_path / "e", {"train.jsonl": "\n"}), repo_type="dataset")
    with pytest.raises(DataError, match=f"{snapshot}: the input is empty"):  # read from the snapshot: no backend needed
        regenerate("org/empty", str(tmp_path / "out.jsonl"), None, options)
