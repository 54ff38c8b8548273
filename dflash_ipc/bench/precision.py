"""``dflash-ipc bench precision``: the same drafter trained under several recipes (precisions,
loss weightings, attention layouts, optimizers, schedules: bench/recipes.py) for the same
number of steps or the same wall time; the loss curves side by side and the acceptance
length (tau) of each drafter on held-out prompts, with its spread over the prompts.

Data, either of:
* a real target and a prepared dataset (``--target DIR --data DIR``): the dataset must
  declare held-out prompts (``dflash-ipc prepare --held-out N``), which no training row
  shares; tau is measured on them. This is the comparison that counts: a random-weight
  target gives tau ~1 whatever the recipe.
* by default, the embedded default's recipe at a GPU shape: a random-weight Qwen3-shaped
  target (bench/assets.py, with the tiny target's rule that the LM-head rows of ids no
  tokenizer can write are zero, so its greedy replies are text, and those it can write
  scaled to logits of std 4, so its greedy tokens are predictable) answers synthetic prompts
  with its own greedy continuations (builtin/synthetic.py: the real prepare, plus held-out
  prompts never trained on). Random tokens would teach nothing: their loss does not fall.
  It measures precision (bf16 against fp8), not recipes.

Every recipe trains the same fresh drafter (one seed) on the same sequences in the same
order with the same anchors, through the real DrafterTrainer, so the curves differ by the
recipe alone. The target features of every sample are computed once, by the target capture
(target/capture.py), and kept on the device. ``--budget-s``: each recipe first times a few
steps (after two untimed ones that compile), then trains as many steps as fit its budget
(cosine and WSD are planned for that many). After training each drafter goes through the
real bf16 export and is loaded back for batched greedy speculative decoding on the held-out
prompts (eval/speculative.py), next to an untrained drafter, each output checked against
plain greedy decoding (lossless).

Reported per recipe: the mean loss of each tenth of the run (the loss each recipe minimises:
D-PACE's is a differently weighted sum, so compare curves within a weighting), steps, the
median step time after the first 5 steps and those of them that compiled (their count and
seconds), tau (committed tokens per target forward over all prompts), the per-prompt
tau's mean, standard deviation, min and max, its gain over the first recipe, and the
lossless verdict.

Run manual::

    dflash-ipc bench precision --device cuda:0 --precision bf16,fp8     # Qwen3-1.7B shape, one H200
    dflash-ipc bench precision --device cuda:0 --target /tmp/smol-hf --data DATA --mask-token-id 16 \
        --recipes paper,dpace,swa,muon,wsd,default --budget-s 40 --eval-prompts 64 --eval-tokens 128
    dflash-ipc bench precision --device cpu --shape tiny --samples 32 --steps 8 --eval-prompts 2
"""

from __future__ import annotations

import collections
import dataclasses
import gc
import json
import logging
import math
import os
import shutil
import statistics
import time
from dataclasses import asdict

import numpy as np
import torch

from dflash_ipc.bench.assets import build_random_target
from dflash_ipc.bench.drafter import _resolve_device, variant_label
from dflash_ipc.bench.recipes import Recipe, precision_recipes
from dflash_ipc.bench.run_sizes import RunSizes
from dflash_ipc.config.load import apply_overrides, config_from_dict
from dflash_ipc.config.schema import JobConfig
from dflash_ipc.data.dataset import TokenDataset
from dflash_ipc.builtin.synthetic import build_synthetic_dataset, synthetic_cache_key, synthetic_params
from dflash_ipc.drafter.inference_format import load_inference_checkpoint, save_inference_checkpoint
from dflash_ipc.drafter.model import DFlashConfig, DFlashDraftModel
from dflash_ipc.drafter.precision import reset_compiled_layers
from dflash_ipc.hf.target_head import FrozenTargetHead
from dflash_ipc.drafter.trainer import DrafterTrainer, Sequence, eligible_anchor_count
from dflash_ipc.errors import ConfigError
from dflash_ipc.eval.prompt_sets import held_out_set
from dflash_ipc.eval.speculative import EvalOptions, run_set
from dflash_ipc.decode.target import BatchedTarget
from dflash_ipc.hf.target_config import load_target_config
from dflash_ipc.run.compile_workers import compile_in_process
from dflash_ipc.run.json_files import write_json_atomic
from dflash_ipc.target.capture import FeatureCapture

