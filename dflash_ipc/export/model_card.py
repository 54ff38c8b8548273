"""The model card of an export: `README.md` with the Hub's YAML metadata, so that
`huggingface-cli upload ORG/NAME OUT_DIR` makes a proper model page.

    ---
    base_model: Qwen/Qwen3-8B          the target (omitted, with a warning, when unknown)
    library_name: transformers         only with --with-code: then plain transformers loads it
    tags: [dflash, speculative-decoding, draft-model, block-diffusion, dflash-ipc]
    ---
    # ... what it is, how to serve it (SGLang, vLLM, transformers), the training config,
    # the data, the steps, the latest saved evaluation (per prompt set: tau, tokens/s,
    # speedup, acceptance by position)

No `pipeline_tag`: a drafter generates nothing alone, and `text-generation` would list it among
models the Hub's widget could run. What the card says comes from the export's `config.json`
and, when the checkpoint lies in a run directory (`RUN_DIR/checkpoints/step_N`), from that
run: `config.yaml`, the dataset's `meta.json` and `eval_results.jsonl`. Local paths are
written as their last component only (a target in the Hub cache as its Hub id).
"""

from __future__ import annotations

import logging
import math
import os
import re

import yaml

from dflash_ipc.config.load import read_config_file
from dflash_ipc.data.dataset import META_FILE
from dflash_ipc.run.checkpoints import step_of_dir_name
from dflash_ipc.errors import DataError
from dflash_ipc.run.eval_results import latest_evaluation
from dflash_ipc.run.json_files import read_json_object
from dflash_ipc.run.files import RunFiles

log = logging.getLogger(__name__)

CARD_FILE = "README.md"
TAGS = ("dflash", "speculative-decoding", "draft-model", "block-diffusion", "dflash-ipc")
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
HUB_CACHE_DIR = re.compile(r"models--([\w.-]+)--([\w.-]+)$")  # huggingface_hub's cache layout
CARD_SECTIONS = ("target", "drafter", "model", "data", "optimizer", "schedule", "objective", "checkpoint")
PATH_KEYS = {("target", "path"), ("data", "path")}
LABEL_PATH = re.compile(r"[^\s()]*/")  # a path up to its last component


def base_model_of(target_path: str | None) -> str | None:
    """The Hub id of a target: a path in the Hub cache (`.../models--ORG--NAME/snapshots/REV`)
    names it; so does a config value that is an id rather than a local directory."""
    if not target_path:
        return None
    for part in reversed(os.path.normpath(target_path).split(os.sep)):
        if match := HUB_CACHE_DIR.match(part):
            return f"{match.group(1)}/{match.group(2)}"
    if HUB_ID.match(target_path) and not os.path.exists(target_path):
        return target_path
    return None


def _run_dir_of(step_dir: str) -> str | None:
    """RUN_DIR when step_dir is RUN_DIR/checkpoints/step_N of a run (its config.yaml there)."""
    root = os.path.dirname(os.path.abspath(step_dir))
    run_dir = os.path.dirname(root)
    files = RunFiles(run_dir)
    return run_dir if root == files.checkpoints and os.path.isfile(files.job_config) else None


def _step_of(step_dir: str) -> int | None:
    return step_of_dir_name(os.path.basename(os.path.normpath(step_dir)))


def _training_config(run_dir: str) -> dict:
    """The card's sections of the run's resolved config, local paths as their last component."""
    tree = read_config_file(RunFiles(run_dir).job_config)  # bounded, strict YAML
    sections = {name: dict(tree[name]) for name in CARD_SECTIONS if isinstance(tree.get(name), dict)}
    for section, key in PATH_KEYS:
        value = sections.get(section, {}).get(key)
        if isinstance(value, str) and value.startswith(os.sep):
            sections[section][key] = base_model_of(value) or os.path.basename(os.path.normpath(value))
    return {"sections": sections, "target_path": (tree.get("target") or {}).get("path"),
            "data_path": (tree.get("data") or {}).get("path"), "run": tree.get("run") or {}}


def _dataset_meta(data_path: str | None) -> dict | None:
    """The dataset's meta.json, or None (no local dataset, or not readable as one)."""
    if not data_path or not os.path.isdir(data_path):
        return None
    try:
        return read_json_object(os.path.join(data_path, META_FILE), "dataset metadata")
    except DataError:
        return None


