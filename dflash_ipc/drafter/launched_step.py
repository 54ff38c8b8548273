"""A training step whose work is queued on the device, and the figures it reports once done.

Reading a device value on the host (``float(loss)``, ``.tolist()``) waits for the GPU to
finish everything queued before it. A step that read its loss, weight sum and gradient norm
as it went left the GPU idle while the host built the next batch and block mask (a third to
a half of a small drafter's step). So the step's figures stay on the device: one
``[n]`` float64 vector, copied into pinned host memory without blocking, with an event
recorded behind the copy. ``result()`` waits for that event only: the host may already have
queued the next step, which the read does not wait for.

``step_s`` on a GPU is the device's span of the step: from an event recorded as the launch
began (which the GPU reaches once the step before it is done, or at once if it was idle) to the
event behind the figures' copy. The host's time to build the batch and mask counts where the
GPU waited for it; what the loop does after the launch (waiting for hidden states, reading
the step before) does not, so a pipelined loop's busy share is not overstated. On the CPU,
where the work is the host's, ``step_s`` runs from the launch, or from the moment the host read
the previous step's figures if that came later, to the moment its own figures were read.
"""

from __future__ import annotations

import logging
import time

import torch
from torch import Tensor

from dflash_ipc.drafter.acceptance_proxy import acceptance_summary

logger = logging.getLogger(__name__)
_warned = False  # the host-clock fallback of _device_span has been logged

FIGURES = ("loss_sum", "anchors", "tokens", "weight_sum", "grad_norm")
"""The leading entries of a step's figure vector; the acceptance totals (validation) follow."""


class StepClock:
    """When the host last read a step's figures: where the next step's ``step_s`` starts at the
    earliest."""

    def __init__(self) -> None:
        self.last_read = 0.0


def launch_started(device: torch.device) -> torch.cuda.Event | None:
    """An event recorded now on ``device``'s current stream, where a step's span starts (CUDA
    only): pass it to the step's :class:`LaunchedStep`."""
    if torch.device(device).type != "cuda":
        return None
    with torch.cuda.device(device):
        event = torch.cuda.Event(enable_timing=True)
        event.record()
    return event


class LaunchedStep:
    """One launched step: ``figures`` ``[len(FIGURES) (+ block_size + 1)]`` float64 on the
    device (sent to the host asynchronously here) and what the host knows already."""

    def __init__(self, figures: Tensor, *, step: int, lr: float, mask_s: float, started: float,
                 validate: bool, clock: StepClock, start_event: torch.cuda.Event | None = None) -> None:
        self.step, self.lr, self.mask_s, self.started, self.validate = step, lr, mask_s, started, validate
        self._clock = clock
        self._start = start_event  # recorded as the launch began (launch_started), on the figures' device
        self._done: torch.cuda.Event | None = None
        if figures.device.type == "cuda":
            with torch.cuda.device(figures.device):  # the copy and the event on that device's stream
                self._host = torch.empty(figures.shape, dtype=figures.dtype, pin_memory=True)
                self._host.copy_(figures, non_blocking=True)
                self._done = torch.cuda.Event(enable_timing=start_event is not None)
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
            step_s = self._device_span()
            if step_s is None:
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

    def _device_span(self) -> float | None:
        """Seconds between the launch's and the figures' events (None without them, or where the
        events cannot be timed: then the host clock, with one warning)."""
        global _warned
        if self._start is None:
            return None
        try:
            return self._start.elapsed_time(self._done) / 1e3
        except RuntimeError as exc:
            if not _warned:
                _warned = True
                logger.warning("drafter: a step's CUDA events could not be timed (%s); step_s from the host clock", exc)
            return None