logger = logging.getLogger(__name__)

TARGET_MARKER = "bench-target.json"  # the build parameters of a complete target directory
NUM_WINDOWS = 10  # the curves are reported as the mean loss of each tenth of the run
CAPTURE_TOKENS = 32768  # padded tokens per target forward while capturing features
TARGET_LOGIT_STD = 4.0  # a peaked random target: its greedy tokens can be learned (assets._sharpen_head)
CALIBRATION_WARMUP = 2  # --budget-s: untimed steps first (the first compiles) ...
CALIBRATION_STEPS = 5  # ... then timed ones; the median step time sets the step count


# --- assets -------------------------------------------------------------------------------------


def build_assets(work_dir: str, shape: str, sizes: RunSizes, device: torch.device) -> tuple[str, str]:
    """(target dir, data dir) under ``work_dir``, built once and reused while they match."""
    target_dir = os.path.join(os.path.abspath(work_dir), f"target-{shape}")
    params = {"shape": shape, "seed": sizes.seed, "text_only": True, "logit_std": TARGET_LOGIT_STD}
    marker = os.path.join(target_dir, TARGET_MARKER)
    try:
        with open(marker, encoding="utf-8") as f:
            built = json.load(f)
    except (OSError, ValueError):
        built = None
    if built != params:
        shutil.rmtree(target_dir, ignore_errors=True)
        started = time.perf_counter()
        build_random_target(target_dir, shape=shape, seed=sizes.seed, text_only=True, logit_std=TARGET_LOGIT_STD)
        with open(marker, "w", encoding="utf-8") as f:
            json.dump(params, f)
        logger.info("built the %s target in %.1f s: %s", shape, time.perf_counter() - started, target_dir)
    kw = dict(num_samples=sizes.samples, min_len=sizes.min_len, max_len=sizes.max_len, seed=sizes.seed,
              num_held_out=sizes.held_out)
    # Named by everything it depends on (the target's bytes included), as resolve.py names
    # the embedded default's data: a directory is never reused for other data.
    name = f"data-{synthetic_cache_key(synthetic_params(target_dir, **kw))}"
    started = time.perf_counter()
    data_dir = build_synthetic_dataset(target_dir, os.path.join(os.path.abspath(work_dir), name),
                                       device=str(device), **kw)
    logger.info("data %s ready in %.1f s", data_dir, time.perf_counter() - started)
    return target_dir, data_dir


def check_real_data(target_dir: str, data_dir: str, eval_prompts: int) -> TokenDataset:
    """The prepared dataset, refused unless it declares ``eval_prompts`` held-out prompts."""
    from dflash_ipc.data.held_out import held_out_prompts_of

    if not os.path.isfile(os.path.join(target_dir, "config.json")):
        raise ConfigError(f"bench precision: --target {target_dir} is not a model directory (no config.json)")
    dataset = TokenDataset(data_dir)
    declared = held_out_prompts_of(dataset.meta, os.path.join(data_dir, "meta.json"))
    if len(declared) < eval_prompts:
        raise ConfigError(f"bench precision: {data_dir} declares {len(declared)} held-out prompts, "
                          f"--eval-prompts asks {eval_prompts}: prepare it with --held-out {eval_prompts} or more")
    return dataset


