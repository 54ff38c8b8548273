"""The one table between dtype names (config, descriptors, exports) and torch dtypes."""

from __future__ import annotations

import torch

from dflash_ipc.config.schema import DTYPE_NAMES
from dflash_ipc.errors import ConfigError

TORCH_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPE_NAMES}
DTYPE_OF_TORCH: dict[torch.dtype, str] = {dtype: name for name, dtype in TORCH_DTYPES.items()}
DTYPE_CHOICES: tuple[str, ...] = ("auto", *DTYPE_NAMES)
"""What eval and regenerate accept: a dtype name, or auto (resolve_dtype)."""


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of `name` (one of DTYPE_NAMES); ValueError naming the allowed ones."""
    try:
        return TORCH_DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype {name!r} not allowed; allowed: {', '.join(DTYPE_NAMES)}") from None


def resolve_dtype(name: str, device: str | torch.device) -> torch.dtype:
    """`auto`: float32 on CPU (bf16 is emulated there), bfloat16 on accelerators; otherwise the
    named dtype. ConfigError naming the allowed ones."""
    if name == "auto":
        return torch.float32 if torch.device(device).type == "cpu" else torch.bfloat16
    if name not in TORCH_DTYPES:
        raise ConfigError(f"dtype {name!r} not allowed; allowed: {', '.join(DTYPE_CHOICES)}")
    return TORCH_DTYPES[name]
