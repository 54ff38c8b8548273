"""`dflash-ipc bench ...`: benchmarks that print figures."""

from __future__ import annotations


import click

from dflash_ipc.config.schema import DTYPE_NAMES, PUBLISH_SYNC_MODES
from dflash_ipc.dispatch.policy import POLICIES
from dflash_ipc.run.json_files import write_json_atomic
from dflash_ipc.cli.checks import FiniteFloatRange, made_directory, ordered_range, writable_output
from dflash_ipc.cli.app import (add_options, checked_device, comma_list, config_option, int_list, load_job_config, main,
                                override_option, resolved)



@main.group()
def bench() -> None:
    """Benchmarks that print figures."""


@bench.command("dispatch")
@click.option("--samples", "num_samples", default=20000, show_default=True, help="Sequences in the epoch plan.")
@click.option("--targets", "num_targets", default=5, show_default=True)
@click.option("--drafters", "num_drafters", default=3, show_default=True)
@click.option("--policy", "policies", multiple=True, type=click.Choice(POLICIES),
              help="Repeatable; default: both, in the same invocation.")
@click.option("--target-speeds", default=None, metavar="S0,S1,...",
              help="Relative speed of each target, e.g. 1,1,1,1,0.5 (default: all 1).")
@click.option("--time-scale", default=0.018, show_default=True, help="Bench seconds per modelled GPU second.")
@click.option("--seed", default=0, show_default=True)
@click.option("--out", "out_path", default=None, type=click.Path(dir_okay=False),
              help="Also write every figure and the targets' busy intervals as JSON.")
def bench_dispatch(num_samples, num_targets, num_drafters, policies, target_speeds, time_scale, seed,
                   out_path) -> None:
    """Pull against round-robin: the real dispatcher and sockets, cost-model fake workers."""
    from dflash_ipc.bench.dispatch import parse_speeds, run_dispatch_bench
    result = run_dispatch_bench(num_targets=num_targets, num_drafters=num_drafters, num_samples=num_samples,
                                policies=policies or POLICIES, seed=seed, time_scale=time_scale,
                                target_speeds=parse_speeds(target_speeds) if target_speeds else None)
    if out_path:
        write_json_atomic(out_path, result)


@bench.command("transport")
@click.option("--pair", "pairs", multiple=True, metavar="SRC,DST",
              help="Device pair, e.g. cuda:0,cuda:1 (repeatable; default: what this machine has).")
@click.option("--iters", default=50, show_default=True)
@click.option("--size-mib", "sizes_mib", multiple=True, type=click.FloatRange(min=0, min_open=True),
              help="Batch size in MiB (repeatable; default: 1 16 128 512 on GPUs, 1 16 64 on CPU).")
@click.option("--settle-us", default=0.0, show_default=True, type=click.FloatRange(min=0),
              help="Diagnostic: wait this long after each notice before reading.")
@click.option("--publish-sync", type=click.Choice(PUBLISH_SYNC_MODES), default="ipc_event",
              show_default=True, help="How the producer orders reads after its writes "
              "(target.publish_sync).")
def bench_transport(pairs, iters, sizes_mib, settle_us, publish_sync) -> None:
    """Slot handoff latency and copy bandwidth against a plain device-to-device copy."""
    from dflash_ipc.bench.transport import run_transport_bench
    run_transport_bench(pairs=[tuple(pair.split(",")) for pair in pairs] or None, iters=iters,
                        sizes_mib=list(sizes_mib) or None, settle_us=settle_us,
                        publish_sync=publish_sync)


def precision_options(default: str):
    """--precision / --fp8-recipe / --fp8-lm-head: comma lists, compared in one run."""
    return lambda fn: add_options(fn, [
        click.option("--precision", "precisions", default=default, show_default=True, callback=comma_list,
                     metavar="P[,P...]", help="drafter.precision of each run: bf16, fp8 (e.g. bf16,fp8)."),
        click.option("--fp8-recipe", "recipes", default="tensorwise", show_default=True, callback=comma_list,
                     metavar="R[,R...]", help="drafter.fp8_recipe of the fp8 runs: tensorwise, rowwise, delayed."),
        click.option("--fp8-lm-head", "lm_heads", default="all", show_default=True, callback=comma_list,
                     metavar="H[,H...]", help="drafter.fp8_lm_head of the fp8 runs: all, grad, none."),
        click.option("--fp8-shared-casts", "shared_casts", default="off", show_default=True, callback=comma_list,
                     metavar="S[,S...]", help="drafter.fp8_shared_casts of the fp8 runs: off (each layer on its "
                                              "own), on (layers that read one input cast it once); off,on compares."),
        click.option("--fp8-layers", "layers", default="on", show_default=True, callback=comma_list,
                     metavar="L[,L...]", help="drafter.fp8_layers of the fp8 runs: on (the linear layers in float8), "
                                              "off (only the LM head); on,off compares.")])


