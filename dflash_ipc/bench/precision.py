"""``dflash-ipc bench precision``: the same short training run in each precision, on data whose
loss really falls; the loss curves side by side and the acceptance length (tau) of each drafter.

Data: the embedded default's recipe at a GPU shape. A random-weight Qwen3-shaped target
(bench/assets.py, with the tiny target's rule that the LM-head rows of ids no tokenizer can
write are zero, so its greedy replies are text, and those it can write scaled to logits of
std 4, so its greedy tokens are predictable: at the default init they are near-flat) answers synthetic prompts with its own greedy
continuations (data/synthetic.py: the real prepare, plus held-out prompts never trained on).
Random tokens would teach nothing: their loss does not fall.

Every variant trains the same fresh drafter (one seed) on the same sequences in the same
order with the same anchors, through the real DrafterTrainer, so the curves differ by
precision alone. The target features of every sample are computed once, by the target
capture (target/capture.py), and kept on the device. After training each drafter goes
through the real bf16 export and is loaded back for greedy speculative decoding on the
held-out prompts (eval/speculative.py), next to an untrained drafter.

Reported per variant: the mean loss of each tenth of the run, the final loss (mean of the
last tenth) and its gap to the first variant in percent, the mean step time, tau.

Run manual::

    dflash-ipc bench precision --device cuda:0 --precision bf16,fp8     # Qwen3-1.7B shape, one H200
    dflash-ipc bench precision --device cpu --shape tiny --samples 32 --steps 8 --eval-prompts 2
"""

from __future__ import annotations

import collections
import gc
import json
import logging
import math
import os
import shutil
import statistics
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch

from dflash_ipc.bench.assets import build_random_target
from dflash_ipc.bench.drafter import _resolve_device, bench_job_config, variant_label
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
from dflash_ipc.eval.target_runner import BatchedTarget
from dflash_ipc.hf.target_config import load_target_config
from dflash_ipc.target.capture import FeatureCapture

logger = logging.getLogger(__name__)

TARGET_MARKER = "bench-target.json"  # the build parameters of a complete target directory
NUM_WINDOWS = 10  # the curves are reported as the mean loss of each tenth of the run
CAPTURE_TOKENS = 32768  # padded tokens per target forward while capturing features
TARGET_LOGIT_STD = 4.0  # a peaked random target: its greedy tokens can be learned (assets._sharpen_head)


