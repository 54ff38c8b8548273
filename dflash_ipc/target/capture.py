"""The frozen target, cut after its deepest captured layer, and the capture of layer outputs.

Only layers 0..max(layer_ids) are built and loaded (the config is truncated before
`from_pretrained`, so the weights of later layers and the LM head are never read into
memory), and the model is the bare decoder (`AutoModel`), with no LM head. Forward hooks on
the captured layers keep their outputs, which are HF `hidden_states[id + 1]`.
"""

from __future__ import annotations

import logging
import os

import torch
from transformers import AutoConfig, AutoModel

from dflash_ipc.dtypes import TORCH_DTYPES
from dflash_ipc.errors import ConfigError

log = logging.getLogger(__name__)



def load_target_config(path: str):
    """The target's HF config; a clear error when `path` is not a model directory."""
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ConfigError(f"target.path: {path} is not a model directory (no config.json there)")
    return AutoConfig.from_pretrained(path)


class FeatureCapture:
    """Runs padded token batches through the truncated target; writes packed features."""

    def __init__(self, path: str, *, layer_ids: list[int], dtype: str, attn_implementation: str,
                 device: str) -> None:
        config = load_target_config(path)
        num_layers = config.num_hidden_layers
        if max(layer_ids) >= num_layers:
            raise ConfigError(f"drafter.target_layer_ids: {layer_ids} reach beyond the target's "
                              f"{num_layers} layers (allowed: 0..{num_layers - 1})")
        self.layer_ids = list(layer_ids)
        keep = max(layer_ids) + 1
        config.num_hidden_layers = keep
        if getattr(config, "layer_types", None) is not None:
            config.layer_types = list(config.layer_types)[:keep]
        self.device = torch.device(device)
        self.model = AutoModel.from_pretrained(path, config=config, dtype=TORCH_DTYPES[dtype],
                                               attn_implementation=attn_implementation)
        self.model.to(self.device).eval().requires_grad_(False)
        self.hidden_size = config.hidden_size
        self.feature_dim = self.hidden_size * len(layer_ids)
        self.dtype = TORCH_DTYPES[dtype]
        self._captured: dict[int, torch.Tensor] = {}
        layers = self.model.layers
        for layer_id in self.layer_ids:
            layers[layer_id].register_forward_hook(self._hook(layer_id))
        log.info("target %s: %d of %d layers loaded, capturing %s (feature dim %d)",
                 path, keep, num_layers, layer_ids, self.feature_dim)

    def _hook(self, layer_id: int):
        def keep_output(module, args, output):
            # Decoder layers return a tensor (transformers >= 4.56 for Qwen3) or a tuple.
            self._captured[layer_id] = output[0] if isinstance(output, tuple) else output
        return keep_output

    @torch.inference_mode()
    def forward_into(self, input_ids: torch.Tensor, lengths: torch.Tensor, out: torch.Tensor) -> int:
        """Runs one right-padded batch and writes the valid tokens' features into `out`.

        input_ids [B, L] long on self.device, lengths [B]; out [>= sum(lengths), F] (a slot
        view). Features are packed sequence after sequence, valid tokens only, layers
        concatenated in `layer_ids` order. Returns the number of tokens written.
        """
        batch, padded = input_ids.shape
        valid = torch.arange(padded, device=self.device)[None, :] < lengths[:, None]  # [B, L]
        self._captured.clear()
        self.model(input_ids=input_ids, attention_mask=valid.long(), use_cache=False)
        # Row indices of the valid tokens in [B*L], row-major over (sequence, position): the
        # packed order. Computed once (one device sync) and reused for every captured layer.
        rows = valid.reshape(-1).nonzero().squeeze(1)  # [T]
        num_tokens = rows.numel()
        hidden = self.hidden_size
        for j, layer_id in enumerate(self.layer_ids):
            flat = self._captured[layer_id].reshape(batch * padded, hidden)  # [B*L, H]
            out[:num_tokens, j * hidden:(j + 1) * hidden] = flat.index_select(0, rows)
        self._captured.clear()
        return num_tokens
