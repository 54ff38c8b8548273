"""The metric sinks of one job: the status history `dflash-ipc report` reads, then each tracker
`metrics.sinks` names (metric_sinks.py, wandb_sink.py). Node 0's supervisor opens them before
any child starts and is their only writer.

    sinks = open_sinks(cfg)
    sinks.write(status)     # every status poll, and the final status
    sinks.close()
"""

from __future__ import annotations

import os

from dflash_ipc.obs.sinks import MetricSinks, TensorBoardSink
from dflash_ipc.obs.status_history import StatusHistorySink
from dflash_ipc.obs.wandb_sink import WandbSink


def open_sinks(cfg) -> MetricSinks:
    """The sinks of a job (`cfg`: a JobConfig): the status history `dflash-ipc report` reads,
    then each tracker of `metrics.sinks` that can open. TensorBoard, the default, is skipped
    with one line when its package is missing; wandb, named only on purpose, raises
    MissingExtraError."""
    files = cfg.files
    os.makedirs(files.run_dir, mode=0o700, exist_ok=True)  # the supervisor's mode: sockets and keys live there
    sinks: list = [StatusHistorySink(files.status_history)]
    try:
        for name in cfg.metrics.sinks:
            sink = TensorBoardSink.open(files.tensorboard) if name == "tensorboard" else WandbSink.open(cfg)
            if sink is not None:
                sinks.append(sink)
    except BaseException:
        MetricSinks(sinks).close()
        raise
    return MetricSinks(sinks)
