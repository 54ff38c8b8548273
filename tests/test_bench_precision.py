"""`bench precision`: the whole comparison at the tiny shape on CPU in bf16 (target, greedy data,
capture, training under two recipes, export, evaluation with the lossless check), the same on a
given target and prepared dataset; recipes by name; the report's arithmetic; fp8 on a GPU."""

import dataclasses
import json
import math
import os

import pytest
import torch

from dflash_ipc.bench import precision as bp
from dflash_ipc.bench import recipes
from dflash_ipc.drafter.inference_format import expected_tensor_shapes, load_inference_checkpoint
from dflash_ipc.errors import ConfigError

torch.set_num_threads(1)

TINY = bp.RunSizes(samples=8, min_len=32, max_len=48, held_out=1, steps=3, anchors_per_step=16,
                   max_anchors_per_seq=8, num_layers=1, eval_prompts=1, eval_tokens=4)


ALL = "dpace+muon+swa+wsd"  # every new part of the recipe in one run


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    work = tmp_path_factory.mktemp("bench-precision")
    chosen = recipes.resolve(["paper", ALL], num_layers=TINY.num_layers)
    return work, bp.run_precision_comparison("cpu", "tiny", str(work), sizes=TINY, recipes=chosen)


def test_tiny_comparison_of_two_recipes_runs_every_stage(tiny_run, capsys):
    work, f = tiny_run
    for label in ("paper", ALL):
        run = f["runs"][label]
        assert len(run["losses"]) == len(run["step_s"]) == TINY.steps
        assert all(math.isfinite(x) and x > 0 for x in run["losses"]) and min(run["step_s"]) > 0
    # The drafters went through the real export and load back with the export's names and layers.
    model = load_inference_checkpoint(f["runs"][ALL]["export"])
    assert {k: tuple(v.shape) for k, v in model.state_dict().items()} == expected_tensor_shapes(model.config)
    assert model.config.num_hidden_layers == 1 and model.config.vocab_size == 2048
    assert model.config.layer_types == ["sliding_attention"] and model.config.sliding_window == 2048
    assert load_inference_checkpoint(f["runs"]["paper"]["export"]).config.layer_types == ["full_attention"]
    assert f["runs"][ALL]["overrides"][:4] == list(recipes.PAPER) + ["objective.weighting=dpace"]
    assert set(f["tau"]) == {"untrained", "paper", ALL} and all(t >= 1 for t in f["tau"].values())
    for label, e in f["eval"].items():  # every held-out prompt checked against plain greedy decoding
        assert e["lossless_checked"] == TINY.eval_prompts and e["mismatches"] == [], label
        assert len(e["prompt_taus"]) <= TINY.eval_prompts
    assert os.path.isfile(os.path.join(f["target"], bp.TARGET_MARKER))
    assert f["data"].startswith(str(work)) and f["sizes"] == dataclasses.asdict(TINY)


def test_a_given_target_and_prepared_dataset_and_a_time_budget(tiny_run, tmp_path):
    """--target/--data: the held-out prompts the dataset declares; --budget-s: steps from the
    timed ones. Too few declared prompts is a clear error."""
    _, f = tiny_run
    chosen = recipes.resolve(["bf16"], num_layers=1)
    g = bp.run_precision_comparison("cpu", work_dir=str(tmp_path), sizes=dataclasses.replace(TINY, steps=2),
                                    recipes=chosen, target_dir=f["target"], data_dir=f["data"], budget_s=0.05,
                                    json_path=str(tmp_path / "figures.json"))
    assert g["shape"] is None and g["target"] == f["target"] and g["budget_s"] == 0.05
    written = json.loads((tmp_path / "figures.json").read_text())
    assert "partial" not in written and written["runs"]["bf16"]["losses"] == g["runs"]["bf16"]["losses"]
    assert len(g["runs"]["bf16"]["losses"]) >= 1 and set(g["tau"]) == {"untrained", "bf16"}
    with pytest.raises(ConfigError, match="declares 1 held-out prompts, --eval-prompts asks 5"):
        bp.run_precision_comparison("cpu", work_dir=str(tmp_path), sizes=dataclasses.replace(TINY, eval_prompts=5),
                                    recipes=chosen, target_dir=f["target"], data_dir=f["data"])
    with pytest.raises(ConfigError, match="give --target and --data together"):
        bp.run_precision_comparison("cpu", sizes=TINY, recipes=chosen, target_dir=f["target"])


