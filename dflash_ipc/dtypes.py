"""The one table between dtype names (config, descriptors, exports) and torch dtypes."""

from __future__ import annotations

import torch

from dflash_ipc.config import DTYPE_NAMES

TORCH_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPE_NAMES}
DTYPE_OF_TORCH: dict[torch.dtype, str] = {dtype: name for name, dtype in TORCH_DTYPES.items()}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of `name` (one of DTYPE_NAMES); ValueError naming the allowed ones."""
    try:
        return TORCH_DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype {name!r} not allowed; allowed: {', '.join(DTYPE_NAMES)}") from None
