"""A DFlash drafter for plain transformers: `modeling_dflash.py` of a `dflash-ipc export --with-code`.

    import torch
    from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer
    draft = AutoModel.from_pretrained(DRAFTER_DIR, trust_remote_code=True, dtype=torch.bfloat16).eval()
    target = AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.bfloat16).eval()
    tok = AutoTokenizer.from_pretrained(TARGET)
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    out = draft.spec_generate(target, ids, max_new_tokens=256, stop_token_ids=[tok.eos_token_id])
    print(tok.decode(out[0, ids.shape[1]:]), draft.last_stats["tau"])

This file needs torch and transformers only (it is copied, as is, next to config.json and
model.safetensors). Its math is dflash-ipc's drafter (`dflash_ipc/drafter/model.py`) for one
block, op for op, so it drafts exactly what `dflash-ipc eval` drafts:

    ctx = hidden_norm(fc(concat of the target layers' outputs))       [s, H]
    h   = target_embed([x[s], MASK x (bs-1)]) at positions s..s+bs-1  [bs, H]
    per layer: q = rope(q_norm(q_proj(norm(h)))); k = rope(k_norm(k_proj([ctx; norm(h)])));
               v = v_proj([ctx; norm(h)]); h += o_proj(attention(q, k, v)); h += mlp(norm(h))
    drafts = argmax(target_lm_head(norm(h)[1:]))

A full_attention layer's block sees the whole context and its whole block; a layer that
config.json's `layer_types` calls sliding_attention sees key j from query i only if
0 <= i - j < sliding_window (causal and windowed, on absolute positions), as SGLang and vLLM
run it.

`spec_generate` is greedy speculative decoding: draft a block from the features of every
committed position, verify it with one target forward, commit the longest matching prefix
plus the target's own next token. Its output is the target's greedy output (up to
floating-point ties). There is no drafter KV cache: each block attends to the features of
the whole prefix, which costs more drafter compute on long outputs and keeps the result
identical to the trainer's layout.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import DynamicCache, PreTrainedModel, Qwen3Config


def _normalize(x: Tensor, eps: float) -> Tensor:
    xf = x.float()  # statistics in float32, the result in x's dtype
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """RoPE ("rotate_half" layout) of x [N, heads, D] by per-token cos/sin [N, D]."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos[:, None, :].to(x.dtype) + torch.cat([-x2, x1], dim=-1) * sin[:, None, :].to(x.dtype)


class DFlashRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return (self.weight * _normalize(x, self.eps)).to(x.dtype)


class DFlashAttention(nn.Module):
    def __init__(self, config, layer_type: str = "full_attention") -> None:
        super().__init__()
        if layer_type not in ("full_attention", "sliding_attention"):
            raise ValueError(f"layer type {layer_type!r}: this drafter has full_attention and sliding_attention layers")
        self.window = int(config.sliding_window) if layer_type == "sliding_attention" else None
        if layer_type == "sliding_attention" and (self.window is None or self.window < 1):
            raise ValueError(f"a sliding_attention layer needs sliding_window >= 1 (use_sliding_window: true), "
                             f"got {config.sliding_window!r}")
        h, d = config.hidden_size, config.head_dim
        self.heads, self.kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, d
        self.q_proj = nn.Linear(h, self.heads * d, bias=False)
        self.k_proj = nn.Linear(h, self.kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, self.kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.heads * d, h, bias=False)
        self.q_norm = DFlashRMSNorm(d, config.rms_norm_eps)
        self.k_norm = DFlashRMSNorm(d, config.rms_norm_eps)

    def forward(self, x: Tensor, ctx: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """x [Q, H] the normed block, ctx [T, H]; cos/sin [T+Q, D], context rows first."""
        nq, nt = x.shape[0], ctx.shape[0]
        q = self.q_proj(x).view(nq, self.heads, self.head_dim)
        q = _rotate(self.q_norm.weight * _normalize(q, self.q_norm.eps), cos[nt:], sin[nt:]).to(q.dtype)
        k = torch.cat([self.k_proj(ctx), self.k_proj(x)]).view(nt + nq, self.kv_heads, self.head_dim)
        k = _rotate(self.k_norm.weight * _normalize(k, self.k_norm.eps), cos, sin).to(k.dtype)
        v = torch.cat([self.v_proj(ctx), self.v_proj(x)]).view(nt + nq, self.kv_heads, self.head_dim)
        q, k = q.to(v.dtype), k.to(v.dtype)
        # One block sees every context key and its own keys. The all-true mask is passed on
        # purpose: the same kernel as the trainer's dense path, hence the same numbers.
        visible = torch.ones(nq, nt + nq, dtype=torch.bool, device=x.device)
        if self.window is not None:  # query i = nt + row, key j = its index: 0 <= i - j < window
            distance = (nt + torch.arange(nq, device=x.device))[:, None] - torch.arange(nt + nq, device=x.device)
            visible = (distance >= 0) & (distance < self.window)
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                             v.transpose(0, 1)[None], attn_mask=visible,
                                             scale=self.head_dim ** -0.5, enable_gqa=self.heads != self.kv_heads)
        return self.o_proj(out[0].transpose(0, 1).reshape(nq, self.heads * self.head_dim))