@dataclass(frozen=True)
class RunSizes:
    """Data, training and evaluation sizes of one comparison (every variant the same)."""

    samples: int = 768
    min_len: int = 128
    max_len: int = 512
    held_out: int = 16
    steps: int = 300
    anchors_per_step: int = 1024
    max_anchors_per_seq: int = 512
    num_layers: int = 5
    lr: float = 6e-4
    eval_prompts: int = 16
    eval_tokens: int = 48
    seed: int = 0

    def check(self) -> None:
        for name in ("samples", "held_out", "steps", "anchors_per_step", "max_anchors_per_seq", "num_layers",
                     "eval_prompts", "eval_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"bench precision: {name}={getattr(self, name)} must be >= 1")
        if not 0 < self.lr <= 1:
            raise ConfigError(f"bench precision: lr={self.lr} must be in (0, 1]")
        if self.eval_prompts > self.held_out:
            raise ConfigError(f"bench precision: eval_prompts={self.eval_prompts} exceeds the "
                              f"held_out={self.held_out} prompts the data keeps")


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


def drafter_config(target_dir: str, num_layers: int) -> DFlashConfig:
    """The drafter of the target, the tokenizer's mask token as the mask id."""
    from transformers import AutoTokenizer

    mask = AutoTokenizer.from_pretrained(target_dir).mask_token_id
    return DFlashConfig.from_target_config(load_target_config(target_dir), num_draft_layers=num_layers,
                                           mask_token_id=int(mask))


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


def sequence_order(samples: list, sizes: RunSizes) -> list[Sequence]:
    """Enough epochs of the samples for ``steps`` steps, each epoch in its own seeded order
    (anchors depend on the epoch: a repeated sample gets new ones)."""
    anchors = [eligible_anchor_count(mask, sizes.max_anchors_per_seq) for _, _, mask in samples]
    per_epoch = sum(anchors)
    if per_epoch == 0:
        raise ConfigError("bench precision: no sample has a response position to anchor on")
    epochs = math.ceil(sizes.steps * sizes.anchors_per_step / per_epoch) + 1
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


def train_variant(variant: dict, model_config: DFlashConfig, head: FrozenTargetHead, order: list[Sequence],
                  sizes: RunSizes, device: torch.device, export_dir: str) -> dict:
    """Trains a fresh drafter for ``sizes.steps`` steps on ``order``; exports it to
    ``export_dir``; returns its per-step losses and step times."""
    cfg = bench_job_config(device, drafter=variant, run={"seed": sizes.seed}, optimizer={"lr": sizes.lr},
                           model={"num_layers": model_config.num_hidden_layers,
                                  "block_size": model_config.block_size},
                           objective={"max_anchors_per_seq": sizes.max_anchors_per_seq,
                                      "anchors_per_step": sizes.anchors_per_step})
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    trainer = DrafterTrainer(cfg, model_config, head, device=str(device), total_steps=sizes.steps)
    fifo = collections.deque(order)
    losses, step_s = [], []
    started = time.perf_counter()
    for step in range(sizes.steps):
        result = trainer.step(trainer.take(fifo))
        losses.append(result["loss"])
        step_s.append(result["step_s"])
        if step == 0 or (step + 1) % max(1, sizes.steps // NUM_WINDOWS) == 0:
            logger.info("%s: step %d, loss %.4f, %.1f ms", variant_label(variant), step + 1, result["loss"],
                        result["step_s"] * 1e3)
    save_inference_checkpoint(trainer.model, export_dir)
    peak = torch.cuda.max_memory_allocated(device) / 1024**3 if device.type == "cuda" else None
    del trainer
    reset_compiled_layers()
    _free_memory()
    return {"losses": losses, "step_s": step_s, "train_s": time.perf_counter() - started,
            "peak_memory_gib": peak, "export": export_dir}


def evaluate_drafters(target_dir: str, data_dir: str, model_config: DFlashConfig, exports: dict[str, str],
                      sizes: RunSizes, device: torch.device) -> dict[str, float]:
    """tau of an untrained drafter and of each export, on the same held-out prompts (batched
    greedy speculative decoding, all prompts in flight)."""
    target = BatchedTarget(target_dir, layer_ids=model_config.target_layer_ids, device=device, dtype="bfloat16")
    prompts = held_out_set(TokenDataset(data_dir), num_prompts=sizes.eval_prompts)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(sizes.seed)
        untrained = DFlashDraftModel(model_config).to(device=device, dtype=torch.bfloat16)
    drafters = {"untrained": untrained}
    drafters.update({label: load_inference_checkpoint(path, device=device, dtype=torch.bfloat16)
                     for label, path in exports.items()})
    options = EvalOptions(max_new_tokens=sizes.eval_tokens, batch_size=sizes.eval_prompts, plain=False)
    reports = run_set(target, list(drafters.items()), prompts, renderer=None, options=options)
    taus = {report.label: report.tau for report in reports}
    del target, drafters
    _free_memory()
    return taus


def _free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_precision_comparison(device: str = "cuda:0", shape: str = "qwen3-1.7b", work_dir: str = "/tmp/dflash-precision",
                             variants: list[dict] | None = None, sizes: RunSizes = RunSizes()) -> dict:
    """Builds the assets, trains every variant, evaluates them; prints and returns the figures."""
    sizes.check()
    variants = variants or [{"precision": "bf16"}, {"precision": "fp8"}]
    labels = [variant_label(v) for v in variants]
    if len(set(labels)) != len(labels):
        raise ConfigError(f"bench precision: a variant is asked twice: {labels}")
    dev = _resolve_device(device)
    started = time.perf_counter()
    target_dir, data_dir = build_assets(work_dir, shape, sizes, dev)
    phase_s = {"assets": time.perf_counter() - started}
    model_config = drafter_config(target_dir, sizes.num_layers)
    samples = capture_samples(target_dir, TokenDataset(data_dir), model_config.target_layer_ids, dev)
    order = sequence_order(samples, sizes)
    phase_s["capture"] = time.perf_counter() - started - phase_s["assets"]
    head = FrozenTargetHead.from_pretrained(target_dir, dtype=torch.bfloat16, device=dev)
    runs = {}
    for variant, label in zip(variants, labels):
        export = os.path.join(os.path.abspath(work_dir), "drafter-" + label.replace(" ", "").replace(",", "-"))
        runs[label] = {"variant": variant, **train_variant(variant, model_config, head, order, sizes, dev, export)}
    del head, samples, order
    _free_memory()
    evaluating = time.perf_counter()
    taus = evaluate_drafters(target_dir, data_dir, model_config, {k: r["export"] for k, r in runs.items()},
                             sizes, dev)
    phase_s["evaluation"] = time.perf_counter() - evaluating
    figures = {"shape": shape, "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
               "torch": torch.__version__, "target": target_dir, "data": data_dir, "sizes": asdict(sizes),
               "runs": runs, "tau": taus, "phase_s": phase_s, "wall_s": time.perf_counter() - started}
    print(format_report(figures), flush=True)
    return figures


# --- the report -----------------------------------------------------------------------------------


def window_means(losses: list[float], num_windows: int = NUM_WINDOWS) -> list[float]:
    """Mean loss of each of ``num_windows`` consecutive, near-equal parts of the run."""
    bounds = np.linspace(0, len(losses), min(num_windows, len(losses)) + 1).round().astype(int)
    return [statistics.fmean(losses[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]


def format_report(f: dict) -> str:
    labels = list(f["runs"])
    base = f["runs"][labels[0]]
    s = f["sizes"]
    lines = [f"precision training comparison: {f['shape']} target (random weights, greedy replies) on "
             f"{f['device']}, torch {f['torch']}",
             f"  data     {s['samples']} samples of {s['min_len']}..{s['max_len']} tokens, {s['held_out']} held-out "
             f"prompts; {s['steps']} steps of {s['anchors_per_step']} anchors at lr {s['lr']:g}, "
             f"{s['num_layers']}-layer drafter",
             f"  loss     mean of each tenth of the run (steps 1..{s['steps']})"]
    for label in labels:
        lines.append(f"    {label:<30} " + " ".join(f"{v:6.3f}" for v in window_means(f["runs"][label]["losses"])))
    final_base = window_means(base["losses"])[-1]
    lines.append(f"  {'':<32} {'first':>7} {'final':>7} {'gap':>8} {'step ms':>8} {'peak GiB':>9} {'tau':>6}")
    for label in labels:
        run = f["runs"][label]
        final = window_means(run["losses"])[-1]
        steady = run["step_s"][min(5, len(run["step_s"]) - 1):]  # after the compiling first steps
        peak = f"{run['peak_memory_gib']:.1f}" if run["peak_memory_gib"] is not None else "n/a"
        lines.append(f"  {label:<32} {run['losses'][0]:7.3f} {final:7.3f} {100 * (final / final_base - 1):+7.2f}% "
                     f"{statistics.fmean(steady) * 1e3:8.1f} {peak:>9} {f['tau'][label]:6.3f}")
    lines.append(f"  untrained drafter: tau {f['tau']['untrained']:.3f}; gap = final loss against {labels[0]}'s")
    trained = ", ".join(f"{f['runs'][label]['train_s']:.0f}" for label in labels)
    p = f.get("phase_s", {})
    lines.append(f"  time     {f['wall_s']:.0f} s: assets {p.get('assets', 0):.0f} s, features "
                 f"{p.get('capture', 0):.0f} s, training {trained} s, evaluation {p.get('evaluation', 0):.0f} s")
    return "\n".join(lines)