# bench/drafter.py's SHAPES (a test checks they agree; importing it here would load torch).
BENCH_DRAFTER_SHAPES = ["qwen3-8b", "qwen3-1.7b", "smollm2-135m", "tiny"]


@bench.command("drafter")
@click.option("--device", default="cuda:0", show_default=True, callback=checked_device)
@click.option("--steps", default=10, show_default=True)
@click.option("--warmup", default=3, show_default=True,
              help="Untimed steps first (the first compiles; with fp8 the third too: a row count seen twice runs static from the next step).")
@click.option("--shape", type=click.Choice(BENCH_DRAFTER_SHAPES), default="qwen3-8b", show_default=True,
              help="Target shape of the drafter: qwen3-8b (5 layers), qwen3-1.7b (5 layers), smollm2-135m "
                   "(hidden 576, vocab 49,152, 3 layers); tiny: hidden 64, 2 layers, vocab 512, same step "
                   "sizes (a quick GPU smoke test).")
@click.option("--seq-len", "seq_lens", multiple=True, type=int, default=(2048,), show_default=True,
              help="Tokens per sequence (context keys per sequence); repeatable: one report per length, "
                   "in one process (the bf16 parts compiled once; fp8 layers per variant).")
@click.option("--num-seqs", default=4, show_default=True, help="Sequences per step.")
@click.option("--anchors-per-seq", default=512, show_default=True, help="Anchors (blocks) per sequence.")
@precision_options(default="bf16")
@click.option("--compile", "compiles", default="off", show_default=True, callback=comma_list, metavar="M[@G][,...]",
              help="drafter.compile of each run: off, default, max-autotune-no-cudagraphs, reduce-overhead; "
                   "@G sets drafter.lm_head_chunk_gib (e.g. off@1.5,off,reduce-overhead). Every precision "
                   "runs with each.")
@click.option("--ragged", is_flag=True,
              help="Sequence lengths vary, uniform in [seq-len/4, seq-len]: the context changes every step, as in "
                   "training (the anchors stay --anchors-per-seq).")
@click.option("--profile", "profile_steps", default=0, show_default=True,
              help="Profile this many more steps (CUDA): kernel time per step by kind (matmul fp8 / "
                   "matmul / attention / fp8 scaling / fused elementwise / other) and the costliest kernels.")
@click.option("--host-profile", "host_profile_steps", default=0, show_default=True,
              help="Run this many more steps under cProfile: the host's time per step by function (self and "
                   "cumulative ms) and the garbage collector's passes and ms, where wall time exceeds kernel time.")
@click.option("--gc-freeze", is_flag=True,
              help="After the warm-up steps, collect once and freeze the heap (gc.freeze): the garbage collector's "
                   "later passes skip what the compile left. Measures what its passes cost the step.")
def bench_drafter(device, steps, warmup, shape, seq_lens, num_seqs, anchors_per_seq, precisions, recipes,
                  lm_heads, shared_casts, layers, compiles, ragged, profile_steps, host_profile_steps,
                  gc_freeze) -> None:
    """Step time, MFU and peak memory of a drafter step (default: Qwen3-8B shape, 4 x 2,048 tokens,
    512 anchors each = 32,768 query tokens), for each precision asked (with the speedup against
    the first) at each --seq-len."""
    from dflash_ipc.bench.drafter import compare_precisions, precision_variants
    variants = precision_variants(precisions, recipes, lm_heads, compiles, shared_casts, layers)
    for seq_len in seq_lens:
        compare_precisions(device=device, steps=steps, shape=shape, variants=variants, warmup=warmup,
                           anchors_per_seq=anchors_per_seq, num_seqs=num_seqs, seq_len=seq_len,
                           profile_steps=profile_steps, ragged=ragged, host_profile_steps=host_profile_steps,
                           gc_freeze=gc_freeze)


@bench.command("target")
@config_option
@override_option
@click.option("--target", "targets", multiple=True, required=True, type=click.Path(exists=True, file_okay=False),
              help="Target model directory (repeatable: measured one after the other, same data and device).")
