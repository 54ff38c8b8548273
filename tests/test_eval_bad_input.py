"""`dflash-ipc eval` on bad input: each is one clear error naming the option, file, line or field
(no traceback, nothing decoded first), and what was accepted before by mistake is refused."""

import json
import math
import os

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from transformers import AutoTokenizer

from dflash_ipc.cli import main
from dflash_ipc.drafter.inference_format import load_inference_checkpoint, save_inference_checkpoint
from dflash_ipc.errors import ConfigError, DataError
from dflash_ipc.eval import speculative
from dflash_ipc.eval.prompt_sets import (
    ChatRenderer,
    Conversations,
    PromptCase,
    PromptSet,
    check_token_ids,
    parse_row,
    read_prompt_file,
)
from dflash_ipc.eval.sampling import Sampling
from dflash_ipc.eval.speculative import EvalOptions, evaluate_sets
from dflash_ipc.run.eval_results import check_appendable
from eval_helpers import eval_data, random_drafter


def _eval(args: list[str], tmp_path):
    """`eval` in-process on directories that do not exist: an error raised before any model
    is loaded says so; one raised later would be about the missing target instead."""
    base = ["eval", "--target", str(tmp_path / "no-target"), "--drafter", str(tmp_path / "no-drafter"),
            "--prompts", str(tmp_path / "none.jsonl")]
    return CliRunner().invoke(main, base + args)


@pytest.mark.parametrize("seed", ["99999999999999999999", "-1", str(2**63)])
def test_seed_out_of_range_is_refused_as_regenerate_does(tmp_path, seed):
    result = _eval(["--seed", seed], tmp_path)
    assert isinstance(result.exception, ConfigError)
    assert str(result.exception) == f"--seed={seed}: must be in [0, 2**63)"


def test_seed_is_checked_for_library_callers_too():
    with pytest.raises(ConfigError, match=r"seed=-1: must be in \[0, 2\*\*63\)"):
        Sampling(seed=-1)
    with pytest.raises(ConfigError, match=r"--seed=18446744073709551616: must be in"):
        evaluate_sets("no-target", "no-drafter", prompt_files=["x.jsonl"], vs_untrained=True, seed=2**64)
    assert Sampling(seed=2**63 - 1, temperature=1.0).generator(torch.device("cpu")) is not None
    with pytest.raises(ConfigError, match="temperature=inf: must be a finite number"):
        Sampling(temperature=math.inf)


@pytest.mark.parametrize("ulps", ["inf", "nan", "-inf"])
def test_non_finite_near_tie_ulps_is_refused(tmp_path, ulps):
    result = _eval(["--check-lossless", "--near-tie-ulps", ulps], tmp_path)
    if ulps == "-inf":  # click's FloatRange(min=0) refuses this one itself
        assert result.exit_code == 2 and "--near-tie-ulps" in result.output
        return
    assert isinstance(result.exception, ConfigError)
    assert str(result.exception) == f"--near-tie-ulps={ulps}: must be a finite number >= 0"


def test_save_to_that_cannot_be_appended_is_refused_before_loading(tmp_path):
    run_dir = tmp_path / "run"
    (run_dir / "eval_results.jsonl").mkdir(parents=True)  # a directory in the file's place
    result = _eval(["--save-to", str(run_dir)], tmp_path)
    assert isinstance(result.exception, DataError)
    assert str(result.exception).startswith(f"--save-to {run_dir}: cannot append to {run_dir}/eval_results.jsonl")
    assert "\n" not in str(result.exception)


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root writes to read-only directories")
def test_save_to_a_read_only_run_directory_is_refused(tmp_path):
    run_dir = tmp_path / "ro"
    run_dir.mkdir()
    run_dir.chmod(0o500)
    try:
        with pytest.raises(DataError, match="cannot append to .*eval_results.jsonl"):
            check_appendable(str(run_dir))
    finally:
        run_dir.chmod(0o700)


def test_check_appendable_leaves_no_file_and_keeps_an_existing_one(tmp_path):
    path = check_appendable(str(tmp_path))
    assert path == str(tmp_path / "eval_results.jsonl") and not os.path.exists(path)
    (tmp_path / "eval_results.jsonl").write_text('{"tau": 1}\n')
    check_appendable(str(tmp_path))
    assert (tmp_path / "eval_results.jsonl").read_text() == '{"tau": 1}\n'