class DFlashMLP(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config, layer_type: str = "full_attention") -> None:
        super().__init__()
        self.self_attn = DFlashAttention(config, layer_type)
        self.mlp = DFlashMLP(config)
        self.input_layernorm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, h: Tensor, ctx: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        h = h + self.self_attn(self.input_layernorm(h), ctx, cos, sin)
        return h + self.mlp(self.post_attention_layernorm(h))


def _rope_parameters(config) -> dict:
    """{"rope_type", "rope_theta", scaling keys...} from a transformers 5.x or 4.x config."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and isinstance(params.get("full_attention"), dict):
        params = params["full_attention"]
    if isinstance(params, dict) and "rope_theta" in params:
        return {"rope_type": "default", **params}
    scaling = dict(getattr(config, "rope_scaling", None) or {})
    return {"rope_type": scaling.pop("rope_type", scaling.pop("type", "default")),
            "rope_theta": float(getattr(config, "rope_theta", 1e6)), **scaling}


class DFlashDraftModel(PreTrainedModel):
    """The drafter; parameter names are the checkpoint's (`fc.weight`, `layers.0.self_attn.q_proj.weight`, ...)."""

    config_class = Qwen3Config
    base_model_prefix = "dflash"
    _no_split_modules = ["DFlashDecoderLayer"]

    def __init__(self, config) -> None:
        super().__init__(config)
        dflash = getattr(config, "dflash_config", None) or {}
        self.block_size = int(dflash.get("block_size", getattr(config, "block_size", 16)))
        self.mask_token_id = int(dflash["mask_token_id"])
        self.target_layer_ids = [int(i) for i in dflash["target_layer_ids"]]
        h = config.hidden_size
        self.fc = nn.Linear(len(self.target_layer_ids) * h, h, bias=False)
        self.hidden_norm = DFlashRMSNorm(h, config.rms_norm_eps)
        kinds = list(getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers)
        self.layers = nn.ModuleList(DFlashDecoderLayer(config, kind) for kind in kinds[:config.num_hidden_layers])
        self.norm = DFlashRMSNorm(h, config.rms_norm_eps)
        self._inv_freq: dict[torch.device, tuple[Tensor, float]] = {}  # float32 always: not a buffer
        self.last_stats: dict | None = None
        """What the latest `spec_generate` did: tau, acceptance lengths, forwards."""
        self.post_init()

    def _rope(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """cos, sin float32 [N, head_dim] of absolute positions [N]."""
        if positions.device not in self._inv_freq:
            params = _rope_parameters(self.config)
            if params["rope_type"] == "default":
                dim = self.config.head_dim
                exponent = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
                inv, scale = 1.0 / (params["rope_theta"] ** exponent), 1.0
            else:
                from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
                inv, scale = ROPE_INIT_FUNCTIONS[params["rope_type"]](self.config, torch.device("cpu"))
            self._inv_freq[positions.device] = (inv.float().to(positions.device), float(scale))
        inv, scale = self._inv_freq[positions.device]
        freqs = positions.float()[:, None] * inv[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos() * scale, emb.sin() * scale

    def forward(self, features: Tensor, block_embeds: Tensor) -> Tensor:
        """One block after a context: features [s, K*H] of positions 0..s-1 (the target layers'
        outputs, concatenated), block_embeds [bs, H] at positions s..s+bs-1 -> hidden [bs, H]."""
        s, bs, weight = features.shape[0], block_embeds.shape[0], self.fc.weight
        ctx = self.hidden_norm(self.fc(features.to(device=weight.device, dtype=weight.dtype)))
        cos, sin = self._rope(torch.arange(s + bs, device=weight.device))
        h = block_embeds.to(device=weight.device, dtype=weight.dtype)
        for layer in self.layers:
            h = layer(h, ctx, cos, sin)
        return self.norm(h)

    @torch.inference_mode()
    def spec_generate(self, target, input_ids: Tensor, max_new_tokens: int, stop_token_ids=None,
                      temperature: float = 0.0, return_stats: bool = False):
        """Greedy speculative decoding of one prompt with `target` (an HF causal LM).

        input_ids [1, P] (or [P]), or a tokenizer's output holding them (`apply_chat_template`
        returns a BatchEncoding in transformers 5); stop_token_ids default to the target's eos ids. Returns the
        prompt and the new tokens, [1, P + N]; with `return_stats`, (ids, stats). `last_stats`
        keeps the stats: tau (committed tokens per verification forward), acceptance_lengths
        (committed per cycle), acceptance_per_position (block positions 1..bs-1), target_forwards.
        """
        if temperature != 0.0:
            raise ValueError(f"temperature={temperature}: this drafter's spec_generate decodes greedily only")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
        if not isinstance(input_ids, Tensor) and "input_ids" in input_ids:  # BatchEncoding, dict
            input_ids = input_ids["input_ids"]
        prompt = torch.as_tensor(input_ids).reshape(-1).to(torch.long)
        stops = set(_stop_ids(target) if stop_token_ids is None else (int(t) for t in stop_token_ids))
        with _Verifier(target, self.target_layer_ids) as verifier:
            ids, self.last_stats = self._decode(verifier, prompt, max_new_tokens, stops)
        return (ids, self.last_stats) if return_stats else ids

    def _decode(self, verifier: "_Verifier", prompt: Tensor, max_new_tokens: int, stops: set[int]):
        embed, head = verifier.target.get_input_embeddings().weight, verifier.target.get_output_embeddings().weight
        first, features = verifier.prefill(prompt)
        out, lengths = [first], []
        drafted_at, accepted_at = [0] * (self.block_size - 1), [0] * (self.block_size - 1)
        while len(out) < max_new_tokens and out[-1] not in stops:
            remaining = max_new_tokens - len(out)
            block = torch.full((self.block_size,), self.mask_token_id, dtype=torch.long, device=embed.device)
            block[0] = out[-1]
            hidden = self(features, F.embedding(block, embed))  # [bs, H]
            logits = F.linear(hidden[1:].to(device=head.device, dtype=head.dtype), head)  # [bs-1, V]
            drafted = logits.argmax(-1)[:min(self.block_size - 1, remaining)]
            target_next, block_features = verifier.extend(torch.cat([block[:1], drafted]))  # [d+1], [d+1, K*H]
            accepted = int((drafted.cpu() == target_next[:-1].cpu()).long().cumprod(0).sum())
            tokens = (drafted[:accepted].tolist() + [int(target_next[accepted])])[:remaining]
            tokens = tokens[:next((i + 1 for i, t in enumerate(tokens) if t in stops), len(tokens))]
            for k in range(len(drafted)):
                drafted_at[k] += 1
                accepted_at[k] += k < accepted
            # Keep the features and cache of the positions the committed tokens were verified at.
            features = torch.cat([features, block_features[:len(tokens)]])
            verifier.truncate(prompt.numel() + len(out) - 1 + len(tokens))
            out += tokens
            lengths.append(len(tokens))
        stats = {"tau": sum(lengths) / len(lengths) if lengths else float("nan"), "acceptance_lengths": lengths,
                 "acceptance_per_position": [a / d if d else float("nan") for a, d in zip(accepted_at, drafted_at)],
                 "target_forwards": 1 + len(lengths)}
        return torch.cat([prompt.to(verifier.device), torch.tensor(out, device=verifier.device)])[None], stats


def _stop_ids(target) -> list[int]:
    ids: list[int] = []
    for cfg in (getattr(target, "generation_config", None), target.config):
        eos = getattr(cfg, "eos_token_id", None)
        ids += [eos] if isinstance(eos, int) else list(eos or [])
    return ids


class _Verifier:
    """The target with a KV cache and forward hooks on the captured layers (their outputs
    are HF `hidden_states[id + 1]`; hooks also give the last layer before the final norm)."""

    def __init__(self, target, layer_ids: list[int]) -> None:
        self.target, self.layer_ids = target, layer_ids
        self.device = target.get_input_embeddings().weight.device
        params = inspect.signature(target.forward).parameters
        self.cache_kw = "cache" if "cache" in params else "past_key_values"  # transformers 5.x renamed it
        self.cache = DynamicCache()
        self.captured: dict[int, Tensor] = {}
        self.hooks = []

    def __enter__(self) -> "_Verifier":
        layers = self.target.get_decoder().layers
        self.hooks = [layers[i].register_forward_hook(self._keep(i)) for i in self.layer_ids]
        return self

    def __exit__(self, *exc) -> None:
        for hook in self.hooks:
            hook.remove()

    def _keep(self, layer_id: int):
        def hook(module, args, output):
            self.captured[layer_id] = output[0] if isinstance(output, tuple) else output
        return hook

    def _forward(self, ids: Tensor, **kwargs) -> tuple[Tensor, Tensor]:
        try:
            out = self.target(input_ids=ids.to(self.device).reshape(1, -1), use_cache=True,
                              **{self.cache_kw: self.cache}, **kwargs)
            features = torch.cat([self.captured[i][0] for i in self.layer_ids], dim=-1)
        finally:
            self.captured.clear()
        return out.logits[0], features

    def prefill(self, prompt: Tensor) -> tuple[int, Tensor]:
        logits, features = self._forward(prompt, logits_to_keep=1)
        return int(logits[-1].argmax()), features

    def extend(self, ids: Tensor) -> tuple[Tensor, Tensor]:
        logits, features = self._forward(ids)
        return logits.argmax(-1), features

    def truncate(self, length: int) -> None:
        remove = self.cache.get_seq_length() - length
        if remove > 0:
            self.cache.crop(-remove)