@click.option("--seconds", default=30.0, show_default=True, help="Measured seconds per target.")
@click.option("--warmup-s", default=10.0, show_default=True, help="Seconds of warmup per target.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None, callback=writable_output, help="Also write the figures.")
def bench_target(config, overrides, targets, seconds, warmup_s, json_path) -> None:
    """Target capacity (tok/s of one worker: on target.devices[0], or its first K devices with
    target.gpus_per_worker K) of each --target, e.g. a MoE next to a dense one."""
    from dflash_ipc.bench.targets import format_target_table, run_target_bench
    from dflash_ipc.run.logs import setup_logging
    cfg = load_job_config(config, overrides)
    setup_logging("bench", level=cfg.run.log_level)
    rows = run_target_bench(cfg, list(targets), seconds=seconds, warmup_s=warmup_s)
    if json_path:
        write_json_atomic(json_path, rows)
    click.echo(format_target_table(rows, cfg))


def _run_sizes_options(fn):
    """One option per `RunSizes` field, its default the dataclass's."""
    from dataclasses import asdict

    from dflash_ipc.bench.run_sizes import RunSizes
    return add_options(fn, [click.option(f"--{name.replace('_', '-')}", name, type=type(value), default=value,
                                          show_default=True) for name, value in asdict(RunSizes()).items()])


@bench.command("precision")
@click.option("--device", default="cuda:0", show_default=True, callback=checked_device)
@click.option("--shape", type=click.Choice(["tiny", "qwen3-0.6b", "qwen3-1.7b", "qwen3-8b"]), default="qwen3-1.7b",
              show_default=True, help="Shape of the random-weight target (bench/assets.py); not with --target.")
@click.option("--target", "target_dir", default=None, type=click.Path(exists=True, file_okay=False),
              help="A real target (HF model directory); with --data, instead of the random-weight --shape.")
@click.option("--data", "data_dir", default=None, type=click.Path(exists=True, file_okay=False),
              help="Its prepared dataset, with held-out prompts (dflash-ipc prepare --held-out N): "
                   "--samples/--min-len/--max-len/--held-out are then unused.")
@click.option("--mask-token-id", default=None, type=int,
              help="model.mask_token_id of the drafter (default: derived as a job derives it).")
@click.option("--recipes", "recipe_names", default=None, callback=lambda ctx, p, v: comma_list(ctx, p, v) if v else None,
              metavar="NAME[,NAME...]",
              help="Recipes to compare, in order (bench/recipes.py), each on the paper's recipe: paper, dpace, swa, muon, wsd, "
                   "default (the job defaults), bf16, fp8, --recipe ones, and '+' combinations (dpace+muon); instead of --precision.")
@click.option("--recipe", "definitions", multiple=True, metavar="NAME=KEY=VALUE[,KEY=VALUE...]",
              help="Define a recipe by config overrides, e.g. muon10=optimizer.name=muon,optimizer.muon_lr=6e-3 "
                   "(repeatable).")
@click.option("--budget-s", default=None, type=float,
              help="Equal wall time: each recipe trains as many steps as fit this many seconds (timed on a "
                   "few steps first); default: --steps each.")
@click.option("--work-dir", default="/tmp/dflash-precision", show_default=True,
              help="Target, data and exported drafters; the target and data are reused while they match.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None, callback=writable_output,
              help="Also write every figure (the per-step losses included) as JSON.")
@precision_options(default="bf16,fp8")
@_run_sizes_options
def bench_precision(device, shape, target_dir, data_dir, mask_token_id, recipe_names, definitions, budget_s, work_dir,
                    json_path, precisions, recipes, lm_heads, shared_casts, layers, **sizes) -> None:
    """The same drafter trained under several recipes (default: each --precision): loss curves,
    final-loss gap, tau and its spread over held-out prompts, lossless check."""
    from dflash_ipc.bench import recipes as named
    from dflash_ipc.bench.drafter import precision_variants
    from dflash_ipc.bench.precision import run_precision_comparison
    from dflash_ipc.bench.run_sizes import RunSizes
    from dflash_ipc.run.logs import setup_logging
    setup_logging("bench")
    chosen = None
    if recipe_names:
        defined = dict(named.parse_definition(d) for d in definitions)
        chosen = named.resolve(recipe_names, defined, num_layers=sizes["num_layers"])
    elif definitions:
        raise click.UsageError("--recipe defines recipes for --recipes: name them there")
    variants = precision_variants(precisions, recipes, lm_heads, shared_casts=shared_casts, layers=layers)
    run_precision_comparison(device=device, shape=shape, work_dir=work_dir, sizes=RunSizes(**sizes),
                             variants=variants, recipes=chosen,
                             target_dir=target_dir, data_dir=data_dir, mask_token_id=mask_token_id,
                             budget_s=budget_s, json_path=json_path)


@bench.command("pipeline")
@config_option
@override_option
@click.option("--seconds", default=60.0, show_default=True, help="Measured seconds of each phase.")
@click.option("--warmup-s", default=30.0, show_default=True,
              help="Seconds of warmup after the first batch / drafter step of each phase (end to end: after "
                   "the first drafter step), before the measured seconds.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None, callback=writable_output,
              help="Also write every figure as JSON (input of dflash-ipc plan --from-bench).")
@click.option("--run-dir", default=None, type=click.Path(file_okay=False),
              help="Fresh run directory of the end-to-end job (default: <run.run_dir>-bench-<time>).")
def bench_pipeline(config, overrides, seconds, warmup_s, json_path, run_dir) -> None:
    """Target capacity, drafter capacity and end-to-end tok_rate of one job, and their ratio."""
    from dflash_ipc.bench.pipeline import format_table, run_pipeline_bench
    from dflash_ipc.run.logs import setup_logging
    cfg = load_job_config(config, overrides)
    setup_logging("bench", level=cfg.run.log_level)
    figures = run_pipeline_bench(resolved(cfg), seconds=seconds, warmup_s=warmup_s, run_dir=run_dir)
    if json_path:
        write_json_atomic(json_path, figures)
    click.echo(format_table(figures))


@bench.command("regenerate")
@click.option("--shape", type=click.Choice(["tiny", "qwen3-0.6b", "qwen3-1.7b", "qwen3-8b"]), default="qwen3-1.7b",
              show_default=True, help="Random-weight target of this shape (built in a temporary directory).")
@click.option("--target", default=None, type=click.Path(exists=True, file_okay=False),
              help="A model directory instead of --shape.")
@click.option("--device", default="cuda:0", show_default=True, callback=checked_device)
@click.option("--prompts", "num_prompts", default=512, show_default=True, type=click.IntRange(min=1),
              help="Prompts of the batched phases.")
@click.option("--one-at-a-time", "num_single", default=4, show_default=True, type=click.IntRange(min=1),
              help="Prompts generated alone (the one-at-a-time phase).")
@click.option("--min-prompt", default=64, show_default=True, type=click.IntRange(min=1), help="Shortest prompt, tokens.")
@click.option("--max-prompt", default=256, show_default=True, type=click.IntRange(min=1), help="Longest prompt, tokens.")
@click.option("--min-new-tokens", type=click.IntRange(min=1), default=None,
              help="Shortest reply budget (default: --max-new-tokens / 8); budgets are log-uniform.")
@click.option("--max-new-tokens", default=256, show_default=True, type=click.IntRange(min=1))
@click.option("--token-budget", type=click.IntRange(min=1), default=None,
              help="generate: per batch (default 131072 GPU, 16384 CPU); engine: cached positions in all "
                   "(default 60% of the free GPU memory, 16384 CPU).")
@click.option("--max-batch-size", type=click.IntRange(min=1), default=None,
              help="Rows (engine) and prompts per batch (generate) of every phase; default 512 on GPU, 64 on CPU.")
@click.option("--phase", "phases", multiple=True, type=click.Choice(["one-at-a-time", "generate-static",
              "generate-dynamic", "engine-batches", "engine-continuous", "engine-refill-each",
              "engine-compiled"]),
              help="Repeatable (default: one-at-a-time, generate-static, engine-batches, engine-continuous).")
@click.option("--check-every", default=16, show_default=True, type=click.IntRange(min=1),
              help="engine: decode steps between looks for stop tokens.")
@click.option("--refill-rows", type=click.IntRange(min=1), default=None,
              help="engine-continuous, engine-compiled: free rows a refill waits for (default: an eighth of the "
                   "rows).")
@click.option("--hbm-tbps", default=None, type=FiniteFloatRange(min=0, min_open=True),
              help="Memory bandwidth of the bound, TB/s (default: the GPU's, decode/bound.py HBM_TBPS: H200 4.8, "
                   "H100 SXM 3.35; else 4.8).")
@click.option("--dtype", type=click.Choice(DTYPE_NAMES), default="bfloat16", show_default=True)
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None, callback=writable_output, help="Also write the figures as JSON.")
def bench_regenerate(shape, target, device, num_prompts, num_single, min_prompt, max_prompt, min_new_tokens,
                     max_new_tokens, token_budget, max_batch_size, phases, check_every, refill_rows, hbm_tbps,
                     dtype, json_path) -> None:
    """Generated tokens/s of regenerate's decoders against one prompt at a time and the bandwidth bound."""
    from dflash_ipc.bench.regenerate import DEFAULT_PHASES, format_table, run_regenerate_bench, write_json
    from dflash_ipc.run.logs import setup_logging
    ordered_range("--min-prompt", min_prompt, "--max-prompt", max_prompt)
    if min_new_tokens is not None:
        ordered_range("--min-new-tokens", min_new_tokens, "--max-new-tokens", max_new_tokens)
    setup_logging("bench")
    result = run_regenerate_bench(shape=shape, target=target, device=device, num_prompts=num_prompts,
                                  num_single=num_single, min_prompt=min_prompt, max_prompt=max_prompt,
                                  min_new_tokens=min_new_tokens, max_new_tokens=max_new_tokens,
                                  token_budget=token_budget, max_batch_size=max_batch_size,
                                  phases=phases or DEFAULT_PHASES, check_every=check_every, refill_rows=refill_rows,
                                  hbm_tbps=hbm_tbps,
                                  dtype=dtype)
    if json_path:
        write_json(result, json_path)
    click.echo(format_table(result))


