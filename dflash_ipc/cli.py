"""`dflash-ipc`: the command line. Thin: click parses, the config builds, a class runs.

    dflash-ipc up [--config FILE] [-o key=value ...]     the whole job (= bin/dflash-up)
    dflash-ipc dispatcher|target|drafter --config FILE [--rank N]   one stage alone
    dflash-ipc prepare --model DIR --input FILE.jsonl --out DIR
    dflash-ipc export CHECKPOINT OUT_DIR
    dflash-ipc status|health RUN_DIR
    dflash-ipc bench transport|drafter|dispatch|pipeline
    dflash-ipc plan --gpus N (--target-capacity T --drafter-capacity D | --from-bench FILE)
"""

from __future__ import annotations

import logging
import os
import signal
import sys

import click

from dflash_ipc.config import POLICIES, PUBLISH_SYNC_MODES
from dflash_ipc.errors import DFlashError

log = logging.getLogger("dflash_ipc.cli")

DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                              "configs", "default.yaml")


def _load(config: str | None, overrides: tuple[str, ...]):
    from dflash_ipc.config_load import load_config
    if config is None and os.path.exists(DEFAULT_CONFIG):
        config = DEFAULT_CONFIG
    return load_config(config, list(overrides))


def _exit_on_sigterm() -> None:
    """SIGTERM unwinds like an exception, so `finally` blocks close pools and sockets."""
    def handler(signum, frame):
        raise SystemExit(128 + signum)
    signal.signal(signal.SIGTERM, handler)


def _stage_setup(role: str, cfg) -> None:
    from dflash_ipc.logs import setup_logging
    setup_logging(role, level=cfg.run.log_level)
    _exit_on_sigterm()
    if os.environ.get("DFLASH_IPC_SUPERVISED"):
        from dflash_ipc.supervise.children import ParentWatch
        ParentWatch().start()


def _finished_before(cfg) -> bool:
    """True when the run directory's ledger says the job already committed every batch."""
    from dflash_ipc.dispatch.ledger import Ledger
    path = cfg.files.ledger
    return os.path.exists(path) and Ledger.load(path).all_committed()


config_option = click.option("--config", "config", type=click.Path(dir_okay=False), default=None,
                             help="YAML job config (default: configs/default.yaml).")
override_option = click.option("-o", "--override", "overrides", multiple=True, metavar="KEY=VALUE",
                               help="Override a config key, e.g. -o drafter.lr=3e-4 (repeatable).")


@click.group()
def main() -> None:
    """Train DFlash drafters from a frozen target, across processes and GPUs."""


@main.command()
@config_option
@override_option
@click.option("--nnodes", type=int, default=None,
              help="Nodes of the job (run.num_nodes); each runs its own targets and drafters.")
@click.option("--node-rank", type=int, default=None, help="This node, 0..nnodes-1 (run.node_rank); 0 runs the dispatcher.")
@click.option("--dispatcher", "dispatcher_address", default=None, metavar="tcp://HOST:PORT",
              help="The job's dispatcher (dispatch.address): node 0 listens there, every node connects.")