def test_recipes_by_name_combination_and_definition():
    """Every recipe starts from the paper's (decay, AdamW, cosine) whatever the job defaults are;
    `default` starts from the job defaults."""
    got = recipes.resolve(["paper", "swa", "dpace+wsd", "mine", "default", "default+swa"],
                          {"mine": ["optimizer.name=muon", "optimizer.lr=1e-3"]}, num_layers=5)
    assert [r.name for r in got] == ["paper", "swa", "dpace+wsd", "mine", "default", "default+swa"]
    paper = ("objective.weighting=decay", "optimizer.name=adamw", "schedule.name=cosine")
    assert got[0].overrides == recipes.PAPER == paper
    assert got[1].overrides == paper + ("model.layer_types=SSSSF", "model.sliding_window=2048")
    assert got[2].overrides == paper + ("objective.weighting=dpace", "schedule.name=wsd", "schedule.decay_shape=cosine")
    assert got[3].overrides == paper + ("optimizer.name=muon", "optimizer.lr=1e-3")
    assert got[4].overrides == () and got[5].overrides == ("model.layer_types=SSSSF", "model.sliding_window=2048")
    assert recipes.parse_definition("m10=optimizer.name=muon, optimizer.muon_lr=6e-3") == \
        ("m10", ["optimizer.name=muon", "optimizer.muon_lr=6e-3"])
    with pytest.raises(ConfigError, match="recipe 'adam' \\(in 'dpace\\+adam'\\) is unknown; known: bf16, default, dpace"):
        recipes.resolve(["dpace+adam"], num_layers=5)
    with pytest.raises(ConfigError, match="asked twice"):
        recipes.resolve(["paper", "paper"], num_layers=5)
    with pytest.raises(ConfigError, match="is not section.key=value"):
        recipes.parse_definition("x=lr=3")
    model_config = bp.DFlashConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=5, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=8, vocab_size=64, mask_token_id=63,
                                   target_layer_ids=[0], num_target_layers=2)
    cfg = bp.recipe_config(got[1], torch.device("cpu"), TINY, model_config)
    assert cfg.model.layer_types == ["sliding_attention"] * 4 + ["full_attention"]
    assert (cfg.objective.weighting, cfg.optimizer.name, cfg.schedule.name) == ("decay", "adamw", "cosine")
    defaults = bp.recipe_config(got[4], torch.device("cpu"), TINY, model_config)
    assert (defaults.objective.weighting, defaults.optimizer.name, defaults.schedule.name) == ("dpace", "muon", "wsd")
    assert bp.recipe_model_config(cfg, model_config).sliding_window == 2048
    bad = recipes.Recipe(name="bad", overrides=("optimizer.name=lion",))
    with pytest.raises(ConfigError, match="recipe bad: .*optimizer.name: 'lion' not allowed"):
        bp.recipe_config(bad, torch.device("cpu"), TINY, model_config)
    assert bp.steps_for_budget(10.0, [0.5, 0.2, 0.25, 0.3, 9.0]) == 33  # the median step, 0.3 s


def test_step_time_is_the_median_and_compiling_steps_are_counted_apart():
    # the shape of an fp8 run on an H100: compiles of new row counts among 80-ms steps
    steps = [16.4, 0.097, 7.5, 0.086, 0.080, 0.084, 0.080, 4.6, 0.080, 0.087, 4.0, 3.95, 0.086, 0.080, 0.081]
    typical, slow = bp.step_times(steps)
    assert typical == pytest.approx(0.085) and slow == [4.6, 4.0, 3.95]  # of the steps after the first five
    assert bp.step_times([0.5]) == (0.5, [])


