"""`export` (the SGLang/vLLM format and a model card) and `eval` (tau, speedup, lossless)."""

from __future__ import annotations

import os
import sys

import click

from dflash_ipc.config.schema import DTYPE_NAMES
from dflash_ipc.run.json_files import json_safe
from dflash_ipc.cli.app import checked_device, main



@main.command()
@click.argument("checkpoint", type=click.Path(exists=True, file_okay=False))
@click.argument("out_dir", type=click.Path(file_okay=False))
@click.option("--with-code", is_flag=True,
              help="Also write modeling_dflash.py and config.json auto_map: AutoModel.from_pretrained(OUT_DIR, "
                   "trust_remote_code=True) then loads it in plain transformers, with spec_generate().")
@click.option("--base-model", default=None, metavar="ORG/NAME",
              help="Hub id of the target for the model card (default: from the run's target path when it is "
                   "a Hub id or lies in the Hub cache).")
@click.option("--repo-id", default=None, metavar="ORG/NAME",
              help="Where the export will be uploaded, for the card's usage lines (default: OUT_DIR's name).")
def export(checkpoint, out_dir, with_code, base_model, repo_id) -> None:
    """Write the SGLang/vLLM inference format (config.json + model.safetensors) and a model card."""
    from dflash_ipc.drafter.export_dir import check_export_target
    check_export_target(os.path.abspath(out_dir))  # before torch is imported: a wrong OUT_DIR is answered at once
    from dflash_ipc.drafter.inference_format import checkpoint_step_dir, export_step_dir
    from dflash_ipc.export.hub_code import publish_files
    step_dir = checkpoint_step_dir(checkpoint)  # resolved and verified once
    extras = publish_files(step_dir, out_dir, with_code=with_code, base_model=base_model, repo_id=repo_id)
    path = export_step_dir(step_dir, out_dir, extras=extras)
    click.echo(f"exported {path} (model card README.md{', modeling_dflash.py' if with_code else ''}); "
               f"publish with: huggingface-cli upload {repo_id or 'ORG/NAME'} {path}")
    from dflash_ipc.drafter.inference_format import CONFIG_FILE
    from dflash_ipc.export.serving_notes import sliding_layout_notes
    from dflash_ipc.run.json_files import read_json_object
    for note in sliding_layout_notes(read_json_object(os.path.join(path, CONFIG_FILE), "drafter export config")):
        click.echo(f"note: {note}")


@main.command("eval")
@click.option("--target", "target_dir", required=True, type=click.Path(file_okay=False),
              help="HF target model directory, or its Hub id ORG/NAME.")
@click.option("--drafter", required=True, type=click.Path(file_okay=False),
              help="Export, checkpoint step dir, checkpoints root (latest), or an exported drafter's Hub id.")
@click.option("--data", "data_dir", default=None, type=click.Path(exists=True, file_okay=False),
              help="Prepared dataset: its declared held-out prompts, else its last --num-prompts samples.")
@click.option("--prompts", "prompt_files", multiple=True, metavar="[NAME=]FILE.jsonl|ORG/NAME",
              help="Prompt set (repeatable), a JSONL file or a Hub dataset id: rows with turns (MT-Bench), "
                   "question, problem, prompt or messages.")
@click.option("--num-prompts", type=click.IntRange(min=1), default=None,
              help="Prompts per set [default: 16 of --data, every row of a --prompts file].")
@click.option("--max-new-tokens", default=64, show_default=True, type=click.IntRange(min=1), help="Per turn.")
@click.option("--batch-size", default=64, show_default=True, type=click.IntRange(min=1),
              help="Sequences decoded at once.")
@click.option("--temperature", default=0.0, show_default=True, type=click.FloatRange(min=0),
              help="0: greedy; > 0: speculative sampling.")
@click.option("--top-p", default=1.0, show_default=True, type=click.FloatRange(min=0, max=1, min_open=True))
@click.option("--seed", default=0, show_default=True, help="Sampling seed; also the untrained drafter's.")
@click.option("--chat-template-kwargs", "--template-kwargs", "template_kwargs", multiple=True, metavar="JSON|KEY=VALUE",
              help="Chat-template variables for --prompts files, as for prepare: '{\"enable_thinking\": false}' or "
                   "enable_thinking=false (repeatable).")