def card_facts(step_dir: str, drafter_config: dict, *, base_model: str | None = None) -> dict:
    """Everything the card states, gathered from the checkpoint and its run directory."""
    run_dir = _run_dir_of(step_dir)
    facts = {"step": _step_of(step_dir), "drafter": drafter_config, "run_dir": run_dir,
             "training": None, "data": None, "eval": None}
    if run_dir is not None:
        facts["training"] = _training_config(run_dir)
        facts["data"] = _dataset_meta(facts["training"]["data_path"])
        facts["eval"] = latest_evaluation(run_dir)
    target_path = (facts["training"] or {}).get("target_path")
    facts["base_model"] = base_model or base_model_of(target_path)
    facts["target_name"] = facts["base_model"] or (os.path.basename(target_path) if target_path else None)
    return facts


def front_matter(facts: dict, *, with_code: bool) -> dict:
    meta: dict = {}
    if facts["base_model"]:
        meta["base_model"] = facts["base_model"]
    if with_code:
        meta["library_name"] = "transformers"
    meta["tags"] = list(TAGS)
    return meta


def _fmt(value, spec: str = ".2f") -> str:
    return "-" if not isinstance(value, (int, float)) or not math.isfinite(value) else format(value, spec)


def _usage(facts: dict, repo: str, *, with_code: bool) -> list[str]:
    d = facts["drafter"]
    target = facts["base_model"] or "TARGET_MODEL"
    lines = ["## Use", "", "SGLang:", "", "```bash",
             f"python -m sglang.launch_server --model-path {target} \\",
             f"    --speculative-algorithm DFLASH --speculative-draft-model-path {repo}", "```", "",
             "vLLM:", "", "```bash",
             f"vllm serve {target} --speculative-config "
             f"'{{\"method\": \"dflash\", \"model\": \"{repo}\", \"num_speculative_tokens\": {d['block_size'] - 1}}}'",
             "```", ""]
    if with_code:
        lines += ["transformers (`modeling_dflash.py` of this repository: greedy block drafting, target "
                  "verification):", "", "```python",
                  "from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer",
                  f"draft = AutoModel.from_pretrained(\"{repo}\", trust_remote_code=True, dtype=\"auto\").eval()",
                  f"target = AutoModelForCausalLM.from_pretrained(\"{target}\", dtype=\"auto\").eval()",
                  f"tok = AutoTokenizer.from_pretrained(\"{target}\")",
                  "ids = tok.apply_chat_template([{\"role\": \"user\", \"content\": \"Hi!\"}], "
                  "add_generation_prompt=True, return_tensors=\"pt\", return_dict=True)[\"input_ids\"]",
                  "out = draft.spec_generate(target, ids, max_new_tokens=256, stop_token_ids=[tok.eos_token_id])",
                  "print(tok.decode(out[0, ids.shape[1]:]), draft.last_stats[\"tau\"])", "```", ""]
    return lines


def _training(facts: dict) -> list[str]:
    lines = ["## Training", ""]
    if facts["step"] is not None:
        lines.append(f"- optimizer steps: {facts['step']}")
    training, data = facts["training"], facts["data"]
    if training is None:
        return lines + ["- the checkpoint was exported outside its run directory: no training record", ""]
    sections = training["sections"]
    epochs = sections.get("data", {}).get("num_epochs")
    if data:
        lines.append(f"- data: `{sections.get('data', {}).get('path')}`, {data.get('num_samples', '-')} samples, "
                     f"{data.get('num_tokens', '-')} tokens ({data.get('num_loss_tokens', '-')} with loss), "
                     f"{epochs} epoch(s)")
    workers = sections.get("drafter", {}).get("num_workers")
    nodes = training["run"].get("num_nodes", 1)
    if workers:
        lines.append(f"- drafter ranks: {workers * nodes} ({nodes} node(s)), "
                     f"{sections.get('objective', {}).get('anchors_per_step')} anchors per rank and step")
    return lines + ["", "Training config (dflash-ipc `config.yaml`):", "", "```yaml",
                    yaml.safe_dump(sections, sort_keys=False).rstrip(), "```", ""]


def _public_label(label: str) -> str:
    """An eval label with each path reduced to its last component (a card is public):
    `trained (/home/me/runs/x/checkpoints/step_00000060)` -> `trained (step_00000060)`."""
    return LABEL_PATH.sub("", label)