def test_the_cli_precision_variants_are_valid_job_configs():
    """`bench precision --precision bf16,fp8 [--fp8-shared-casts on]` (the CLI's variants, their
    drafter.compile "off" spelled as an override) build job configs: YAML reads off as a boolean."""
    from dflash_ipc.bench.drafter import precision_variants, variant_label

    model_config = bp.DFlashConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=5, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=8, vocab_size=64, mask_token_id=63,
                                   target_layer_ids=[0], num_target_layers=2)
    variants = precision_variants(["bf16", "fp8"], shared_casts=["off", "on"], compiles=["off", "reduce-overhead"])
    configs = [bp.recipe_config(r, torch.device("cpu"), TINY, model_config)
               for r in recipes.precision_recipes(variants, variant_label)]
    assert [(c.drafter.precision, c.drafter.compile, c.drafter.fp8_shared_casts) for c in configs] == [
        ("bf16", "off", False), ("bf16", "reduce-overhead", False), ("fp8", "off", False), ("fp8", "off", True),
        ("fp8", "reduce-overhead", False), ("fp8", "reduce-overhead", True)]


def test_assets_are_reused_while_they_match(tiny_run):
    work, f = tiny_run
    weights = os.path.join(f["target"], "model.safetensors")
    stamp = os.stat(weights).st_mtime_ns
    target_dir, data_dir = bp.build_assets(str(work), "tiny", TINY, torch.device("cpu"))
    assert (target_dir, data_dir) == (f["target"], f["data"]) and os.stat(weights).st_mtime_ns == stamp
    # The target's replies are text: no id beyond the tokenizer in any sample.
    from dflash_ipc.data.dataset import TokenDataset
    ds = TokenDataset(data_dir)
    assert max(int(ds.sample(i)[0].max()) for i in range(len(ds))) < 1100


def test_window_means_and_the_final_gap():
    assert bp.window_means([4.0, 2.0, 3.0, 1.0], num_windows=2) == [3.0, 2.0]
    assert bp.window_means([5.0, 1.0], num_windows=10) == [5.0, 1.0]
    runs = {label: {"losses": losses, "step_s": [0.1] * 10, "peak_memory_gib": None, "train_s": 1.0}
            for label, losses in (("bf16", [10.0] * 9 + [2.0]), ("fp8 tensorwise, lm_head all", [10.0] * 9 + [2.04]))}
    evals = {"bf16": {"prompt_taus": [1.0, 2.0, 3.0], "lossless_checked": 3, "mismatches": [], "near_ties": []},
             "fp8 tensorwise, lm_head all": {"prompt_taus": [2.5], "lossless_checked": 1, "mismatches": [4],
                                             "near_ties": []}}
    report = bp.format_report({"shape": "tiny", "device": "cpu", "torch": "x", "sizes": dataclasses.asdict(TINY),
                               "data": "d", "runs": runs, "eval": evals,
                               "tau": {"untrained": 1.0, "bf16": 1.5, "fp8 tensorwise, lm_head all": 1.65},
                               "wall_s": 1.0})
    fp8_line = [line for line in report.splitlines() if line.startswith("  fp8")][0]
    assert fp8_line.split()[-16:-1] == ["10", "2.040", "+2.00%", "100.0", "0", "(0.0", "s)", "n/a", "1.650", "+10.0%",
                                      "2.500", "0.000", "2.50", "2.50", "DIFF"] and fp8_line.endswith("DIFF 1")
    bf16_line = [line for line in report.splitlines() if line.startswith("  bf16")][0]
    assert bf16_line.split()[-6:] == ["+0.0%", "2.000", "1.000", "1.00", "3.00", "ok/3"]
    untrained = [line for line in report.splitlines() if line.startswith("  untrained")][0]
    assert untrained.split()[1:3] == ["1.000", "-33.3%"]
    assert bp.tau_spread([1.0, 2.0, 3.0]) == {"mean": 2.0, "std": 1.0, "min": 1.0, "max": 3.0}


