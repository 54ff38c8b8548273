"""`dflash-ipc`: the command line. Thin: click parses, the config builds, a class runs.

    dflash-ipc up [--config FILE] [-o key=value ...]     the whole job (= bin/dflash-up)
    dflash-ipc dispatcher|target|drafter --config FILE [--rank N] [--tp-rank K]   one stage alone
    dflash-ipc regenerate --model DIR --input FILE_OR_DIR --out FILE.jsonl   the target writes the replies
    dflash-ipc prepare --model DIR --input FILE_OR_DIR --out DIR
    dflash-ipc export CHECKPOINT OUT_DIR [--with-code]
    dflash-ipc report RUN_DIR
    dflash-ipc status|health RUN_DIR
    dflash-ipc eval --target DIR --drafter CKPT (--data DIR | --prompts FILE.jsonl ...)
    dflash-ipc bench transport|drafter|dispatch|pipeline|target|regenerate|eval
    dflash-ipc plan --gpus N (--target-capacity T --drafter-capacity D | --from-bench FILE)
"""

from __future__ import annotations

import logging
import os
import signal
import sys

import click

from dflash_ipc.config import DTYPE_NAMES, POLICIES, PUBLISH_SYNC_MODES
from dflash_ipc.errors import EXIT_CONFIG_ERROR, EXIT_ERROR, ConfigError, DFlashError
from dflash_ipc.json_files import json_safe, write_json_atomic

log = logging.getLogger("dflash_ipc.cli")

DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                              "configs", "default.yaml")


def _load(config: str | None, overrides: tuple[str, ...]):
    from dflash_ipc.config_load import load_config
    if config is None and os.path.exists(DEFAULT_CONFIG):
        config = DEFAULT_CONFIG
    return load_config(config, list(overrides))


