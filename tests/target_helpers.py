"""Shared by tests that need a broken tiny target: a checkpoint missing one weight."""

import os

from safetensors.torch import load_file, save_file


def drop_weight(target_dir: str, name: str) -> None:
    """Rewrite the target's model.safetensors without the tensor `name`."""
    weights = os.path.join(target_dir, "model.safetensors")
    tensors = load_file(weights)
    del tensors[name]
    save_file(tensors, weights, metadata={"format": "pt"})
