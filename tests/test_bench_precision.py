"""`bench precision`: the whole comparison at the tiny shape on CPU in bf16 (target, greedy data,
capture, training, export, evaluation); the report's arithmetic; fp8 on a GPU."""

import dataclasses
import math
import os

import pytest
import torch

from dflash_ipc.bench import precision as bp
from dflash_ipc.cli.bench import RUN_SIZE_DEFAULTS
from dflash_ipc.drafter.inference_format import expected_tensor_shapes, load_inference_checkpoint
from dflash_ipc.errors import ConfigError

torch.set_num_threads(1)

TINY = bp.RunSizes(samples=8, min_len=32, max_len=48, held_out=1, steps=3, anchors_per_step=16,
                   max_anchors_per_seq=8, num_layers=1, eval_prompts=1, eval_tokens=4)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    work = tmp_path_factory.mktemp("bench-precision")
    return work, bp.run_precision_comparison("cpu", "tiny", str(work), [{"precision": "bf16"}], TINY)


def test_tiny_bf16_comparison_runs_every_stage(tiny_run, capsys):
    work, f = tiny_run
    run = f["runs"]["bf16"]
    assert len(run["losses"]) == len(run["step_s"]) == TINY.steps
    assert all(math.isfinite(x) and x > 0 for x in run["losses"]) and min(run["step_s"]) > 0
    # The drafter went through the real export and loads back with the export's names.
    model = load_inference_checkpoint(run["export"])
    assert {k: tuple(v.shape) for k, v in model.state_dict().items()} == expected_tensor_shapes(model.config)
    assert model.config.num_hidden_layers == 1 and model.config.vocab_size == 2048
    assert set(f["tau"]) == {"untrained", "bf16"} and all(t >= 1 for t in f["tau"].values())
    assert os.path.isfile(os.path.join(f["target"], bp.TARGET_MARKER))
    assert f["data"].startswith(str(work)) and f["sizes"] == dataclasses.asdict(TINY)


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
    report = bp.format_report({"shape": "tiny", "device": "cpu", "torch": "x", "sizes": dataclasses.asdict(TINY),
                               "runs": runs, "tau": {"untrained": 1.0, "bf16": 1.5,
                                                     "fp8 tensorwise, lm_head all": 1.45}, "wall_s": 1.0})
    fp8_line = [line for line in report.splitlines() if line.startswith("  fp8")][0]
    assert "+2.00%" in fp8_line and fp8_line.split()[-1] == "1.450"


def test_sizes_are_checked_and_the_cli_shows_their_defaults():
    assert RUN_SIZE_DEFAULTS == dataclasses.asdict(bp.RunSizes())
    with pytest.raises(ConfigError, match="steps=0 must be >= 1"):
        bp.RunSizes(steps=0).check()
    with pytest.raises(ConfigError, match="eval_prompts=17 exceeds the held_out=16"):
        bp.RunSizes(eval_prompts=17).check()
    with pytest.raises(ConfigError, match="asked twice"):
        bp.run_precision_comparison("cpu", "tiny", "/nonexistent", [{"precision": "bf16"}] * 2, TINY)


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