def _exit_on_sigterm() -> None:
    """SIGTERM unwinds like an exception, so `finally` blocks close pools and sockets.

    Once only: when the supervisor dies, a child hears SIGTERM twice (the parent-death
    signal, then `ParentWatch` a second later), and a second SystemExit raised inside the
    unwinding skips what is left of it, such as the `finally` that unlinks a shared-memory
    segment. Later SIGTERMs are ignored; the supervisor's SIGKILL after its grace period
    still ends a child that does not finish."""
    def handler(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise SystemExit(128 + signum)
    signal.signal(signal.SIGTERM, handler)


def _stage_setup(role: str, cfg) -> None:
    from dflash_ipc.logs import setup_logging
    setup_logging(role, level=cfg.run.log_level)
    _exit_on_sigterm()
    from dflash_ipc.supervise.children import SUPERVISOR_ENV, ParentWatch, die_with_parent, supervisor_pid
    if os.environ.get(SUPERVISOR_ENV):
        die_with_parent()  # then the watch, whose first look covers a parent gone before this
        ParentWatch(parent=supervisor_pid(), grace_s=cfg.supervise.grace_s, before_kill=_unlink_own_segments).start()


def _unlink_own_segments() -> None:
    """Before a SIGKILL of this process by itself: the shared-memory pools it created. Only
    if the module is loaded (no pool otherwise); importing here could wait on a lock forever."""
    shm = sys.modules.get("dflash_ipc.transport.shm")
    if shm is not None:
        shm.unlink_own_segments()


def _finished_before(cfg) -> bool:
    """True when the run directory's ledger says this job already committed every batch;
    DataError when that ledger is of another plan (other data, budget, seed or epochs)."""
    from dflash_ipc.data.dataset import TokenDataset
    from dflash_ipc.dispatch.ledger_file import load_ledger
    from dflash_ipc.dispatch.proc import check_same_plan, plan_job
    path = cfg.files.ledger
    if not os.path.exists(path):
        return False
    ledger = load_ledger(path, recover=False)  # only read: nothing restarts here
    check_same_plan(ledger, plan_job(cfg, TokenDataset(cfg.data.path).lengths), path)
    return ledger.all_committed()


def _checked_device(ctx, param, value: str) -> str:
    """--device: cpu or cuda:N of a GPU this machine has, else one error line (not a CUDA traceback)."""
    from dflash_ipc.machine import check_device
    check_device(value, "--device")
    return value


config_option = click.option("--config", "config", type=click.Path(dir_okay=False), default=None,
                             help="YAML job config (default: configs/default.yaml).")
override_option = click.option("-o", "--override", "overrides", multiple=True, metavar="KEY=VALUE",
                               help="Override a config key, e.g. -o optimizer.lr=3e-4 (repeatable).")


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
        from dflash_ipc.eval.report import format_comparison
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
@click.option("--tp-rank", type=int, default=0, show_default=True,
              help="Process of the worker, 0..target.gpus_per_worker-1 (0: the leader).")
def target(config, overrides, rank, tp_rank) -> None:
    """Run one target worker alone (one process of it with target.gpus_per_worker > 1)."""
    from dflash_ipc.resolve import resolve_job
    from dflash_ipc.supervise.roles import Role
    from dflash_ipc.target.worker import run_target
    cfg = _load(config, overrides)
    _stage_setup(str(Role("target", rank, tp_rank)), cfg)
    run_target(resolve_job(cfg), rank, tp_rank)


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


def _echo_report(report) -> None:
    """A prepare or regenerate report's summary line, and where its rejects are."""
    click.echo(report.summary())
    if report.num_rejected:
        click.echo(f"rejected rows: {report.rejects_path}")


input_option = click.option("--input", "input_path", required=True, type=click.Path(),
                            help="JSONL, JSON array, Parquet, a datasets save_to_disk directory or a directory "
                                 "of Parquet/JSON shards.")
split_option = click.option("--split", default=None, help="Split of a directory input (default: train, or the only one).")
max_line_option = click.option("--max-line-bytes", type=click.IntRange(min=1), default=32 << 20, show_default=True,
                               help="Rows longer than this are rejected without being parsed.")
template_kwargs_option = click.option(
    "--chat-template-kwargs", "template_kwargs", multiple=True, metavar="JSON|KEY=VALUE",
    help="Chat-template variables, e.g. '{\"enable_thinking\": false}' or enable_thinking=false (repeatable).")


@main.command()
@click.option("--model", "model_dir", required=True, type=click.Path(file_okay=False),
              help="Target model directory (its tokenizer and chat template are used).")
@input_option
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False), help="Output dataset directory.")
@split_option
@click.option("--max-length", default=4096, show_default=True, help="Longest sample in tokens.")
@click.option("--on-long", type=click.Choice(["truncate", "reject"]), default="truncate", show_default=True)
@click.option("--last-turn-only", is_flag=True, help="Loss on the last assistant turn only.")
@template_kwargs_option
@click.option("--held-out", type=click.IntRange(min=0), default=0, show_default=True,
              help="Keep the last N usable conversations out of the dataset; their prompts are recorded for eval.")
@click.option("--dedup", is_flag=True, help="Drop samples with the same tokens as an earlier one (always counted).")
@max_line_option
@click.option("--workers", "num_workers", default=1, show_default=True, help="Tokenizer processes.")
@click.option("--strict", is_flag=True, help="Stop at the first bad row.")
@click.option("--overwrite", is_flag=True, help="Replace an existing dataset at --out.")
def prepare(model_dir, input_path, out_dir, split, max_length, on_long, last_turn_only, template_kwargs, held_out,
            dedup, max_line_bytes, num_workers, strict, overwrite) -> None:
    """Tokenize chat data into a memory-mapped training dataset."""
    from dflash_ipc.data.messages import parse_template_kwargs
    from dflash_ipc.data.prepare import prepare_dataset
    report = prepare_dataset(model_dir, input_path, out_dir, max_length=max_length, last_turn_only=last_turn_only,
                             num_workers=num_workers, strict=strict, on_long=on_long, overwrite=overwrite,
                             split=split, max_line_bytes=max_line_bytes, held_out=held_out, dedup=dedup,
                             template_kwargs=parse_template_kwargs(template_kwargs))
    _echo_report(report)


@main.command()
@click.option("--model", "model_dir", default=None, type=click.Path(file_okay=False),
              help="Target model directory (hf backend).")
