"""`plan`: the target/drafter GPU split that maximises predicted tok_rate."""

from __future__ import annotations


import click

from dflash_ipc.errors import ConfigError
from dflash_ipc.cli.app import main



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
    from dflash_ipc.config.plan import capacities_from_bench, format_plan, gpus_per_target_from_bench, make_plan
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