@bench.command("eval")
@click.option("--device", default="cuda:0", show_default=True, callback=checked_device)
@click.option("--shape", type=click.Choice(["tiny", "qwen3-0.6b", "qwen3-1.7b", "qwen3-8b"]), default="qwen3-1.7b",
              show_default=True, help="Random-weight target shape (bench/assets.py); tiny: a CPU smoke test.")
@click.option("--batch-sizes", default="1,16,64,256", show_default=True, metavar="B1,B2,...")
@click.option("--prompts-per-batch", default=2, show_default=True, type=click.IntRange(min=1),
              help="Prompts per batched row = this x the batch size (at least 2).")
@click.option("--max-new-tokens", default=128, show_default=True, type=click.IntRange(min=1))
@click.option("--prompt-len", default="64,256", show_default=True, metavar="MIN,MAX",
              help="Prompt lengths, log-uniform.")
@click.option("--legacy-prompts", default=2, show_default=True, type=click.IntRange(min=0),
              help="Prompts of the unbatched (legacy) rows (0: no legacy rows).")
@click.option("--compile-decode", "compile_decode", type=click.Choice(["auto", "on", "off"]), default="auto",
              show_default=True, help="torch.compile of the target's decode forward (auto: on CUDA).")
@click.option("--dtype", type=click.Choice(["auto", *DTYPE_NAMES]), default="auto",
              show_default=True)