def up(config, overrides, nnodes, node_rank, dispatcher_address) -> None:
    """Run the whole job: dispatcher, targets and drafters, supervised.

    Several nodes: on each, `dflash-up --nnodes N --node-rank K --dispatcher tcp://NODE0:PORT`
    with the same config; MASTER_ADDR/MASTER_PORT as torchrun's, else the dispatcher's host
    and PORT+1 (the drafters of all nodes form one group)."""
    from dflash_ipc.config import BUILTIN_SYNTHETIC_DATA, BUILTIN_TINY_TARGET
    from dflash_ipc.logs import setup_logging
    from dflash_ipc.resolve import resolve_job
    from dflash_ipc.supervise.supervisor import Supervisor
    flags = [f"run.num_nodes={nnodes}"] if nnodes is not None else []
    flags += [f"run.node_rank={node_rank}"] if node_rank is not None else []
    flags += [f"dispatch.address={dispatcher_address}"] if dispatcher_address is not None else []
    cfg = _load(config, overrides + tuple(flags))
    setup_logging("supervisor" if cfg.run.num_nodes == 1 else f"supervisor/{cfg.run.node_rank}",
                  level=cfg.run.log_level)
    embedded_default = (cfg.target.path == BUILTIN_TINY_TARGET and cfg.data.path == BUILTIN_SYNTHETIC_DATA
                        and cfg.run.num_nodes == 1)
    cfg = resolve_job(cfg)
    log.info("run directory %s: %d targets on %s, %d drafters on %s", cfg.run.run_dir,
             cfg.target.num_workers, ",".join(cfg.target.devices), cfg.drafter.num_workers,
             ",".join(cfg.drafter.devices))
    if _finished_before(cfg):
        click.echo(f"{cfg.run.run_dir} holds a finished job (every batch committed; checkpoints in "
                   f"{cfg.run.run_dir}/checkpoints). Start a new one with -o run.run_dir=DIR.")
        sys.exit(0)
    code = Supervisor(cfg, print_status=lambda line: click.echo(line)).run()
    if code == 0 and embedded_default:
        # The embedded default ends by showing that the drafter learned: tau of the trained
        # drafter next to an untrained one of the same shape, on held-out prompts.
        from dflash_ipc.eval.acceptance import format_comparison
        from dflash_ipc.eval.speculative import untrained_vs_trained
        untrained, trained = untrained_vs_trained(cfg.target.path, cfg.files.checkpoints, cfg.data.path,
                                                  num_prompts=8, max_new_tokens=48, seed=cfg.run.seed)
        click.echo(format_comparison(untrained, trained))
    sys.exit(code)


@main.command()
@config_option
@override_option
def dispatcher(config, overrides) -> None:
    """Run the dispatcher alone."""
    from dflash_ipc.dispatch.proc import run_dispatcher
    from dflash_ipc.resolve import resolve_job
    cfg = _load(config, overrides)
    _stage_setup("dispatcher", cfg)
    run_dispatcher(resolve_job(cfg))


@main.command()
@config_option
@override_option
@click.option("--rank", type=int, required=True, help="Target rank, 0..target.num_workers-1.")
def target(config, overrides, rank) -> None:
    """Run one target worker alone."""
    from dflash_ipc.resolve import resolve_job
    from dflash_ipc.target.worker import run_target
    cfg = _load(config, overrides)
    _stage_setup(f"target/{rank}", cfg)
    run_target(resolve_job(cfg), rank)


@main.command()
@config_option
@override_option
@click.option("--rank", type=int, required=True, help="Drafter rank, 0..drafter.num_workers-1.")
def drafter(config, overrides, rank) -> None:
    """Run one drafter worker alone (all drafters must run to form the group)."""
    from dflash_ipc.drafter.worker import run_drafter
    from dflash_ipc.resolve import resolve_job
    cfg = _load(config, overrides)
    _stage_setup(f"drafter/{rank}", cfg)
    run_drafter(resolve_job(cfg), rank)


@main.command()
@click.option("--model", "model_dir", required=True, type=click.Path(file_okay=False),
              help="Target model directory (its tokenizer and chat template are used).")
@click.option("--input", "input_path", required=True, type=click.Path(dir_okay=False), help="JSONL file.")
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False), help="Output dataset directory.")
@click.option("--max-length", default=4096, show_default=True, help="Longest sample in tokens.")
@click.option("--on-long", type=click.Choice(["truncate", "reject"]), default="truncate", show_default=True)
@click.option("--last-turn-only", is_flag=True, help="Loss on the last assistant turn only.")
@click.option("--workers", "num_workers", default=1, show_default=True, help="Tokenizer processes.")
@click.option("--strict", is_flag=True, help="Stop at the first bad row.")
@click.option("--overwrite", is_flag=True, help="Replace an existing dataset at --out.")
def prepare(model_dir, input_path, out_dir, max_length, on_long, last_turn_only, num_workers, strict, overwrite) -> None:
    """Tokenize a chat JSONL file into a memory-mapped training dataset."""
    from dflash_ipc.data.prepare import prepare_dataset
    report = prepare_dataset(model_dir, input_path, out_dir, max_length=max_length, last_turn_only=last_turn_only,
                             num_workers=num_workers, strict=strict, on_long=on_long, overwrite=overwrite)
    click.echo(f"{report.num_samples} samples written to {report.out_dir}, {report.num_rejected} rejected "
               f"({report.rejects_by_reason}) in {report.seconds:.1f}s, {report.samples_per_s:,.0f} samples/s")
    if report.num_rejected:
        click.echo(f"rejected rows: {report.rejects_path}")


