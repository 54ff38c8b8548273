"""The one table between dtype names and torch dtypes, and `auto`."""

import pytest
import torch

from dflash_ipc.config.schema import DTYPE_NAMES
from dflash_ipc.config.dtypes import DTYPE_CHOICES, DTYPE_OF_TORCH, TORCH_DTYPES, resolve_dtype
from dflash_ipc.errors import ConfigError


def test_every_config_dtype_has_one_torch_dtype_and_back():
    assert tuple(TORCH_DTYPES) == DTYPE_NAMES and DTYPE_CHOICES == ("auto", *DTYPE_NAMES)
    assert all(DTYPE_OF_TORCH[TORCH_DTYPES[name]] == name for name in DTYPE_NAMES)


def test_auto_is_float32_on_cpu_and_bfloat16_elsewhere_and_a_bad_name_is_named():
    assert resolve_dtype("auto", "cpu") is torch.float32 and resolve_dtype("auto", "cuda:1") is torch.bfloat16
    assert resolve_dtype("float16", "cpu") is torch.float16
    with pytest.raises(ConfigError, match="dtype 'int8' not allowed; allowed: auto, bfloat16, float16, float32"):
        resolve_dtype("int8", "cpu")
