"""The frozen target, cut after its deepest captured layer, and the capture of layer outputs.

Only the text stack's layers 0..max(layer_ids) are built and loaded (the config is truncated
before `from_pretrained`, with every per-layer list cut to match, so the weights of later
layers and the LM head are never read into memory), and the model is the bare decoder
(`AutoModel`), with no LM head. The text stack is found by `text_stack.find_text_stack`, so
multimodal checkpoints work too: only their text decoder moves to the worker's device.
Forward hooks on the captured layers keep their outputs, which are HF `hidden_states[id + 1]`.

Nothing assumes the decoder sits on one device: token ids go to the embedding's device and
each captured layer's rows are gathered where that layer ran, then copied into the slot.
With `tensor_parallel=K > 1` (a K-process target worker, target/tensor_parallel.py) every rank
of the worker's process group loads its shard through transformers' own plan and runs the
same forward; the layer outputs are whole on every rank (all-reduced inside each layer), and
the leader writes them.
"""

from __future__ import annotations

import logging

import torch
from transformers import AutoModel

from dflash_ipc.config.dtypes import TORCH_DTYPES
from dflash_ipc.hf.target_config import check_layer_ids, load_target_config
from dflash_ipc.target.tensor_parallel import bound_device, load_kwargs
from dflash_ipc.hf.text_stack import (check_load_report, find_text_stack, input_device, load_pretrained,
                                          num_text_layers, text_config, truncated_config)

log = logging.getLogger(__name__)


class FeatureCapture:
    """Runs padded token batches through the truncated target; writes packed features."""

    def __init__(self, path: str, *, layer_ids: list[int], dtype: str, attn_implementation: str,
                 device: str, tensor_parallel: int = 1, expert_parallel: bool = False) -> None:
        config = load_target_config(path)
        num_layers = num_text_layers(config)
        check_layer_ids(layer_ids, num_layers)
        self.layer_ids = list(layer_ids)
        self.tensor_parallel = tensor_parallel
        keep = max(layer_ids) + 1
        with bound_device(device):  # tensor-parallel loading places the shards on this device
            model, info = load_pretrained(path, AutoModel, config=truncated_config(config, keep),
                                          dtype=TORCH_DTYPES[dtype], attn_implementation=attn_implementation,
                                          extra=load_kwargs(tensor_parallel, expert_parallel))
        stack = find_text_stack(model, keep)
        loaded = check_load_report(path, info, stack=stack, keep=keep, total=num_layers)
        # Only the text stack goes to the device: a multimodal model's vision tower stays on
        # the host and is dropped with `model` (a tensor-parallel load is on its device already).
        decoder = stack.decoder if tensor_parallel > 1 else stack.decoder.to(device)
        self.decoder = decoder.eval().requires_grad_(False)
        self.layers = stack.layers
        self.embed_tokens = stack.embed_tokens
        self.attn_implementation = model.config._attn_implementation
        # transformers 5 runs MoE experts as grouped matmuls where it can, else a loop: say which.
        has_experts = any(getattr(text_config(config), key, None) for key in ("num_experts", "num_local_experts"))
        self.experts_implementation = getattr(model.config, "_experts_implementation", None) if has_experts else None
        del model
        self.device = input_device(stack)
        self.hidden_size = int(text_config(config).hidden_size)
        self.vocab_size = int(text_config(config).vocab_size)  # token ids must stay below it
        self.feature_dim = self.hidden_size * len(layer_ids)
        self.dtype = TORCH_DTYPES[dtype]
        self._captured: dict[int, torch.Tensor] = {}
        for layer_id in self.layer_ids:
            self.layers[layer_id].register_forward_hook(self._hook(layer_id))
        experts = f", {self.experts_implementation} experts" if self.experts_implementation else ""
        split = (f", {'expert' if expert_parallel else 'tensor'} parallel over {tensor_parallel} ranks"
                 if tensor_parallel > 1 else "")
        log.info("target %s (%s, %s attention%s%s): %s; capturing %s (feature dim %d)", path,
                 type(self.decoder).__name__, self.attn_implementation, experts, split, loaded, layer_ids,
                 self.feature_dim)

    def _hook(self, layer_id: int):
        def keep_output(module, args, output):
            # Decoder layers return a tensor (transformers >= 4.56 for Qwen3) or a tuple.
            self._captured[layer_id] = output[0] if isinstance(output, tuple) else output
        return keep_output

    @torch.inference_mode()
    def forward_into(self, input_ids: torch.Tensor, lengths: torch.Tensor, out: torch.Tensor | None) -> int:
        """Runs one right-padded batch and writes the valid tokens' features into `out`.

        input_ids [B, L] long, lengths [B] (moved to the embedding's device if elsewhere);
        out [>= sum(lengths), F] (a slot view). Features are packed sequence after sequence,
        valid tokens only, layers concatenated in `layer_ids` order. Returns the number of
        tokens written. `out=None`: the forward alone, nothing written (a follower rank of a
        tensor-parallel worker: its collectives are the point, the leader writes).
        """
        input_ids, lengths = input_ids.to(self.device), lengths.to(self.device)
        batch, padded = input_ids.shape
        valid = torch.arange(padded, device=self.device)[None, :] < lengths[:, None]  # [B, L]
        self._captured.clear()
        self.decoder(input_ids=input_ids, attention_mask=valid.long(), use_cache=False)
        if out is None:
            self._captured.clear()
            return 0
        # Row indices of the valid tokens in [B*L], row-major over (sequence, position): the
        # packed order. Computed once (one device sync) and reused for every captured layer.
        rows = valid.reshape(-1).nonzero().squeeze(1)  # [T]
        num_tokens = rows.numel()
        hidden = self.hidden_size
        for j, layer_id in enumerate(self.layer_ids):
            flat = self._captured[layer_id].reshape(batch * padded, hidden)  # [B*L, H]
            out[:num_tokens, j * hidden:(j + 1) * hidden] = flat.index_select(0, rows.to(flat.device))
        self._captured.clear()
        return num_tokens
