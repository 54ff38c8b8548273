"""tau on held-out prompts during training: `validation.prompts` > 0.

Drafter rank 0 calls a `HeldOutValidator` with each validated checkpoint (the inference export
in its step directory, the weights the checkpoint keeps): the first `validation.prompts`
held-out prompts the dataset declares (`prepare --held-out N`, or the built-in data's) are
decoded greedily, all at once, by batched speculative decoding against the target (the same
decoders `eval` runs; no plain pass, so no speedup and no lossless check), and the result is
tau: committed tokens per target forward. The target is loaded on the drafter's device at the
first call and kept; the other drafter ranks wait for rank 0 at the next collective meanwhile.

The drafter package cannot import this one (it sits below eval): the `drafter` command builds
the validator and hands it to the worker (`run_drafter(..., validator=...)`).
"""

from __future__ import annotations

import logging
import time

import torch

from dflash_ipc.config.dtypes import TORCH_DTYPES
from dflash_ipc.config.schema import JobConfig
from dflash_ipc.data.dataset import TokenDataset
from dflash_ipc.decode.target import BatchedTarget
from dflash_ipc.drafter.inference_format import load_inference_checkpoint
from dflash_ipc.errors import ConfigError
from dflash_ipc.eval.prompt_sets import held_out_set
from dflash_ipc.eval.speculative import EvalOptions, run_set

log = logging.getLogger(__name__)


class HeldOutValidator:
    def __init__(self, cfg: JobConfig, device: str) -> None:
        self.cfg, self.device = cfg, device
        self.dtype = TORCH_DTYPES[cfg.drafter.dtype]
        dataset = TokenDataset(cfg.data.path)
        # Checked first: without declared prompts held_out_set would fall back to training samples.
        if not (dataset.meta.get("extra") or {}).get("held_out"):
            raise ConfigError(f"validation.prompts={cfg.validation.prompts}: the dataset {cfg.data.path} declares no "
                              f"held-out prompts (prepare it with --held-out N); its training samples are no "
                              f"held-out set")
        self.prompts = held_out_set(dataset, num_prompts=cfg.validation.prompts)
        self._target: BatchedTarget | None = None

    def __call__(self, step_dir: str) -> dict:
        """{"tau", "prompts", "tokens", "seconds"} of the drafter exported in `step_dir`."""
        started = time.perf_counter()
        drafter = load_inference_checkpoint(step_dir, device=self.device, dtype=self.dtype)
        if self._target is None:
            self._target = BatchedTarget(self.cfg.target.path, layer_ids=drafter.config.target_layer_ids,
                                         device=self.device, dtype=self.cfg.drafter.dtype)
        options = EvalOptions(max_new_tokens=self.cfg.validation.max_new_tokens, batch_size=len(self.prompts.cases),
                              plain=False)
        with torch.random.fork_rng(devices=[]):  # training's generators are not drawn from
            report, = run_set(self._target, [("validation", drafter)], self.prompts, renderer=None, options=options)
        del drafter
        return {"tau": float(report.tau), "prompts": len(self.prompts.cases),
                "tokens": int(report.stats.num_generated),
                "seconds": time.perf_counter() - started}
