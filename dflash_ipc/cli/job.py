"""`up` (the whole job, supervised) and the stages it starts: `dispatcher`, `target`, `drafter`."""

from __future__ import annotations

import logging
import os
import sys

import click

from dflash_ipc.cli.app import config_option, load_job_config, main, override_option, resolved

log = logging.getLogger("dflash_ipc.cli")

# What `up` without --config runs, said before it starts (a user may have meant to pass one).
EMBEDDED_DEFAULT_LINE = ("no --config: running the embedded default (configs/default.yaml: a tiny random target "
                         "on CPU, synthetic data); pass --config FILE for your own job")


def _stage_setup(role: str, cfg) -> None:
    from dflash_ipc.run.child_env import (SUPERVISOR_ENV, ParentWatch, die_with_parent, exit_on_sigterm, supervisor_pid,
                                         unlink_own_segments)
    from dflash_ipc.run.logs import setup_logging
    setup_logging(role, level=cfg.run.log_level)
    exit_on_sigterm()
    if os.environ.get(SUPERVISOR_ENV):
        die_with_parent()  # then the watch, whose first look covers a parent gone before this
        ParentWatch(parent=supervisor_pid(), grace_s=cfg.supervise.grace_s, before_kill=unlink_own_segments).start()


@main.command()
@config_option
@override_option
@click.option("--nnodes", type=int, default=None,
              help="Nodes of the job (run.num_nodes); each runs its own targets and drafters.")
@click.option("--node-rank", type=int, default=None, help="This node, 0..nnodes-1 (run.node_rank); 0 runs the dispatcher.")
@click.option("--dispatcher", "dispatcher_address", default=None, metavar="tcp://HOST:PORT",
              help="The job's dispatcher (dispatch.address): node 0 listens there, every node connects.")
@click.option("--init-from", "init_from", default=None, metavar="DIR|ORG/NAME",
              help="Start the drafter from an exported one's weights (drafter.init_from); a resumed job ignores it.")
def up(config, overrides, nnodes, node_rank, dispatcher_address, init_from) -> None:
    """Run the whole job: dispatcher, targets and drafters, supervised.

    Several nodes: on each, `dflash-up --nnodes N --node-rank K --dispatcher tcp://NODE0:PORT`
    with the same config; MASTER_ADDR/MASTER_PORT as torchrun's, else the dispatcher's host
    and PORT+1 (the drafters of all nodes form one group)."""
    from dflash_ipc.config.schema import BUILTIN_SYNTHETIC_DATA, BUILTIN_TINY_TARGET
    from dflash_ipc.supervise.run_dir_claim import claim_run_dir
    from dflash_ipc.run.logs import setup_logging
    flags = [f"run.num_nodes={nnodes}"] if nnodes is not None else []
    flags += [f"run.node_rank={node_rank}"] if node_rank is not None else []
    flags += [f"dispatch.address={dispatcher_address}"] if dispatcher_address is not None else []
    flags += [f"drafter.init_from={init_from}"] if init_from is not None else []
    # The config first: a typo is answered before the supervisor's imports (torch: seconds).
    cfg = load_job_config(config, overrides + tuple(flags))
    if config is None:
        click.echo(EMBEDDED_DEFAULT_LINE)
    setup_logging("supervisor" if cfg.run.num_nodes == 1 else f"supervisor/{cfg.run.node_rank}",
                  level=cfg.run.log_level)
    embedded_default = (cfg.target.path == BUILTIN_TINY_TARGET and cfg.data.path == BUILTIN_SYNTHETIC_DATA
                        and cfg.run.num_nodes == 1)
    # The run directory before the target: one in use is refused before anything says the job
    # starts (resolving logs the derived layers, and takes seconds), and `health` reads STARTING
    # from here on.
    made_run_dir = not os.path.exists(cfg.run.run_dir)
    run_lock = claim_run_dir(cfg)
    try:
        cfg = resolved(cfg)
    except BaseException:
        run_lock.abandon(remove_dir=made_run_dir)  # a bad target or dataset leaves no run directory
        raise
    from dflash_ipc.dispatch.generation_file import read_generation
    from dflash_ipc.dispatch.proc import finished_before
    from dflash_ipc.supervise.supervisor import Supervisor
    supervisor = Supervisor(cfg, run_lock=run_lock)
    read_generation(cfg.files.drafter_generation)  # damaged: one error now, not a dispatcher failing 3 times
    if finished_before(cfg):
        supervisor.run_lock.release()
        click.echo(f"{cfg.run.run_dir} holds a finished job (every batch committed; checkpoints in "
                   f"{cfg.run.run_dir}/checkpoints). Start a new one with -o run.run_dir=DIR.")
        sys.exit(0)
    log.info("run directory %s: %d targets on %s, %d drafters on %s", cfg.run.run_dir,
             cfg.target.num_workers, ",".join(cfg.target.devices), cfg.drafter.num_workers,
             ",".join(cfg.drafter.devices))
    code = supervisor.run()
    if code == 0 and cfg.run.node_rank == 0:
        from dflash_ipc.supervise.job_end import next_steps
        click.echo("\n".join(next_steps(cfg)))
    if code in (130, 143):  # Ctrl-C, SIGTERM: the drafters checkpointed; say how to go on
        from dflash_ipc.supervise.job_end import stopped_lines
        click.echo("\n".join(stopped_lines(cfg)))
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
    cfg = load_job_config(config, overrides)
    _stage_setup("dispatcher", cfg)
    run_dispatcher(resolved(cfg))


@main.command()
@config_option
@override_option
@click.option("--rank", type=int, required=True, help="Target rank, 0..target.num_workers-1.")
@click.option("--tp-rank", type=int, default=0, show_default=True,
              help="Process of the worker, 0..target.gpus_per_worker-1 (0: the leader).")
def target(config, overrides, rank, tp_rank) -> None:
    """Run one target worker alone (one process of it with target.gpus_per_worker > 1)."""
    from dflash_ipc.supervise.roles import Role
    from dflash_ipc.target.worker import run_target
    cfg = load_job_config(config, overrides)
    _stage_setup(str(Role("target", rank, tp_rank)), cfg)
    run_target(resolved(cfg), rank, tp_rank)


@main.command()
@config_option
@override_option
@click.option("--rank", type=int, required=True, help="Drafter rank, 0..drafter.num_workers-1.")
def drafter(config, overrides, rank) -> None:
    """Run one drafter worker alone (all drafters must run to form the group)."""
    from dflash_ipc.drafter.worker import run_drafter
    from dflash_ipc.eval.held_out_validation import HeldOutValidator
    cfg = load_job_config(config, overrides)
    _stage_setup(f"drafter/{rank}", cfg)
    run_drafter(resolved(cfg), rank, validator_factory=HeldOutValidator)