def drafter_config(target_dir: str, num_layers: int, mask_token_id: int | None = None,
                   dataset: TokenDataset | None = None) -> DFlashConfig:
    """The drafter of the target; the mask id given, else as a job derives it (the tokenizer's
    mask token, else a spare embedding row, else a ConfigError listing candidates)."""
    from dflash_ipc.hf.text_stack import text_config
    from dflash_ipc.target.defaults import derive_mask_token_id

    target_config = load_target_config(target_dir)
    if mask_token_id is None:
        mask_token_id = derive_mask_token_id(target_dir, vocab_size=int(text_config(target_config).vocab_size),
                                             dataset=dataset)
    return DFlashConfig.from_target_config(target_config, num_draft_layers=num_layers,
                                           mask_token_id=int(mask_token_id))


def capture_samples(target_dir: str, dataset: TokenDataset, layer_ids: list[int],
                    device: torch.device) -> list[tuple[torch.Tensor, np.ndarray, np.ndarray]]:
    """(features ``[L, F]`` on the device, ids, loss mask) of every sample, in dataset order,
    from the target capture the target workers run, length-sorted batches of ~32K tokens."""
    capture = FeatureCapture(target_dir, layer_ids=layer_ids, dtype="bfloat16", attn_implementation="sdpa",
                             device=str(device))
    order = np.argsort(dataset.lengths, kind="stable")  # ascending: the last member is the longest
    out: list = [None] * len(dataset)
    start = 0
    while start < len(order):
        stop = start + 1
        while stop < len(order) and (stop + 1 - start) * int(dataset.lengths[order[stop]]) <= CAPTURE_TOKENS:
            stop += 1
        members = order[start:stop]
        samples = [dataset.sample(int(i)) for i in members]
        lengths = torch.tensor([len(sample_ids) for sample_ids, _ in samples])  # [B]
        ids = torch.zeros(len(members), int(lengths.max()), dtype=torch.long)  # [B, L] right-padded
        for row, (sample_ids, _) in enumerate(samples):
            ids[row, : sample_ids.size] = torch.from_numpy(sample_ids.astype(np.int64))
        features = torch.empty(int(lengths.sum()), capture.feature_dim, dtype=torch.bfloat16, device=device)
        capture.forward_into(ids.to(device), lengths.to(device), features)  # [T, F] packed
        for i, piece, (sample_ids, mask) in zip(members, features.split(lengths.tolist()), samples):
            out[int(i)] = (piece, sample_ids, mask)
        start = stop
    del capture
    _free_memory()
    return out


def sequence_order(samples: list, sizes: RunSizes, steps: int | None = None) -> list[Sequence]:
    """Enough epochs of the samples for ``steps`` (default ``sizes.steps``) steps, each epoch in
    its own seeded order (anchors depend on the epoch: a repeated sample gets new ones). The
    order of a longer run starts with that of a shorter one."""
    anchors = [eligible_anchor_count(mask, sizes.max_anchors_per_seq) for _, _, mask in samples]
    per_epoch = sum(anchors)
    if per_epoch == 0:
        raise ConfigError("bench precision: no sample has a response position to anchor on")
    epochs = math.ceil((steps or sizes.steps) * sizes.anchors_per_step / per_epoch) + 1
    rng = np.random.default_rng(sizes.seed)
    order = []
    for epoch in range(epochs):
        for i in rng.permutation(len(samples)):
            features, ids, mask = samples[i]
            order.append(Sequence(batch_id=int(i), epoch=epoch, sample_id=int(i), features=features,
                                  input_ids=torch.from_numpy(ids.astype(np.int64)),
                                  loss_mask=torch.from_numpy(mask.astype(bool)), num_anchors=anchors[i]))
    return order


# --- training and evaluation ----------------------------------------------------------------------