@main.command()
@click.argument("checkpoint", type=click.Path(exists=True, file_okay=False))
@click.argument("out_dir", type=click.Path(file_okay=False))
def export(checkpoint, out_dir) -> None:
    """Write the SGLang/vLLM inference format (config.json + model.safetensors) of a checkpoint."""
    from dflash_ipc.drafter.export import export_training_checkpoint
    path = export_training_checkpoint(checkpoint, out_dir)
    click.echo(f"exported {path}")


@main.command()
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print the raw status as JSON.")
def status(run_dir, as_json) -> None:
    """Live rates and queue depths, asked from the running dispatcher."""
    from dflash_ipc.supervise.status_query import query_status
    click.echo(query_status(run_dir, as_json=as_json))


@main.command()
@click.argument("run_dir", type=click.Path(file_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option("--stale-after", "stale_after_s", type=float, default=None,
              help="Heartbeat age (s) that degrades a worker (default: dispatch.heartbeat_timeout_s / 2).")
@click.option("--stall-after", "stall_after_s", type=float, default=None,
              help="Seconds without progress that degrade (default: 2 x dispatch.heartbeat_timeout_s).")
@click.option("--timeout", "timeout_s", type=float, default=2.0, show_default=True,
              help="Seconds to wait for the dispatcher's status.")
@click.option("--node-rank", type=click.IntRange(min=0), default=0, show_default=True,
              help="Which node's processes to check (run it on that node); the dispatcher is asked from any.")
def health(run_dir, as_json, stale_after_s, stall_after_s, timeout_s, node_rank) -> None:
    """Per-process health (psutil, heartbeats, progress). Exit 0 healthy, 1 degraded, 2 down."""
    import json
    from dflash_ipc.supervise.health import format_health, health_report
    report = health_report(run_dir, node_rank=node_rank, stale_after_s=stale_after_s,
                           stall_after_s=stall_after_s, timeout_s=timeout_s)
    click.echo(json.dumps(report.to_json(), indent=1) if as_json else format_health(report))
    sys.exit(report.exit_code)


@main.command("eval")
@click.option("--target", "target_dir", required=True, type=click.Path(exists=True, file_okay=False),
              help="HF target model directory.")
@click.option("--drafter", required=True, type=click.Path(exists=True, file_okay=False),
              help="Export, checkpoint step dir, or checkpoints root (latest).")
@click.option("--data", "data_dir", required=True, type=click.Path(exists=True, file_okay=False),
              help="Prepared dataset; its declared held-out prompts, else its last --num-prompts samples.")
@click.option("--num-prompts", default=16, show_default=True)
@click.option("--max-new-tokens", default=64, show_default=True)
@click.option("--device", default="cpu", show_default=True)
@click.option("--dtype", type=click.Choice(["auto", "bfloat16", "float16", "float32"]), default="auto",
              show_default=True, help="auto: float32 on CPU, bfloat16 on GPU.")
@click.option("--check-lossless", is_flag=True, help="Also decode plainly; exit 1 if any output differs.")
@click.option("--vs-untrained", is_flag=True, help="Also evaluate an untrained drafter of the same shape.")
@click.option("--json", "as_json", is_flag=True, help="Print the report(s) as JSON.")
def eval_cmd(target_dir, drafter, data_dir, num_prompts, max_new_tokens, device, dtype, check_lossless,
             vs_untrained, as_json) -> None:
    """Greedy speculative decoding on held-out prompts: tau, acceptance per position, forwards/token."""
    import json
    from dflash_ipc.eval.acceptance import format_comparison
    from dflash_ipc.eval.speculative import evaluate, untrained_vs_trained
    from dflash_ipc.logs import setup_logging
    setup_logging("eval")
    kw = dict(num_prompts=num_prompts, max_new_tokens=max_new_tokens, device=device, dtype=dtype,
              check_lossless=check_lossless)
    reports = (list(untrained_vs_trained(target_dir, drafter, data_dir, **kw)) if vs_untrained
               else [evaluate(target_dir, drafter, data_dir, **kw)])
    click.echo(json.dumps([r.to_dict() for r in reports], indent=1) if as_json
               else format_comparison(*reports) if vs_untrained else reports[0].format())
    if any(r.lossless_mismatches for r in reports):
        sys.exit(1)


@main.command("report")
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--out", "out_path", type=click.Path(dir_okay=False), default=None,
              help="PNG to write (default RUN_DIR/report.png).")
def report(run_dir, out_path) -> None:
    """Per-worker busy/waiting summary and a timeline PNG (starvation at a glance)."""
    from dflash_ipc.report import build_report, format_summary
    summary = build_report(run_dir, out_path)
    click.echo(format_summary(summary))
    click.echo(f"loss {summary['loss_first']:.3f} -> {summary['loss_last']:.3f}; wrote {summary['png']}")


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
    import json
    from dflash_ipc.bench.dispatch import parse_speeds, run_dispatch_bench
    result = run_dispatch_bench(num_targets=num_targets, num_drafters=num_drafters, num_samples=num_samples,
                                policies=policies or POLICIES, seed=seed, time_scale=time_scale,
                                target_speeds=parse_speeds(target_speeds) if target_speeds else None)
    if out_path:
        with open(out_path, "w", encoding="utf-8") as f:
            json.dump(result, f)


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


def _comma_list(ctx, param, value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def precision_options(default: str):
    """--precision / --fp8-recipe / --fp8-lm-head: comma lists, compared in one run."""
    return lambda fn: _add_options(fn, [
        click.option("--precision", "precisions", default=default, show_default=True, callback=_comma_list,
                     metavar="P[,P...]", help="drafter.precision of each run: bf16, fp8 (e.g. bf16,fp8)."),
        click.option("--fp8-recipe", "recipes", default="tensorwise", show_default=True, callback=_comma_list,
                     metavar="R[,R...]", help="drafter.fp8_recipe of the fp8 runs: tensorwise, rowwise."),
        click.option("--fp8-lm-head", "lm_heads", default="all", show_default=True, callback=_comma_list,
                     metavar="H[,H...]", help="drafter.fp8_lm_head of the fp8 runs: all, grad, none.")])


def _add_options(fn, options: list):
    for option in reversed(options):
        fn = option(fn)
    return fn


@bench.command("drafter")
@click.option("--device", default="cuda:0", show_default=True)
@click.option("--steps", default=10, show_default=True)
@click.option("--shape", type=click.Choice(["qwen3-8b", "tiny"]), default="qwen3-8b", show_default=True,
              help="tiny: hidden 64, 2 layers, vocab 512, same step sizes (a quick GPU smoke test).")
@precision_options(default="bf16")
def bench_drafter(device, steps, shape, precisions, recipes, lm_heads) -> None:
    """Step time and MFU of a Qwen3-8B-shaped drafter at 32,768 query tokens per step,
    for each precision asked, with the speedup against the first."""
    from dflash_ipc.bench.drafter import compare_precisions, precision_variants
    compare_precisions(device=device, steps=steps, shape=shape,
                       variants=precision_variants(precisions, recipes, lm_heads))


# The sizes of `bench precision`, with the defaults of bench/precision.py's RunSizes (a test
# checks they agree; importing that module here would load torch for every command).
RUN_SIZE_DEFAULTS = {"samples": 768, "min_len": 128, "max_len": 512, "held_out": 16, "steps": 300,
                     "anchors_per_step": 1024, "max_anchors_per_seq": 512, "num_layers": 5, "lr": 6e-4,
                     "eval_prompts": 16, "eval_tokens": 48, "seed": 0}


def _run_sizes_options(fn):
    return _add_options(fn, [click.option(f"--{name.replace('_', '-')}", name, type=type(value), default=value,
                                          show_default=True) for name, value in RUN_SIZE_DEFAULTS.items()])


@bench.command("precision")
@click.option("--device", default="cuda:0", show_default=True)
@click.option("--shape", type=click.Choice(["tiny", "qwen3-0.6b", "qwen3-1.7b", "qwen3-8b"]), default="qwen3-1.7b",
              show_default=True, help="Shape of the random-weight target (bench/assets.py).")
@click.option("--work-dir", default="/tmp/dflash-precision", show_default=True,
              help="Target, data and exported drafters; the target and data are reused while they match.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None,
              help="Also write every figure (the per-step losses included) as JSON.")
@precision_options(default="bf16,fp8")
@_run_sizes_options
def bench_precision(device, shape, work_dir, json_path, precisions, recipes, lm_heads, **sizes) -> None:
    """The same short training run in each precision: loss curves, final-loss gap and tau."""
    import json
    from dflash_ipc.bench.drafter import precision_variants
    from dflash_ipc.bench.precision import RunSizes, run_precision_comparison
    from dflash_ipc.logs import setup_logging
    setup_logging("bench")
    figures = run_precision_comparison(device=device, shape=shape, work_dir=work_dir, sizes=RunSizes(**sizes),
                                       variants=precision_variants(precisions, recipes, lm_heads))
    if json_path:
        with open(json_path, "w", encoding="utf-8") as f:
            json.dump(figures, f, indent=1)


@bench.command("pipeline")
@config_option
@override_option
@click.option("--seconds", default=60.0, show_default=True, help="Measured seconds of each phase.")
@click.option("--warmup-s", default=30.0, show_default=True,
              help="Seconds of warmup after the first batch / drafter step of each phase (end to end: after "
                   "the first drafter step), before the measured seconds.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None,
              help="Also write every figure as JSON (input of dflash-ipc plan --from-bench).")
@click.option("--run-dir", default=None, type=click.Path(file_okay=False),
              help="Fresh run directory of the end-to-end job (default: <run.run_dir>-bench-<time>).")
def bench_pipeline(config, overrides, seconds, warmup_s, json_path, run_dir) -> None:
    """Target capacity, drafter capacity and end-to-end tok_rate of one job, and their ratio."""
    import json
    from dflash_ipc.bench.pipeline import format_table, run_pipeline_bench
    from dflash_ipc.logs import setup_logging
    from dflash_ipc.resolve import resolve_job
    cfg = _load(config, overrides)
    setup_logging("bench", level=cfg.run.log_level)
    figures = run_pipeline_bench(resolve_job(cfg), seconds=seconds, warmup_s=warmup_s, run_dir=run_dir,
                                 print_status=lambda line: click.echo(line))
    if json_path:
        with open(json_path, "w", encoding="utf-8") as f:
            json.dump(figures, f, indent=1)
    click.echo(format_table(figures))


@main.command("plan")
@click.option("--gpus", "num_gpus", type=int, required=True, help="GPUs to split between targets and drafters.")
@click.option("--target-capacity", type=float, default=None, metavar="TOK_S",
              help="Tokens/s of one target worker on one GPU.")
@click.option("--drafter-capacity", type=float, default=None, metavar="TOK_S",
              help="Trained tokens/s of one drafter on one GPU.")
@click.option("--from-bench", "bench_path", type=click.Path(dir_okay=False), default=None,
              help="Take both capacities from a dflash-ipc bench pipeline --json file.")
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
def plan(num_gpus, target_capacity, drafter_capacity, bench_path, as_json) -> None:
    """The target/drafter GPU split that maximises predicted tok_rate, and its config."""
    import json
    from dflash_ipc.errors import ConfigError
    from dflash_ipc.plan import capacities_from_bench, format_plan, make_plan
    given = (target_capacity is not None, drafter_capacity is not None)
    if bench_path is not None:
        if any(given):
            raise ConfigError("plan: give either --from-bench or --target-capacity/--drafter-capacity, not both")
        target_capacity, drafter_capacity = capacities_from_bench(bench_path)
    elif not all(given):
        raise ConfigError("plan: give --target-capacity and --drafter-capacity (tokens/s per GPU), "
                          "or --from-bench FILE")
    result = make_plan(num_gpus, target_capacity, drafter_capacity)
    click.echo(json.dumps(result, indent=1) if as_json else format_plan(result))


def run() -> None:
    """Console entry point: typed errors become one clear line and exit code 2."""
    try:
        main(standalone_mode=False)
    except click.exceptions.Abort:
        sys.exit(130)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except DFlashError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(2)


if __name__ == "__main__":
    run()