@click.option("--work-dir", default=None, type=click.Path(file_okay=False), callback=made_directory,
              help="Keep the random target here (reused next time); default: a temporary directory.")
@click.option("--hbm-tbps", default=None, type=FiniteFloatRange(min=0, min_open=True),
              help="Memory bandwidth of the bound, TB/s (default: the GPU's, decode/bound.py HBM_TBPS: H200 4.8, "
                   "H100 SXM 3.35; else 4.8).")
@click.option("--repeats", default=1, show_default=True, type=click.IntRange(min=1),
              help="Timed runs of each batched row, one after another: the row reports the median run, and at "
                   "batch 1 the summary the spread of plain steps and cycles.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None, callback=writable_output, help="Also write the figures.")
def bench_eval(device, shape, batch_sizes, prompts_per_batch, max_new_tokens, prompt_len, legacy_prompts,
               compile_decode, dtype, work_dir, hbm_tbps, repeats, json_path) -> None:
    """Tokens/s of batched speculative and plain decoding against the unbatched decoder."""
    from dflash_ipc.bench.eval import run_eval_bench
    from dflash_ipc.run.logs import setup_logging
    setup_logging("bench")
    lengths = int_list(prompt_len, "--prompt-len", size=2)
    ordered_range("--prompt-len's MIN", lengths[0], "MAX", lengths[1])
    figures = run_eval_bench(device=device, shape=shape, batch_sizes=int_list(batch_sizes, "--batch-sizes"),
                             prompts_per_batch=prompts_per_batch, max_new_tokens=max_new_tokens,
                             prompt_len=tuple(lengths),
                             legacy_prompts=legacy_prompts, dtype=dtype, work_dir=work_dir, hbm_tbps=hbm_tbps,
                             compile=compile_decode, repeats=repeats, emit=click.echo)
    if json_path:
        write_json_atomic(json_path, figures)