@input_option
@click.option("--out", "out_path", required=True, type=click.Path(dir_okay=False), help="Output JSONL file.")
@split_option
@click.option("--backend", "kind", type=click.Choice(["hf", "openai"]), default="hf", show_default=True)
@click.option("--max-new-tokens", default=2048, show_default=True, help="Longest reply in tokens.")
@click.option("--temperature", default=0.0, show_default=True, help="0: greedy.")
@click.option("--top-p", default=1.0, show_default=True)
@click.option("--top-k", default=0, show_default=True, help="0: no limit.")
@click.option("--seed", default=0, show_default=True)
@click.option("--max-turns", type=click.IntRange(min=1), default=None, help="Assistant turns to regenerate per row.")
@template_kwargs_option
@click.option("--reasoning", type=click.Choice(["keep", "drop"]), default="keep", show_default=True,
              help="A reply's <think> reasoning: kept as reasoning_content, or dropped.")
@click.option("--devices", default="auto", show_default=True,
              help="hf: cpu, cuda:0 or cuda:0,cuda:1,... (one process per device); auto: every GPU, else cpu.")
@click.option("--dtype", type=click.Choice(["auto", *DTYPE_NAMES]), default="auto",
              show_default=True, help="hf: auto = bfloat16 on GPU, float32 on CPU.")
@click.option("--cache", type=click.Choice(["auto", "static", "dynamic"]), default="auto", show_default=True,
              help="hf: KV cache (auto: static on GPU, dynamic on CPU).")
@click.option("--token-budget", type=click.IntRange(min=1), default=None,
              help="hf: batch size x (longest prompt + max new tokens) per batch (default 131072 GPU, 16384 CPU).")
@click.option("--max-batch-size", type=click.IntRange(min=1), default=None, help="hf: default 256 GPU, 64 CPU.")
@click.option("--url", default=None, help="openai: the server's base URL, e.g. http://127.0.0.1:8000/v1.")
@click.option("--served-model", default=None, help="openai: model name (default: the first the server lists).")
@click.option("--concurrency", default=16, show_default=True, help="openai: requests in flight at most.")
@click.option("--timeout-s", default=600.0, show_default=True, help="openai: seconds per request.")
@click.option("--retries", default=5, show_default=True, help="openai: retries of a failed request.")
@click.option("--api-key", envvar="OPENAI_API_KEY", default=None, help="openai: bearer token (env OPENAI_API_KEY).")
@click.option("--window", default=4096, show_default=True, help="Rows in flight at most.")
@max_line_option
@click.option("--overwrite", is_flag=True, help="Start over instead of resuming an existing --out.")
def regenerate(model_dir, input_path, out_path, split, kind, max_new_tokens, temperature, top_p, top_k, seed,
               max_turns, template_kwargs, reasoning, devices, dtype, cache, token_budget, max_batch_size, url,
               served_model, concurrency, timeout_s, retries, api_key, window, max_line_bytes, overwrite) -> None:
    """Replace every assistant turn with the target's own reply (resumable: rerun to continue)."""
    from dflash_ipc.data.messages import parse_template_kwargs
    from dflash_ipc.logs import setup_logging
    from dflash_ipc.regenerate.options import GenerationOptions
    from dflash_ipc.regenerate.run import auto_devices, make_backend, regenerate as run_regenerate
    setup_logging("regenerate")
    options = GenerationOptions(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                seed=seed, max_turns=max_turns, reasoning=reasoning,
                                template_kwargs=parse_template_kwargs(template_kwargs))
    backend = make_backend(kind, options, model_dir=model_dir, devices=auto_devices(devices), dtype=dtype,
                           cache=cache, token_budget=token_budget, max_batch_size=max_batch_size, url=url,
                           served_model=served_model, concurrency=concurrency, timeout_s=timeout_s,
                           retries=retries, api_key=api_key)
    try:
        report = run_regenerate(input_path, out_path, backend, options, split=split, max_line_bytes=max_line_bytes,
                                window=window, overwrite=overwrite)
    finally:
        backend.close()
    _echo_report(report)


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
    from dflash_ipc.drafter.export import checkpoint_step_dir, export_step_dir
    from dflash_ipc.drafter.hub_code import publish_files
    step_dir = checkpoint_step_dir(checkpoint)  # resolved and verified once
    extras = publish_files(step_dir, out_dir, with_code=with_code, base_model=base_model, repo_id=repo_id)
    path = export_step_dir(step_dir, out_dir, extras=extras)
    click.echo(f"exported {path} (model card README.md{', modeling_dflash.py' if with_code else ''}); "
               f"publish with: huggingface-cli upload {repo_id or 'ORG/NAME'} {path}")


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
    click.echo(json.dumps(json_safe(report.to_json()), indent=1, allow_nan=False) if as_json else format_health(report))
    sys.exit(report.exit_code)


