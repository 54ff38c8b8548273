"""Shared fixtures: the tiny target and synthetic dataset, built once per test session."""

import os

import pytest
import torch

torch.set_num_threads(1)
# No test reaches the network: a name that reads ORG/NAME and is not a local path is looked up
# in the Hugging Face cache only (dflash_ipc/hf/hub.py), never downloaded.
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def tiny_cache(tmp_path_factory):
    """A DFLASH_IPC_CACHE holding the tiny target (built through save_pretrained)."""
    cache = tmp_path_factory.mktemp("dflash-cache")
    from dflash_ipc.builtin.tiny import build_tiny_target
    build_tiny_target(os.path.join(cache, "tiny-target"))
    return cache


@pytest.fixture(scope="session")
def target_dir(tiny_cache):
    """The tiny target's directory in ``tiny_cache`` (float32 Qwen3, saved through save_pretrained)."""
    return os.path.join(tiny_cache, "tiny-target")


@pytest.fixture(scope="module")
def legacy(target_dir):
    """The unbatched decoder's target over the tiny target (float32, CPU), capturing eval_helpers'
    LAYER_IDS: one per test module."""
    from eval_helpers import LAYER_IDS
    from dflash_ipc.eval.unbatched import TargetLM
    return TargetLM(target_dir, layer_ids=LAYER_IDS, device="cpu", dtype="float32")


@pytest.fixture(scope="session")
def cpu_run(tmp_path_factory, tiny_cache):
    """A finished small CPU job with a saved evaluation (tests/cpu_run.py); read it, never change it."""
    from cpu_run import run_cpu_job
    return run_cpu_job(tmp_path_factory.mktemp("cpu-run"), tiny_cache)


@pytest.fixture(scope="session")
def four_layer_target(tmp_path_factory):
    """A float32 random target of the bench's ``tiny`` shape (Qwen3) with 4 layers, for the
    compiled decode tests (saved once; the tests load it, never change it)."""
    from dflash_ipc.bench.assets import build_random_target
    path = str(tmp_path_factory.mktemp("four-layers") / "target")
    build_random_target(path, shape="tiny", dtype="float32", num_layers=4, seed=5)
    return path