def test_sizes_are_checked_and_the_cli_shows_their_defaults():
    from click.testing import CliRunner

    from dflash_ipc.cli import main
    shown = CliRunner().invoke(main, ["bench", "precision", "--help"]).output
    for name, value in dataclasses.asdict(bp.RunSizes()).items():
        assert f"--{name.replace('_', '-')}" in shown and f"[default: {value}]" in shown
    with pytest.raises(ConfigError, match="steps=0 must be >= 1"):
        bp.RunSizes(steps=0).check()
    with pytest.raises(ConfigError, match="eval_prompts=17 exceeds the held_out=16"):
        bp.RunSizes(eval_prompts=17).check()
    with pytest.raises(ConfigError, match="asked twice"):
        bp.run_precision_comparison("cpu", "tiny", "/nonexistent", [{"precision": "bf16"}] * 2, TINY)
    with pytest.raises(ConfigError, match="budget-s 0 must be in"):
        bp.run_precision_comparison("cpu", "tiny", "/nonexistent", sizes=TINY, budget_s=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_tiny_bf16_and_fp8_comparison_on_gpu(tmp_path):
    pytest.importorskip("torchao.float8", reason="needs torchao (pip install 'dflash-ipc[fp8]')")
    if torch.cuda.get_device_capability(0) < (8, 9):
        pytest.skip("needs compute capability >= 8.9")
    f = bp.run_precision_comparison("cuda:0", "tiny", str(tmp_path), [{"precision": "bf16"}, {"precision": "fp8"}],
                                    dataclasses.replace(TINY, steps=6))
    losses = {k: r["losses"] for k, r in f["runs"].items()}
    assert set(f["tau"]) == {"untrained", "bf16", "fp8 tensorwise, lm_head all"}
    assert losses["fp8 tensorwise, lm_head all"][-1] == pytest.approx(losses["bf16"][-1], rel=3e-2)


def test_the_held_out_validator_decodes_like_eval(tiny_run):
    """validation.prompts: the tau a job logs at a checkpoint is eval's tau of that export on the
    same held-out prompts (eval/held_out_validation.py on what bench precision evaluated)."""
    from dflash_ipc.config.load import config_from_dict
    from dflash_ipc.eval.held_out_validation import HeldOutValidator
    _, f = tiny_run
    cfg = config_from_dict({"target": {"path": f["target"]}, "data": {"path": f["data"]},
                            "validation": {"every_steps": 1, "prompts": TINY.eval_prompts,
                                           "max_new_tokens": TINY.eval_tokens}})
    validator = HeldOutValidator(cfg, "cpu")
    for label in ("paper", ALL):
        result = validator(f["runs"][label]["export"])
        assert result["tau"] == pytest.approx(f["tau"][label]) and result["prompts"] == TINY.eval_prompts
        assert result["tokens"] == TINY.eval_prompts * TINY.eval_tokens


def test_the_held_out_validator_refuses_a_dataset_without_held_out_prompts(tmp_path):
    from dflash_ipc.config.load import config_from_dict
    from dflash_ipc.eval.held_out_validation import HeldOutValidator
    from dflash_ipc.bench.assets import build_random_dataset, build_random_target
    data = tmp_path / "d"
    build_random_target(str(tmp_path / "t"), shape="tiny")
    build_random_dataset(str(tmp_path / "t"), str(data), num_samples=4, min_len=32, max_len=48)
    cfg = config_from_dict({"target": {"path": str(tmp_path / "t")}, "data": {"path": str(data)},
                            "validation": {"every_steps": 1, "prompts": 2}})
    with pytest.raises(ConfigError, match="declares no held-out prompts \\(prepare it with --held-out N\\)"):
        HeldOutValidator(cfg, "cpu")