@main.command("eval")
@click.option("--target", "target_dir", required=True, type=click.Path(exists=True, file_okay=False),
              help="HF target model directory.")
@click.option("--drafter", required=True, type=click.Path(exists=True, file_okay=False),
              help="Export, checkpoint step dir, or checkpoints root (latest).")
@click.option("--data", "data_dir", default=None, type=click.Path(exists=True, file_okay=False),
              help="Prepared dataset: its declared held-out prompts, else its last --num-prompts samples.")
@click.option("--prompts", "prompt_files", multiple=True, metavar="[NAME=]FILE.jsonl",
              help="Prompt set (repeatable): rows with turns (MT-Bench), question, problem, prompt or messages.")
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
@click.option("--device", default="cpu", show_default=True, callback=_checked_device)
@click.option("--dtype", type=click.Choice(["auto", *DTYPE_NAMES]), default="auto",
              show_default=True, help="auto: float32 on CPU, bfloat16 on GPU.")
@click.option("--check-lossless", is_flag=True,
              help="Compare with plain greedy decoding; exit 1 on a mismatch (a numerical near-tie is reported).")
@click.option("--near-tie-ulps", default=4.0, show_default=True, type=click.FloatRange(min=0),
              help="A difference is a near-tie when both margins are within this many ulps of the top logit.")
@click.option("--skip-plain", is_flag=True, help="Do not decode plainly (no speedup, no lossless check).")
@click.option("--vs-untrained", is_flag=True, help="Also evaluate an untrained drafter of the same shape.")
@click.option("--json", "as_json", is_flag=True, help="Print the reports as JSON.")
@click.option("--save-to", "save_to", type=click.Path(exists=True, file_okay=False), default=None, metavar="RUN_DIR",
              help="Also append the results to RUN_DIR/eval_results.jsonl (read by report and export).")
def eval_cmd(target_dir, drafter, data_dir, prompt_files, num_prompts, max_new_tokens, batch_size, temperature,
             top_p, seed, template_kwargs, device, dtype, check_lossless, near_tie_ulps, skip_plain, vs_untrained,
             as_json, save_to) -> None:
    """Batched speculative decoding of prompt sets: tau, acceptance per position, tokens/s, speedup."""
    import json
    from dflash_ipc.eval.report import format_comparison
    from dflash_ipc.eval.sampling import Sampling
    from dflash_ipc.data.messages import parse_template_kwargs
    from dflash_ipc.eval.speculative import EvalOptions, evaluate_sets
    from dflash_ipc.logs import setup_logging
    setup_logging("eval")
    options = EvalOptions(max_new_tokens=max_new_tokens, batch_size=batch_size, plain=not skip_plain,
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
        from dflash_ipc.eval_results import save_eval_results
        path = save_eval_results(save_to, [r.to_dict() for r in reports],
                                 baseline=[vs_untrained and i % 2 == 0 for i in range(len(reports))])
        click.echo(f"saved to {path}", err=as_json)  # stdout stays pure JSON with --json
    if any(r.lossless_mismatches for r in reports):
        sys.exit(1)


@main.command("report")
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--out", "out_path", type=click.Path(dir_okay=False), default=None,
              help="PNG to write (default RUN_DIR/report.png; its numbers go beside it as .json).")