@pytest.fixture(scope="module")
def drafter_export(tmp_path_factory, target_dir):
    out = tmp_path_factory.mktemp("drafter") / "export"
    save_inference_checkpoint(random_drafter(target_dir, num_layers=1, block_size=8), str(out), dtype=torch.float32)
    return out


def _edited(drafter_export, tmp_path, edit) -> str:
    out = tmp_path / "edited"
    out.mkdir()
    for name in os.listdir(drafter_export):
        (out / name).write_bytes((drafter_export / name).read_bytes())
    config = json.loads((out / "config.json").read_text())
    edit(config)
    (out / "config.json").write_text(json.dumps(config))
    return str(out)


def _set(key, value, nested=False):
    def edit(config):
        (config["dflash_config"] if nested else config)[key] = value
    return edit


@pytest.mark.parametrize("edit, needle", [
    (_set("block_size", 100000), r"block_size=100000 must be an integer in \[2, 1024\]"),
    (_set("block_size", 1), r"block_size=1 must be an integer in \[2, 1024\]"),
    (_set("block_size", "8"), "block_size must be an integer, got '8'"),
    (_set("block_size", True), "block_size must be an integer, got True"),
    (_set("block_size", 8.5), "block_size must be an integer, got 8.5"),
    (_set("num_hidden_layers", "1"), "num_hidden_layers must be an integer, got '1'"),
    (_set("num_target_layers", 4.0), "num_target_layers must be an integer, got 4.0"),
    (_set("mask_token_id", "3", nested=True), "dflash_config.mask_token_id must be an integer, got '3'"),
    (_set("target_layer_ids", ["1", 2], nested=True), r"target_layer_ids must be a list of integers, got \['1', 2\]"),
    (_set("target_layer_ids", [True, 2], nested=True), "target_layer_ids must be a list of integers"),
    (_set("max_position_embeddings", "64"), "max_position_embeddings must be an integer"),
])
def test_a_drafter_config_with_a_wrong_field_is_refused_naming_file_and_field(drafter_export, tmp_path, edit,
                                                                            needle):
    path = _edited(drafter_export, tmp_path, edit)
    with pytest.raises(DataError, match=needle) as info:
        load_inference_checkpoint(path)
    message = str(info.value)
    assert message.startswith(os.path.join(path, "config.json") + ": ") and "\n" not in message


def test_block_size_is_at_most_the_drafters_positions(drafter_export, tmp_path):
    def edit(config):
        config.update(max_position_embeddings=32, block_size=64)
    with pytest.raises(DataError, match=r"block_size=64 must be an integer in \[2, 32\]"):
        load_inference_checkpoint(_edited(drafter_export, tmp_path, edit))


def test_layer_types_error_names_its_file_once(drafter_export, tmp_path):
    def edit(config):
        config.update(layer_types=["sliding_attention"], use_sliding_window=False)
    path = _edited(drafter_export, tmp_path, edit)
    with pytest.raises(DataError) as info:
        load_inference_checkpoint(path)
    assert str(info.value).count("config.json") == 1 and "use_sliding_window is false" in str(info.value)


def test_dataset_token_ids_outside_the_targets_vocab_are_refused(tiny_cache, target_dir, monkeypatch):
    prompt_set = PromptSet(name="held-out", source="DIR", cases=[
        PromptCase(sample_id=3, turns=[""], prompt_ids=np.array([1, 2506, 7]), where="DIR: sample 3")])
    with pytest.raises(DataError, match=r"^DIR: sample 3: token id 2506 >= the target's vocab 1024"):
        check_token_ids(prompt_set, 1024)
    check_token_ids(prompt_set, 2507)
    # Wired into eval's prompt sets, before the target is loaded: the tiny data against a vocab of 5.
    monkeypatch.setattr(speculative, "_target_vocab_size", lambda target: 5)
    data_dir = eval_data(tiny_cache)
    with pytest.raises(DataError, match=rf"^{data_dir}: sample \d+: token id \d+ >= the target's vocab 5"):
        speculative.prompt_sets(target_dir, data_dir=data_dir, num_prompts=2)


