"""What an export with sliding-window layers asks of the server that loads it: the lines
`dflash-ipc export` prints after writing it. Which config.json fields each loader reads, with
file and line: drafter/inference_format.py."""

from __future__ import annotations

from dflash_ipc.drafter.model import qwen2_max_window_layers


def _layers(indices: list[int]) -> str:
    return f"layer{'s' if len(indices) > 1 else ''} {', '.join(map(str, indices))}"


def sliding_layout_notes(config: dict) -> list[str]:
    """Lines for the config.json dict `config`; none when no layer slides."""
    layer_types = list(config.get("layer_types") or [])
    sliding = [i for i, kind in enumerate(layer_types) if kind == "sliding_attention"]
    if not sliding:
        return []
    full = [i for i, kind in enumerate(layer_types) if kind != "sliding_attention"]
    layout = f"{_layers(sliding)}: sliding window {config.get('sliding_window')} (causal in the block)"
    if full:
        layout += f"; {_layers(full)}: full attention"
    notes = [f"{layout}, in config.json's layer_types, use_sliding_window and sliding_window, which SGLang "
             f"and vLLM apply per layer"]
    if full:
        notes.append("vLLM serves a mix of sliding and full layers on its V2 model runner only (its default; "
                     "VLLM_USE_V2_MODEL_RUNNER=0 refuses this drafter)")
        # SGLang's flag trims the drafter's context for all layers at once (a compact draft
        # KV cache), so the full layers would no longer see what they saw in training.
        notes.append("SGLang: leave --speculative-draft-window-size unset; it shortens the context of every "
                     "drafter layer, the full ones too")
    if qwen2_max_window_layers(layer_types) is None:
        notes.append(f"max_window_layers is {config.get('max_window_layers')}: Qwen2's form (the last layers "
                     f"slide) cannot state this layout, so a loader that ignores layer_types would run every layer "
                     f"with full attention; SGLang, vLLM, z-lab's and this export's modeling code read layer_types")
    return notes