def report(run_dir, out_path) -> None:
    """Worker states, token rates, memory, loss and lr, latest eval: a PNG and its numbers as JSON."""
    from dflash_ipc.report import build_report, format_summary
    summary = build_report(run_dir, out_path)
    click.echo(format_summary(summary))
    loss = ("loss -" if summary["loss_first"] is None
            else f"loss {summary['loss_first']:.3f} -> {summary['loss_last']:.3f}")
    click.echo(f"{loss}; panels {', '.join(summary['panels'])}; wrote {summary['png']} and {summary['json']}")


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
@click.option("--device", default="cuda:0", show_default=True, callback=_checked_device)
@click.option("--steps", default=10, show_default=True)
@click.option("--warmup", default=3, show_default=True,
              help="Untimed steps first (the first compiles; with fp8 the third too: a row count seen twice runs static from the next step).")
@click.option("--shape", type=click.Choice(["qwen3-8b", "tiny"]), default="qwen3-8b", show_default=True,
              help="tiny: hidden 64, 2 layers, vocab 512, same step sizes (a quick GPU smoke test).")
@click.option("--seq-len", "seq_lens", multiple=True, type=int, default=(2048,), show_default=True,
              help="Tokens per sequence (context keys per sequence); repeatable: one report per length, "
                   "in one process (the bf16 parts compiled once; fp8 layers per variant).")
@click.option("--num-seqs", default=4, show_default=True, help="Sequences per step.")
@click.option("--anchors-per-seq", default=512, show_default=True, help="Anchors (blocks) per sequence.")
@precision_options(default="bf16")
@click.option("--profile", "profile_steps", default=0, show_default=True,
              help="Profile this many more steps (CUDA): kernel time per step by kind (matmul fp8 / "
                   "matmul / attention / fp8 scaling / fused elementwise / other) and the costliest kernels.")
def bench_drafter(device, steps, warmup, shape, seq_lens, num_seqs, anchors_per_seq, precisions, recipes,
                  lm_heads, profile_steps) -> None:
    """Step time, MFU and peak memory of a drafter step (default: Qwen3-8B shape, 4 x 2,048 tokens,
    512 anchors each = 32,768 query tokens), for each precision asked (with the speedup against
    the first) at each --seq-len."""
    from dflash_ipc.bench.drafter import compare_precisions, precision_variants
    variants = precision_variants(precisions, recipes, lm_heads)
    for seq_len in seq_lens:
        compare_precisions(device=device, steps=steps, shape=shape, variants=variants, warmup=warmup,
                           anchors_per_seq=anchors_per_seq, num_seqs=num_seqs, seq_len=seq_len,
                           profile_steps=profile_steps)


@bench.command("target")
@config_option
@override_option
@click.option("--target", "targets", multiple=True, required=True, type=click.Path(exists=True, file_okay=False),
              help="Target model directory (repeatable: measured one after the other, same data and device).")
