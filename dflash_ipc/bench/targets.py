"""``dflash-ipc bench target``: the capacity of several targets, one after the other, in one run.

Each target runs the target-capacity phase of ``bench pipeline`` (``pipeline.target_capacity``:
the job's epoch plan cycled, token ids read as the target worker reads them, the truncated
model's forward into a slot-shaped tensor) with the same config, data and device, so a MoE
target and a dense one are compared on the same batches. Layer ids are derived per target
(the paper's spacing over its depth, as ``resolve_job`` does for a job).

A random-weight target built with fewer layers than its shape (``bench.assets target
--num-layers``) records the shape's depth in ``dflash_bench.json``; the table then also shows
the rate scaled to the layers the full-depth target would run,
``tok/s x layers run / layers run at full depth``, which assumes every decoder layer costs the
same (the embedding, the final norm and the copy of the captured rows are left out).

    dflash-ipc bench target --config configs/8xh200-qwen3-8b.yaml -o data.path=/tmp/data \\
        --target /tmp/qwen3-8b-12l --target /tmp/qwen3-30b-a3b-12l --seconds 30 --warmup-s 10
"""

from __future__ import annotations

import copy
import logging
import os

import torch

from dflash_ipc.bench.assets import BENCH_FILE
from dflash_ipc.config.schema import JobConfig
from dflash_ipc.run.json_files import read_json_object

log = logging.getLogger(__name__)

GIB = 1024**3


def _layers_run(num_layers: int, num_draft_layers: int) -> int:
    from dflash_ipc.hf.layer_ids import captured_layer_ids
    return max(captured_layer_ids(num_layers, num_draft_layers)) + 1


def _shape_of(target_dir: str) -> dict:
    path = os.path.join(target_dir, BENCH_FILE)
    if not os.path.isfile(path):
        return {}
    return read_json_object(path, "the shape file of a built random-weight target")


def _describe(cfg: JobConfig) -> dict:
    """What the target is: its class, depth, experts, and what the capture runs of it."""
    from dflash_ipc.hf.target_config import load_target_config
    from dflash_ipc.hf.text_stack import num_text_layers, text_config
    config = load_target_config(cfg.target.path)
    text = text_config(config)
    depth = num_text_layers(config)
    shape = _shape_of(cfg.target.path)
    full_depth = int(shape.get("shape_num_hidden_layers", depth))
    experts = getattr(text, "num_experts", None) or getattr(text, "num_local_experts", None)
    return {"target": cfg.target.path, "model_type": text.model_type, "shape": shape.get("shape"),
            "hidden_size": int(text.hidden_size), "num_layers": depth, "shape_num_layers": full_depth,
            "num_parameters": shape.get("num_parameters"), "experts": experts,
            "active_experts": getattr(text, "num_experts_per_tok", None),
            "layer_ids": list(cfg.model.target_layer_ids), "layers_run": max(cfg.model.target_layer_ids) + 1,
            "layers_run_at_shape_depth": _layers_run(full_depth, cfg.model.num_layers)}


def run_target_bench(cfg: JobConfig, targets: list[str], *, seconds: float, warmup_s: float) -> list[dict]:
    """Target capacity of each of `targets` with `cfg`'s data, budget and `target.devices[0]`."""
    from dflash_ipc.bench.pipeline import target_capacity
    from dflash_ipc.builtin.assets import materialize
    from dflash_ipc.target.resolve import resolve_job
    rows = []
    for path in targets:
        one = copy.deepcopy(cfg)
        one.target.path = path
        one.model.target_layer_ids = None  # derived from this target's depth
        one = resolve_job(materialize(one))
        row = _describe(one)
        device = torch.device(one.target.device_of(0))
        if device.type == "cuda":
            torch.empty(0, device=device)  # the allocator's stats exist only once CUDA is initialised
            torch.cuda.reset_peak_memory_stats(device)
        row.update(target_capacity(one, seconds=seconds, warmup_s=warmup_s))
        row["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else None
        row["layer_tok_per_s"] = row["tok_per_s"] * row["layers_run"]
        row["tok_per_s_at_shape_depth"] = row["layer_tok_per_s"] / row["layers_run_at_shape_depth"]
        rows.append(row)
        log.info("bench target: %s %.0f tok/s", path, row["tok_per_s"])
    return rows


def format_target_table(rows: list[dict], cfg: JobConfig) -> str:
    """One line per target, then each one's rate against the first's."""
    lines = [f"target capacity: data {cfg.data.path}, token budget {cfg.data.token_budget}, buckets "
             f"{cfg.data.bucket_boundaries}, {cfg.model.num_layers} drafter layers, dtype {cfg.target.dtype}, "
             f"devices {','.join(cfg.target.devices_of(0))}"
             + (f" ({cfg.target.gpus_per_worker} processes, tensor parallel)" if cfg.target.gpus_per_worker > 1 else ""),
             f"  {'target':<28} {'experts':>8} {'layers run':>11} {'tok/s':>9} {'layer-tok/s':>12} "
             f"{'at shape depth':>18} {'peak':>8}  batches"]
    for r in rows:
        experts = f"{r['active_experts']}/{r['experts']}" if r["experts"] else "dense"
        depth = (f"{r['tok_per_s_at_shape_depth']:,.0f} ({r['layers_run_at_shape_depth']} run)"
                 if r["shape_num_layers"] != r["num_layers"] else "(full depth)")
        peak = f"{r['peak_memory_gib']:.1f} GiB" if r["peak_memory_gib"] is not None else "n/a"
        name = r["shape"] or os.path.basename(r["target"].rstrip("/"))
        lines.append(f"  {name[:28]:<28} {experts:>8} {r['layers_run']:>4} of {r['num_layers']:<4} "
                     f"{r['tok_per_s']:>9,.0f} {r['layer_tok_per_s']:>12,.0f} {depth:>18} {peak:>8}  "
                     f"{r['batches']} in {r['seconds']:.1f} s")
    for r in rows[1:]:
        lines.append(f"  {r['shape'] or r['target']} / {rows[0]['shape'] or rows[0]['target']}: "
                     f"{r['tok_per_s'] / rows[0]['tok_per_s']:.2f}x tok/s as measured, "
                     f"{r['tok_per_s_at_shape_depth'] / rows[0]['tok_per_s_at_shape_depth']:.2f}x at shape depth")
    return "\n".join(lines)