def _decoding(result: dict) -> str:
    """How the evaluation decoded, from its saved options."""
    sampling = result.get("sampling") or {}
    temperature = sampling.get("temperature") or 0.0
    how = ("greedy" if not temperature
           else f"sampled at temperature {temperature:g}, top-p {sampling.get('top_p', 1.0):g}")
    extra = [f"up to {result['max_new_tokens']} new tokens per turn"] if result.get("max_new_tokens") else []
    extra += [f"batch {result['batch_size']}"] if result.get("batch_size") else []
    extra += [result["dtype"]] if result.get("dtype") else []
    return ", ".join([how, *extra])


def _evaluation(facts: dict) -> list[str]:
    results = facts["eval"]
    if not results:
        return ["## Evaluation", "",
                "No evaluation was saved with the run (`dflash-ipc eval ... --save-to RUN_DIR`).", ""]
    first = results[0]
    lines = ["## Evaluation", "",
             f"`dflash-ipc eval` of {_public_label(first.get('label', 'the drafter'))}: speculative decoding "
             f"({_decoding(first)}); tau is the acceptance length, committed tokens per target forward; the "
             f"speedup is over plain decoding of the same prompts in the same run (the median of interleaved "
             f"timed pairs), on the device named.", "",
             "| prompt set | prompts | tau | tokens/s | speedup | device |", "|---|---|---|---|---|---|"]
    for r in results:
        speedup = _fmt(r.get("speedup"))
        device = r.get("device") if isinstance(r.get("device"), str) and r.get("device") else "-"
        lines.append(f"| {r.get('prompt_set') or '-'} | {r.get('num_prompts', '-')} | **{_fmt(r.get('tau'))}** | "
                     f"{_fmt(r.get('tokens_per_s'), ',.0f')} | {speedup + 'x' if speedup != '-' else '-'} | "
                     f"{device} |")
    longest = max(len(r["acceptance_per_position"]) for r in results)
    lines += ["", "Acceptance by block position:", "",
              "| prompt set | " + " | ".join(str(k) for k in range(1, longest + 1)) + " |",
              "|---" * (longest + 1) + "|"]
    for r in results:
        rates = list(r["acceptance_per_position"]) + [None] * (longest - len(r["acceptance_per_position"]))
        lines.append(f"| {r.get('prompt_set') or '-'} | " + " | ".join(_fmt(v) for v in rates) + " |")
    return lines + [""]


def render_card(facts: dict, *, repo: str, with_code: bool) -> str:
    d = facts["drafter"]
    dflash = d.get("dflash_config") or {}
    about = (f"A [DFlash](https://arxiv.org/abs/2602.06036) block-diffusion drafter for speculative decoding"
             f"{' of ' + facts['target_name'] if facts['target_name'] else ''}, trained with dflash-ipc: "
             f"{d['num_hidden_layers']} layer(s) of width {d['hidden_size']}, blocks of {d['block_size']} "
             f"(up to {d['block_size'] - 1} drafted tokens per target forward), conditioned on target layers "
             f"{dflash.get('target_layer_ids')}. The target's embedding and LM head are used, not stored here.")
    sliding = [i for i, kind in enumerate(d.get("layer_types") or []) if kind == "sliding_attention"]
    if sliding:
        about += (f" Layer(s) {', '.join(map(str, sliding))} use sliding-window attention (window "
                  f"{d.get('sliding_window')}, causal in the block; `layer_types` and `sliding_window` in config.json, "
                  f"as SGLang and vLLM read them; vLLM runs a mix of sliding and full layers on its V2 model runner).")
    body = [f"# {os.path.basename(repo.rstrip('/')) or repo}", "", about, "",
            *_usage(facts, repo, with_code=with_code), *_training(facts), *_evaluation(facts)]
    meta = yaml.safe_dump(front_matter(facts, with_code=with_code), sort_keys=False)
    return f"---\n{meta}---\n\n" + "\n".join(body)


def write_model_card(export_dir: str, step_dir: str, *, base_model: str | None = None, repo_id: str | None = None,
                     with_code: bool = False) -> str:
    """Writes `export_dir/README.md` for the checkpoint `step_dir`; returns its path."""
    drafter_config = read_json_object(os.path.join(export_dir, "config.json"), "drafter export config")
    facts = card_facts(step_dir, drafter_config, base_model=base_model)
    if facts["base_model"] is None:
        log.warning("model card without base_model: the target is not a Hub id; pass --base-model ORG/NAME")
    path = os.path.join(export_dir, CARD_FILE)
    with open(path, "w", encoding="utf-8") as f:
        f.write(render_card(facts, repo=repo_id or os.path.basename(os.path.normpath(export_dir)),
                            with_code=with_code))
    return path