@click.option("--seconds", default=30.0, show_default=True, help="Measured seconds per target.")
@click.option("--warmup-s", default=10.0, show_default=True, help="Seconds of warmup per target.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None, help="Also write the figures.")
def bench_target(config, overrides, targets, seconds, warmup_s, json_path) -> None:
    """Target capacity (tok/s of one worker: on target.devices[0], or its first K devices with
    target.gpus_per_worker K) of each --target, e.g. a MoE next to a dense one."""
    from dflash_ipc.bench.targets import format_target_table, run_target_bench
    from dflash_ipc.logs import setup_logging
    cfg = _load(config, overrides)
    setup_logging("bench", level=cfg.run.log_level)
    rows = run_target_bench(cfg, list(targets), seconds=seconds, warmup_s=warmup_s)
    if json_path:
        write_json_atomic(json_path, rows)
    click.echo(format_target_table(rows, cfg))


# The sizes of `bench precision`, with the defaults of bench/precision.py's RunSizes (a test
# checks they agree; importing that module here would load torch for every command).
RUN_SIZE_DEFAULTS = {"samples": 768, "min_len": 128, "max_len": 512, "held_out": 16, "steps": 300,
                     "anchors_per_step": 1024, "max_anchors_per_seq": 512, "num_layers": 5, "lr": 6e-4,
                     "eval_prompts": 16, "eval_tokens": 48, "seed": 0}


def _run_sizes_options(fn):
    return _add_options(fn, [click.option(f"--{name.replace('_', '-')}", name, type=type(value), default=value,
                                          show_default=True) for name, value in RUN_SIZE_DEFAULTS.items()])


@bench.command("precision")
@click.option("--device", default="cuda:0", show_default=True, callback=_checked_device)
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
    from dflash_ipc.bench.drafter import precision_variants
    from dflash_ipc.bench.precision import RunSizes, run_precision_comparison
    from dflash_ipc.logs import setup_logging
    setup_logging("bench")
    figures = run_precision_comparison(device=device, shape=shape, work_dir=work_dir, sizes=RunSizes(**sizes),
                                       variants=precision_variants(precisions, recipes, lm_heads))
    if json_path:
        write_json_atomic(json_path, figures)


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
    from dflash_ipc.bench.pipeline import format_table, run_pipeline_bench
    from dflash_ipc.logs import setup_logging
    from dflash_ipc.resolve import resolve_job
    cfg = _load(config, overrides)
    setup_logging("bench", level=cfg.run.log_level)
    figures = run_pipeline_bench(resolve_job(cfg), seconds=seconds, warmup_s=warmup_s, run_dir=run_dir,
                                 print_status=lambda line: click.echo(line))
    if json_path:
        write_json_atomic(json_path, figures)
    click.echo(format_table(figures))


@bench.command("regenerate")
@click.option("--shape", type=click.Choice(["tiny", "qwen3-0.6b", "qwen3-1.7b", "qwen3-8b"]), default="qwen3-1.7b",
              show_default=True, help="Random-weight target of this shape (built in a temporary directory).")
@click.option("--target", default=None, type=click.Path(exists=True, file_okay=False),
              help="A model directory instead of --shape.")
@click.option("--device", default="cuda:0", show_default=True, callback=_checked_device)
@click.option("--prompts", "num_prompts", default=1024, show_default=True, help="Prompts of the batched phase.")
@click.option("--one-at-a-time", "num_single", default=4, show_default=True, help="Prompts generated alone.")
@click.option("--min-prompt", default=64, show_default=True)
@click.option("--max-prompt", default=256, show_default=True)
@click.option("--max-new-tokens", default=128, show_default=True)
@click.option("--token-budget", type=int, default=None, help="Default 131072 on GPU, 16384 on CPU.")
@click.option("--max-batch-size", type=int, default=None, help="Default 256 on GPU, 64 on CPU.")
@click.option("--cache", "caches", multiple=True, type=click.Choice(["static", "dynamic"]),
              help="KV cache of the batched phase, repeatable (default: static, then dynamic).")
@click.option("--dtype", type=click.Choice(DTYPE_NAMES), default="bfloat16", show_default=True)
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None, help="Also write the figures as JSON.")
def bench_regenerate(shape, target, device, num_prompts, num_single, min_prompt, max_prompt, max_new_tokens,
                     token_budget, max_batch_size, caches, dtype, json_path) -> None:
    """Generated tokens/s of regenerate's batched HF generation against one prompt at a time."""
    from dflash_ipc.bench.regenerate import format_table, run_regenerate_bench, write_json
    result = run_regenerate_bench(shape=shape, target=target, device=device, num_prompts=num_prompts,
                                  num_single=num_single, min_prompt=min_prompt, max_prompt=max_prompt,
                                  max_new_tokens=max_new_tokens, token_budget=token_budget,
                                  max_batch_size=max_batch_size, caches=caches or ("static", "dynamic"), dtype=dtype)
    if json_path:
        write_json(result, json_path)
    click.echo(format_table(result))


@bench.command("eval")
@click.option("--device", default="cuda:0", show_default=True, callback=_checked_device)
@click.option("--shape", type=click.Choice(["tiny", "qwen3-0.6b", "qwen3-1.7b", "qwen3-8b"]), default="qwen3-1.7b",
              show_default=True, help="Random-weight target shape (bench/assets.py); tiny: a CPU smoke test.")