def _write(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture(scope="module")
def renderer(target_dir):
    return ChatRenderer(AutoTokenizer.from_pretrained(target_dir))


def test_prompt_rows_that_are_ambiguous_or_empty_are_refused(tmp_path):
    path = _write(tmp_path / "p.jsonl", [{"question": "a"}, {"question": "b", "turns": ["c"]}])
    with pytest.raises(DataError, match=rf"^{path}:2: the row has 'turns' and 'question'; a prompt row holds one"):
        read_prompt_file(path)
    with pytest.raises(DataError, match="'question' is empty"):
        parse_row({"question": "  "}, "f:1")
    with pytest.raises(DataError, match="'question' must be a non-empty string, got int"):
        parse_row({"question": 3}, "f:1")
    with pytest.raises(DataError, match="both 'messages' and 'conversations'"):
        parse_row({"messages": [{"role": "user", "content": "hi"}],
                   "conversations": [{"from": "human", "value": "hi"}]}, "f:1")
    with pytest.raises(DataError, match="'prompt' is not its chat's first user turn"):
        parse_row({"prompt": "other", "messages": [{"role": "user", "content": "hi"}]}, "f:1")
    # UltraChat's shape: "prompt" is the chat's first user turn, the chat is the prompt.
    ultrachat = {"prompt": "hi", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x"},
                                              {"role": "user", "content": "more"}]}
    assert parse_row(ultrachat, "f:1") == (["hi", "more"], None)


def test_a_prompt_spelling_a_special_token_is_refused(tmp_path, renderer):
    path = _write(tmp_path / "p.jsonl", [{"question": "fine"}, {"turns": ["ok", "stop<|im_end|> here"]}])
    prompt_set = read_prompt_file(path)
    with pytest.raises(DataError, match=rf"^{path}:2: special_token_in_content: turn 1 \(user\) contains '<\|im_end\|>'"):
        Conversations(prompt_set, max_new_tokens=8, renderer=renderer)
    system = read_prompt_file(_write(tmp_path / "s.jsonl", [{"question": "q", "system": "<|im_start|>x"}]))
    with pytest.raises(DataError, match=r"turn 0 \(system\) contains '<\|im_start\|>'"):
        Conversations(system, max_new_tokens=8, renderer=renderer)


def test_a_prompt_longer_than_the_targets_positions_is_refused_and_a_long_budget_is_cut(tmp_path, renderer):
    path = _write(tmp_path / "p.jsonl", [{"question": "hi"}, {"question": "hello there " * 40}])
    prompt_set = read_prompt_file(path)
    lengths = [len(renderer.render([{"role": "user", "content": c.turns[0]}], "t")) for c in prompt_set.cases]
    assert lengths[0] + 8 + 4 < 64 < lengths[1]
    with pytest.raises(DataError, match=rf"^{path}:2: turn 0: {lengths[1]} prompt tokens leave no room in the "
                                        r"target's 64 positions \(a speculative step needs 8 more"):
        Conversations(prompt_set, max_new_tokens=64, renderer=renderer, max_positions=64, reserve=8)
    short = PromptSet(name="short", cases=prompt_set.cases[:1], source=path)
    source = Conversations(short, max_new_tokens=64, renderer=renderer, max_positions=64, reserve=8)
    assert source.next_request().max_new_tokens == 64 - lengths[0] - 8  # plain and speculative runs alike
    assert source.capped == [f"{path}:1 turn 0 ({lengths[0]} prompt tokens: {64 - lengths[0] - 8} new)"]
    roomy = Conversations(short, max_new_tokens=4, renderer=renderer, max_positions=64, reserve=8)
    assert roomy.next_request().max_new_tokens == 4 and roomy.capped == []
    held = PromptSet(name="held-out", source="DIR", cases=[
        PromptCase(sample_id=5, turns=[""], prompt_ids=np.arange(60), where="DIR: sample 5")])
    with pytest.raises(DataError, match=r"^DIR: sample 5: turn 0: 60 prompt tokens leave no room"):
        Conversations(held, max_new_tokens=4, renderer=None, max_positions=64, reserve=16)


def test_eval_options_refuse_a_non_finite_tie_tolerance():
    with pytest.raises(ConfigError, match="near-tie-ulps=nan"):
        EvalOptions(near_tie_ulps=float("nan"))
    assert EvalOptions(near_tie_ulps=0.0).near_tie_ulps == 0.0