def recipe_config(recipe: Recipe, device: torch.device, sizes: RunSizes, model_config: DFlashConfig) -> JobConfig:
    """The one-drafter job config of ``recipe``: the bench's sizes, then the recipe's overrides."""
    tree = {"target": {"devices": [str(device)]},
            "drafter": {"num_workers": 1, "devices": [str(device)], "dtype": "bfloat16", "attention": "auto"},
            "run": {"seed": sizes.seed}, "optimizer": {"lr": sizes.lr},
            "model": {"num_layers": model_config.num_hidden_layers, "block_size": model_config.block_size,
                      "mask_token_id": model_config.mask_token_id},
            "objective": {"max_anchors_per_seq": sizes.max_anchors_per_seq, "anchors_per_step": sizes.anchors_per_step}}
    try:
        cfg = config_from_dict(apply_overrides(tree, list(recipe.overrides)))
    except ConfigError as exc:
        raise ConfigError(f"bench precision: recipe {recipe.name}: {exc}") from None
    if (cfg.model.num_layers, cfg.model.block_size) != (model_config.num_hidden_layers, model_config.block_size):
        raise ConfigError(f"bench precision: recipe {recipe.name} changes model.num_layers or model.block_size: "
                          f"every recipe trains the same drafter (--num-layers sets its depth)")
    return cfg


def recipe_model_config(cfg: JobConfig, model_config: DFlashConfig) -> DFlashConfig:
    """The shared drafter shape with the recipe's layer types."""
    return dataclasses.replace(model_config, layer_types=cfg.model.layer_types, sliding_window=cfg.model.sliding_window)


def steps_for_budget(budget_s: float, step_s: list[float]) -> int:
    """Steps that fit ``budget_s`` at the median of the timed ``step_s``."""
    return max(1, int(budget_s / statistics.median(step_s)))


def calibrate(recipe: Recipe, cfg: JobConfig, model_config: DFlashConfig, head: FrozenTargetHead,
              samples: list, sizes: RunSizes, device: torch.device, budget_s: float) -> int:
    """The step count of ``recipe`` in ``budget_s``: a throwaway trainer times a few steps."""
    trainer = DrafterTrainer(cfg, model_config, head, device=str(device), total_steps=100)
    fifo = collections.deque(sequence_order(samples, sizes, CALIBRATION_WARMUP + CALIBRATION_STEPS))
    timed = [trainer.step(trainer.take(fifo))["step_s"] for _ in range(CALIBRATION_WARMUP + CALIBRATION_STEPS)]
    steps = steps_for_budget(budget_s, timed[CALIBRATION_WARMUP:])
    logger.info("%s: %.1f ms a step: %d steps in %.0f s", recipe.name,
                1e3 * statistics.median(timed[CALIBRATION_WARMUP:]), steps, budget_s)
    del trainer
    _forget_graphs(cfg)
    _free_memory()
    return steps