@click.option("--batch-sizes", default="1,16,64,256", show_default=True, metavar="B1,B2,...")
@click.option("--prompts-per-batch", default=2, show_default=True, type=click.IntRange(min=1),
              help="Prompts per batched row = this x the batch size (at least 2).")
@click.option("--max-new-tokens", default=128, show_default=True, type=click.IntRange(min=1))
@click.option("--prompt-len", default="64,256", show_default=True, metavar="MIN,MAX",
              help="Prompt lengths, log-uniform.")
@click.option("--legacy-prompts", default=2, show_default=True, type=click.IntRange(min=1),
              help="Prompts of the unbatched (legacy) rows.")
@click.option("--dtype", type=click.Choice(["auto", *DTYPE_NAMES]), default="auto",
              show_default=True)
@click.option("--work-dir", default=None, type=click.Path(file_okay=False),
              help="Keep the random target here (reused next time); default: a temporary directory.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None, help="Also write the figures.")
def bench_eval(device, shape, batch_sizes, prompts_per_batch, max_new_tokens, prompt_len, legacy_prompts, dtype,
               work_dir, json_path) -> None:
    """Tokens/s of batched speculative and plain decoding against the unbatched decoder."""
    from dflash_ipc.bench.eval import run_eval_bench
    from dflash_ipc.logs import setup_logging
    setup_logging("bench")
    figures = run_eval_bench(device=device, shape=shape, batch_sizes=_int_list(batch_sizes, "--batch-sizes"),
                             prompts_per_batch=prompts_per_batch, max_new_tokens=max_new_tokens,
                             prompt_len=tuple(_int_list(prompt_len, "--prompt-len", size=2)),
                             legacy_prompts=legacy_prompts, dtype=dtype, work_dir=work_dir, emit=click.echo)
    if json_path:
        write_json_atomic(json_path, figures)


def _int_list(text: str, option: str, size: int | None = None) -> list[int]:
    from dflash_ipc.errors import ConfigError
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1 or (size is not None and len(values) != size):
        want = f"{size} " if size else ""
        raise ConfigError(f"{option} {text!r}: expected {want}comma-separated integers >= 1")
    return values


@main.command("plan")
@click.option("--gpus", "num_gpus", type=int, required=True, help="GPUs to split between targets and drafters.")
@click.option("--target-capacity", type=float, default=None, metavar="TOK_S",
              help="Tokens/s of one target worker (on its --gpus-per-target GPUs).")
@click.option("--drafter-capacity", type=float, default=None, metavar="TOK_S",
              help="Trained tokens/s of one drafter on one GPU.")
@click.option("--from-bench", "bench_path", type=click.Path(dir_okay=False), default=None,
              help="Take both capacities from a dflash-ipc bench pipeline --json file.")
@click.option("--gpus-per-target", type=int, default=None,
              help="GPUs of one target worker (target.gpus_per_worker); default: the bench file's, else 1.")
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
def plan(num_gpus, target_capacity, drafter_capacity, bench_path, gpus_per_target, as_json) -> None:
    """The target/drafter GPU split that maximises predicted tok_rate, and its config."""
    import json
    from dflash_ipc.plan import capacities_from_bench, format_plan, gpus_per_target_from_bench, make_plan
    given = (target_capacity is not None, drafter_capacity is not None)
    if bench_path is not None:
        if any(given):
            raise ConfigError("plan: give either --from-bench or --target-capacity/--drafter-capacity, not both")
        target_capacity, drafter_capacity = capacities_from_bench(bench_path)
        if gpus_per_target is None:
            gpus_per_target = gpus_per_target_from_bench(bench_path)
    elif not all(given):
        raise ConfigError("plan: give --target-capacity and --drafter-capacity (tokens/s per GPU), "
                          "or --from-bench FILE")
    result = make_plan(num_gpus, target_capacity, drafter_capacity, gpus_per_target or 1)
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
    except ConfigError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(EXIT_CONFIG_ERROR)  # the supervisor never restarts a child that exits so
    except DFlashError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(EXIT_ERROR)


if __name__ == "__main__":
    run()
