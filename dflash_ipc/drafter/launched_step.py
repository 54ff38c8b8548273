"""A training step whose work is queued on the device, and the figures it reports once done.

Reading a device value on the host (``float(loss)``, ``.tolist()``) waits for the GPU to
finish everything queued before it. A step that read its loss, weight sum and gradient norm
as it went left the GPU idle while the host built the next batch and block mask (a third to
a half of a small drafter's step). So the step's figures stay on the device: one
``[n]`` float64 vector, copied into pinned host memory without blocking, with an event
recorded behind the copy. ``result()`` waits for that event only: the host may already have
queued the next step, which the read does not wait for.

``step_s`` runs from the step's launch, or from the moment the host read the previous step's
figures if that came later (a pipelined loop reads step N-1 after launching step N), to the
moment its own figures were read. Read at once (``step()``), that is the step's wall time;
in the pipelined loop it also holds whatever the loop did before launching the next step
(waiting for hidden states included).
"""

from __future__ import annotations

import time

import torch
from torch import Tensor

from dflash_ipc.drafter.acceptance_proxy import acceptance_summary

FIGURES = ("loss_sum", "anchors", "tokens", "weight_sum", "grad_norm")
"""The leading entries of a step's figure vector; the acceptance totals (validation) follow."""


class StepClock:
    """When the host last read a step's figures: where the next step's ``step_s`` starts at the
    earliest."""

    def __init__(self) -> None:
        self.last_read = 0.0


class LaunchedStep:
    """One launched step: ``figures`` ``[len(FIGURES) (+ block_size + 1)]`` float64 on the
    device (sent to the host asynchronously here) and what the host knows already."""

    def __init__(self, figures: Tensor, *, step: int, lr: float, mask_s: float, started: float,
                 validate: bool, clock: StepClock) -> None:
        self.step, self.lr, self.mask_s, self.started, self.validate = step, lr, mask_s, started, validate
        self._clock = clock
        self._done: torch.cuda.Event | None = None
        if figures.device.type == "cuda":
            with torch.cuda.device(figures.device):  # the copy and the event on that device's stream
                self._host = torch.empty(figures.shape, dtype=figures.dtype, pin_memory=True)
                self._host.copy_(figures, non_blocking=True)
                self._done = torch.cuda.Event()
                self._done.record()
        else:
            self._host = figures
        self._result: dict | None = None

    def result(self) -> dict:
        """The step's figures (waits for the step's device work, nothing queued after it)."""
        if self._result is None:
            if self._done is not None:
                self._done.synchronize()
            values = self._host.tolist()
            now = time.perf_counter()
            step_s = now - max(self.started, self._clock.last_read)
            self._clock.last_read = now
            named = dict(zip(FIGURES, values))
            weight = named["weight_sum"]
            validation = acceptance_summary(values[len(FIGURES):]) if self.validate else {}
            self._result = {**validation, "step": self.step,
                            "loss": named["loss_sum"] / weight if weight else float("nan"),
                            "anchors": int(named["anchors"]), "tokens": int(named["tokens"]), "lr": self.lr,
                            "grad_norm": named["grad_norm"], "step_s": step_s, "mask_s": self.mask_s}
        return self._result
