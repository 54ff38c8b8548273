"""Warnings a user cannot act on, dropped where they are logged.

transformers imports torchao whenever it is installed (its quantizers module, at the first
`from_pretrained`), also on a job without `drafter.precision: fp8`; dflash-ipc itself imports
torchao only for fp8 (drafter/precision.py). The lines that import prints are about torchao's
own build, not about the job: each filter below names the line and why it is noise. Filters
sit on the logger that emits the line (a logger's filter sees its own records whatever the
handlers), so torch's logging set-up cannot route around them; every other line of those
loggers passes.
"""

from __future__ import annotations

import logging

# (logger, the message's start or a part of it, why the line tells a user nothing to do)
UNACTIONABLE = (
    # torchao tries each optional C++ extension it ships (mxfp8, cutlass sm90a kernels); a build
    # for another CUDA or Python (and every CPU-only torch) fails to load them. The float8
    # training dflash-ipc uses is written in PyTorch and needs none of them.
    ("torchao", "Failed to load ", "Could not load this library"),
    # torchao's integer-matmul kernels want triton, absent on CPU-only torch; dflash-ipc never
    # calls them (fp8 training is torch.compile'd float8 matmuls, not intmm).
    ("torchao.kernel.intmm", "Warning: Detected no triton", ""),
    # torchao registers its enums as pytree constants, which torch >= 2.11 deprecates: a note to
    # torchao's authors, printed once per enum in every process that imports it.
    ("torch.utils._pytree", "", "Calling register_constant() on Enum subclasses is deprecated"),
)


class _DropUnactionable(logging.Filter):
    def __init__(self, start: str, part: str) -> None:
        super().__init__()
        self.start = start
        self.part = part

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not (message.startswith(self.start) and self.part in message)


def quiet_unactionable_warnings() -> None:
    """Installs the filters of UNACTIONABLE (once: a second call adds nothing)."""
    for name, start, part in UNACTIONABLE:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropUnactionable) and (f.start, f.part) == (start, part) for f in logger.filters):
            logger.addFilter(_DropUnactionable(start, part))