@click.option("--device", default="cpu", show_default=True, callback=checked_device)
@click.option("--dtype", type=click.Choice(["auto", *DTYPE_NAMES]), default="auto",
              show_default=True, help="auto: float32 on CPU, bfloat16 on GPU.")
@click.option("--check-lossless", is_flag=True,
              help="Compare with plain greedy decoding; exit 1 on a mismatch (a numerical near-tie is reported).")
@click.option("--near-tie-ulps", default=4.0, show_default=True, type=click.FloatRange(min=0),
              help="A difference is a near-tie when both margins are within this many ulps of the top logit.")
@click.option("--skip-plain", is_flag=True, help="Do not decode plainly (no speedup, no lossless check).")
@click.option("--timing-repeats", default=3, show_default=True, type=click.IntRange(min=1),
              help="(plain, speculative) pairs per drafter, each back to back on the same decoders: the first "
                   "gives the outputs, the speedup is the median of the others (1: the first pair's ratio).")
@click.option("--vs-untrained", is_flag=True, help="Also evaluate an untrained drafter of the same shape.")
@click.option("--json", "as_json", is_flag=True, help="Print the reports as JSON.")
@click.option("--save-to", "save_to", type=click.Path(exists=True, file_okay=False), default=None, metavar="RUN_DIR",
              help="Also append the results to RUN_DIR/eval_results.jsonl (read by report and export).")
def eval_cmd(target_dir, drafter, data_dir, prompt_files, num_prompts, max_new_tokens, batch_size, temperature,
             top_p, seed, template_kwargs, device, dtype, check_lossless, near_tie_ulps, skip_plain, timing_repeats,
             vs_untrained, as_json, save_to) -> None:
    """Batched speculative decoding of prompt sets: tau, acceptance per position, tokens/s, speedup."""
    import json
    from dflash_ipc.eval.report import format_comparison
    from dflash_ipc.eval.sampling import Sampling
    from dflash_ipc.data.messages import parse_template_kwargs
    from dflash_ipc.eval.speculative import EvalOptions, evaluate_sets
    from dflash_ipc.decode.sampler import check_seed
    from dflash_ipc.run.logs import setup_logging
    check_seed(seed, "--seed")
    if save_to is not None:  # before any model is loaded: not an error after the whole evaluation
        from dflash_ipc.run.eval_results import check_appendable
        check_appendable(save_to)
    setup_logging("eval")
    options = EvalOptions(max_new_tokens=max_new_tokens, batch_size=batch_size, plain=not skip_plain,
                          timing_repeats=timing_repeats,
                          sampling=Sampling(temperature=temperature, top_p=top_p, seed=seed),
                          check_lossless=check_lossless, near_tie_ulps=near_tie_ulps,
                          progress=lambda line: click.echo(line, err=True))
    reports = evaluate_sets(target_dir, drafter, data_dir=data_dir, prompt_files=prompt_files,
                            num_prompts=num_prompts, device=device, dtype=dtype, vs_untrained=vs_untrained,
                            seed=seed, template_kwargs=parse_template_kwargs(template_kwargs), options=options)
    if as_json:
        click.echo(json.dumps(json_safe([r.to_dict() for r in reports]), indent=1, allow_nan=False))
    elif vs_untrained:
        click.echo("\n".join(format_comparison(*reports[i:i + 2]) for i in range(0, len(reports), 2)))
    else:
        click.echo("\n".join(r.format() for r in reports))
    if save_to is not None:
        from dflash_ipc.run.eval_results import save_eval_results
        path = save_eval_results(save_to, [r.to_dict() for r in reports],
                                 baseline=[vs_untrained and i % 2 == 0 for i in range(len(reports))])
        click.echo(f"saved to {path}", err=as_json)  # stdout stays pure JSON with --json
    if any(r.lossless_mismatches for r in reports):
        sys.exit(1)