def train_recipe(recipe: Recipe, model_config: DFlashConfig, head: FrozenTargetHead, samples: list,
                 sizes: RunSizes, device: torch.device, export_dir: str, budget_s: float | None = None) -> dict:
    """Trains a fresh drafter under ``recipe`` for ``sizes.steps`` steps (or as many as fit
    ``budget_s``) on the shared sequence order; exports it to ``export_dir``; returns its
    per-step losses and step times."""
    cfg = recipe_config(recipe, device, sizes, model_config)
    model_config = recipe_model_config(cfg, model_config)
    steps = sizes.steps if budget_s is None else calibrate(recipe, cfg, model_config, head, samples, sizes, device,
                                                           budget_s)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    trainer = DrafterTrainer(cfg, model_config, head, device=str(device), total_steps=steps)
    fifo = collections.deque(sequence_order(samples, sizes, steps))
    losses, step_s = [], []
    started = time.perf_counter()
    for step in range(steps):
        result = trainer.step(trainer.take(fifo))
        losses.append(result["loss"])
        step_s.append(result["step_s"])
        if step == 0 or (step + 1) % max(1, steps // NUM_WINDOWS) == 0:
            logger.info("%s: step %d/%d, loss %.4f, %.1f ms", recipe.name, step + 1, steps, result["loss"],
                        result["step_s"] * 1e3)
    train_s = time.perf_counter() - started
    save_inference_checkpoint(trainer.model, export_dir)
    peak = torch.cuda.max_memory_allocated(device) / 1024**3 if device.type == "cuda" else None
    del trainer
    _forget_graphs(cfg)
    _free_memory()
    return {"overrides": list(recipe.overrides), "losses": losses, "step_s": step_s, "train_s": train_s,
            "peak_memory_gib": peak, "export": export_dir}


def evaluate_drafters(target_dir: str, data_dir: str, model_config: DFlashConfig, exports: dict[str, str],
                      sizes: RunSizes, device: torch.device) -> dict[str, dict]:
    """tau of an untrained drafter and of each export, on the same held-out prompts (batched
    greedy speculative decoding, all prompts in flight, each output checked against plain
    greedy decoding): per drafter, tau over all prompts, per-prompt taus, lossless verdicts."""
    target = BatchedTarget(target_dir, layer_ids=model_config.target_layer_ids, device=device, dtype="bfloat16")
    prompts = held_out_set(TokenDataset(data_dir), num_prompts=sizes.eval_prompts)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(sizes.seed)
        untrained = DFlashDraftModel(model_config).to(device=device, dtype=torch.bfloat16)
    drafters = {"untrained": untrained}
    drafters.update({label: load_inference_checkpoint(path, device=device, dtype=torch.bfloat16)
                     for label, path in exports.items()})
    options = EvalOptions(max_new_tokens=sizes.eval_tokens, batch_size=sizes.eval_prompts, plain=True,
                          check_lossless=True)
    reports = run_set(target, list(drafters.items()), prompts, renderer=None, options=options)
    out = {report.label: {"tau": report.tau, "prompt_taus": [s.stats.tau for s in report.samples if s.stats.num_cycles],
                          "lossless_checked": report.num_lossless_checked, "mismatches": report.lossless_mismatches,
                          "near_ties": report.near_ties} for report in reports}
    del target, drafters
    _free_memory()
    return out


def _forget_graphs(cfg: JobConfig) -> None:
    """After an fp8 model: its float8 layers' graphs and static row counts must not carry over
    (precision.reset_compiled_layers). bf16 models share every compiled function (weights are
    arguments), so they keep them: a dynamo reset would cost each recipe the ~25 s first compile."""
    if cfg.drafter.precision == "fp8":
        reset_compiled_layers()


def _free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_precision_comparison(device: str = "cuda:0", shape: str = "qwen3-1.7b", work_dir: str = "/tmp/dflash-precision",
                             variants: list[dict] | None = None, sizes: RunSizes = RunSizes(), *,
                             recipes: list[Recipe] | None = None, target_dir: str | None = None,
                             data_dir: str | None = None, mask_token_id: int | None = None,
                             budget_s: float | None = None, json_path: str | None = None) -> dict:
    """Trains the same drafter under every recipe (``recipes``, else the precision ``variants``),
    evaluates them; prints and returns the figures. ``target_dir`` and ``data_dir`` (both or
    neither): a real target and a prepared dataset with held-out prompts instead of the
    random-weight ``shape`` and its synthetic data. ``json_path``: the figures so far after every
    recipe (``"partial": true``; a later failure keeps the runs already trained), all at the end."""
    compile_in_process()  # as the drafter worker does (run/compile_workers.py)
    real = target_dir is not None or data_dir is not None
    if real and (target_dir is None or data_dir is None):
        raise ConfigError("bench precision: give --target and --data together (a real target and its prepared data)")
    sizes.check(synthetic=not real)
    if budget_s is not None and not 0 < budget_s <= 86400:
        raise ConfigError(f"bench precision: --budget-s {budget_s} must be in (0, 86400]")
    if recipes is None:
        recipes = precision_recipes(variants or [{"precision": "bf16"}, {"precision": "fp8"}], variant_label)
    labels = [r.name for r in recipes]
    if len(set(labels)) != len(labels) or "untrained" in labels:
        raise ConfigError(f"bench precision: a recipe is asked twice (or named 'untrained'): {labels}")
    dev = _resolve_device(device)
    started = time.perf_counter()
    if real:
        dataset = check_real_data(target_dir, data_dir, sizes.eval_prompts)
    else:
        target_dir, data_dir = build_assets(work_dir, shape, sizes, dev)
        dataset = TokenDataset(data_dir)
    phase_s = {"assets": time.perf_counter() - started}
    model_config = drafter_config(target_dir, sizes.num_layers, mask_token_id, dataset)
    for recipe in recipes:  # every recipe is a valid job before anything trains
        recipe_model_config(recipe_config(recipe, dev, sizes, model_config), model_config)
    samples = capture_samples(target_dir, dataset, model_config.target_layer_ids, dev)
    phase_s["capture"] = time.perf_counter() - started - phase_s["assets"]
    head = FrozenTargetHead.from_pretrained(target_dir, dtype=torch.bfloat16, device=dev)
    runs = {}
    for recipe in recipes:
        export = os.path.join(os.path.abspath(work_dir), "drafter-" + "".join(
            c if c.isalnum() or c in "+-_." else "-" for c in recipe.name))
        runs[recipe.name] = train_recipe(recipe, model_config, head, samples, sizes, dev, export, budget_s)
        if json_path:
            write_json_atomic(json_path, {"partial": True, "target": target_dir, "data": data_dir,
                                          "sizes": asdict(sizes), "budget_s": budget_s, "runs": runs})
    del head, samples
    _free_memory()
    evaluating = time.perf_counter()
    evals = evaluate_drafters(target_dir, data_dir, model_config, {k: r["export"] for k, r in runs.items()},
                              sizes, dev)
    phase_s["evaluation"] = time.perf_counter() - evaluating
    figures = {"shape": None if real else shape, "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
               "torch": torch.__version__, "target": target_dir, "data": data_dir, "num_samples": len(dataset),
               "sizes": asdict(sizes), "budget_s": budget_s, "runs": runs, "tau": {k: v["tau"] for k, v in evals.items()},
               "eval": evals, "phase_s": phase_s, "wall_s": time.perf_counter() - started}
    if json_path:
        write_json_atomic(json_path, figures)
    print(format_report(figures), flush=True)
    return figures


# --- the report -----------------------------------------------------------------------------------


def window_means(losses: list[float], num_windows: int = NUM_WINDOWS) -> list[float]:
    """Mean loss of each of ``num_windows`` consecutive, near-equal parts of the run."""
    bounds = np.linspace(0, len(losses), min(num_windows, len(losses)) + 1).round().astype(int)
    return [statistics.fmean(losses[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]


def tau_spread(prompt_taus: list[float]) -> dict:
    """Mean, standard deviation, min and max of the per-prompt taus (nan when none)."""
    if not prompt_taus:
        return dict.fromkeys(("mean", "std", "min", "max"), float("nan"))
    return {"mean": statistics.fmean(prompt_taus),
            "std": statistics.stdev(prompt_taus) if len(prompt_taus) > 1 else 0.0,
            "min": min(prompt_taus), "max": max(prompt_taus)}


def _lossless(e: dict | None) -> str:
    if not e or not e.get("lossless_checked"):
        return "n/a"
    if e["mismatches"]:
        return f"DIFF {len(e['mismatches'])}"
    return f"ok{'~' + str(len(e['near_ties'])) if e['near_ties'] else ''}/{e['lossless_checked']}"


WARM_STEPS = 5
"""Steps left out of the step time: the first ones compile the step's functions."""
SLOW_STEP = 3.0
"""A step this many times the median or more is counted apart (it compiled: fp8's float8 layers
compile a static graph for each row count seen twice, up to 8, drafter/precision.py)."""


def step_times(step_s: list[float]) -> tuple[float, list[float]]:
    """(median step, the steps of at least SLOW_STEP x it) over the steps after the first WARM_STEPS.
    The mean would be mostly compile time in a short run: one compile of a float8 layer's row
    count took 4 s against 80-ms steps (Qwen3-1.7B shape, H100, docs/benchmarks.md)."""
    steady = step_s[min(WARM_STEPS, len(step_s) - 1):]
    typical = statistics.median(steady)
    return typical, [s for s in steady if s >= SLOW_STEP * typical]


def format_report(f: dict) -> str:
    labels = list(f["runs"])
    s = f["sizes"]
    what = (f"{f['shape']} target (random weights, greedy replies)" if f.get("shape") else f"target {f['target']}")
    samples = f.get("num_samples", s["samples"])
    budget = f"{f['budget_s']:g} s of training each" if f.get("budget_s") else f"{s['steps']} steps each"
    lines = [f"recipe comparison: {what} on {f['device']}, torch {f['torch']}",
             f"  data     {samples} training samples ({f['data']}); {budget} of {s['anchors_per_step']} anchors "
             f"at lr {s['lr']:g}, {s['num_layers']}-layer drafter; tau on {s['eval_prompts']} held-out prompts, "
             f"{s['eval_tokens']} new tokens, greedy",
             "  loss     mean of each tenth of each run"]
    for label in labels:
        lines.append(f"    {label:<30} " + " ".join(f"{v:6.3f}" for v in window_means(f["runs"][label]["losses"])))
    base_tau = f["tau"].get(labels[0], float("nan"))
    final_base = window_means(f["runs"][labels[0]]["losses"])[-1]
    lines.append(f"  {'':<32} {'steps':>6} {'final':>7} {'gap':>8} {'step ms':>8} {'slow':>13} {'peak GiB':>9} "
                 f"{'tau':>6} {'gain':>7} {'mean':>6} {'std':>6} {'min':>5} {'max':>5} {'lossless':>9}")
    for label in labels + ["untrained"]:
        run, e = f["runs"].get(label), (f.get("eval") or {}).get(label)
        spread = tau_spread(e["prompt_taus"] if e else [])
        tau = f["tau"].get(label, float("nan"))
        if run is not None:
            typical, slow = step_times(run["step_s"])
            peak = f"{run['peak_memory_gib']:.1f}" if run["peak_memory_gib"] is not None else "n/a"
            final = window_means(run["losses"])[-1]
            head = (f"{len(run['losses']):6d} {final:7.3f} {100 * (final / final_base - 1):+7.2f}% "
                    f"{typical * 1e3:8.1f} {f'{len(slow)} ({sum(slow):.1f} s)':>13} {peak:>9}")
        else:
            head = f"{'':6} {'':7} {'':8} {'':8} {'':13} {'':9}"
        lines.append(f"  {label:<32} {head} {tau:6.3f} {100 * (tau / base_tau - 1):+6.1f}% {spread['mean']:6.3f} "
                     f"{spread['std']:6.3f} {spread['min']:5.2f} {spread['max']:5.2f} {_lossless(e):>9}")
    lines.append(f"  gap: final loss (last tenth) against {labels[0]}'s; step ms: the median step after the first "
                 f"{WARM_STEPS}; slow: those of them over {SLOW_STEP}x it (compiles: a new row count) and their seconds; "
                 f"tau: committed tokens per target forward over all prompts, gain against {labels[0]}'s, "
                 f"mean/std/min/max over the prompts")
    dpace = [label for label in labels if "objective.weighting=dpace" in f["runs"][label].get("overrides", [])]
    if dpace:
        lines.append(f"  {', '.join(dpace)}: D-PACE's loss is sum w CE over the labelled slots, another scale than "
                     f"decay's weighted mean: compare loss within a weighting, tau across all")
    trained = ", ".join(f"{f['runs'][label]['train_s']:.0f}" for label in labels)
    p = f.get("phase_s", {})
    lines.append(f"  time     {f['wall_s']:.0f} s: assets {p.get('assets', 0):.0f} s, features "
                 f"{p.get('capture', 0):.0f} s, training {trained} s, evaluation {p.get('evaluation', 0):.0f} s")
    return "\n".join(lines)
