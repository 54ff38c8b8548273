"""How SGLang and vLLM turn a DFlash drafter's config, as transformers loads it, into the
attention of each layer: their rules restated (file and line of each in
dflash_ipc/drafter/inference_format.py), so that a test can check an export means at serving
what it meant in training. Only the config keys a dflash-ipc export could carry are covered."""

SLIDING = "sliding_attention"
FULL = "full_attention"


def sglang_layers(config) -> list[tuple[int, bool]]:
    """(window_left, causal) of each RadixAttention SGLang builds: window_left is -1 for no
    window, sliding_window - 1 otherwise (SGLang counts the keys left of the query)."""
    kinds = config.layer_types
    assert kinds is not None and len(kinds) == config.num_hidden_layers
    forced = getattr(config, "is_causal", None)  # overrides every layer's causality
    out = []
    for kind in kinds:
        if kind not in (SLIDING, FULL):
            raise ValueError(f"SGLang: unsupported DFlash layer type {kind!r}")
        window_left = -1
        if kind == SLIDING:
            if config.sliding_window is None:
                raise ValueError("SGLang: sliding_attention layers require config.sliding_window")
            window_left = int(config.sliding_window) - 1
        out.append((window_left, kind == SLIDING if forced is None else bool(forced)))
    return out


def vllm_layers(config) -> list[tuple[int | None, bool]]:
    """(sliding_window, causal) of each attention vLLM's DFlashQwen3 model builds."""
    dflash = getattr(config, "dflash_config", None) or {}
    kinds = config.layer_types
    assert kinds is not None and len(kinds) == config.num_hidden_layers
    every_layer_slides = bool(dflash.get("use_swa", False)) and SLIDING not in kinds
    forced = getattr(config, "is_causal", None)
    if forced is None:
        forced = dflash.get("causal")
    out = []
    for kind in kinds:
        slides = every_layer_slides or kind == SLIDING
        window = dflash.get("swa_window_size", config.sliding_window) if slides else None
        if slides and window is None:
            raise ValueError("vLLM: DFlash sliding attention requires a window size")
        out.append((window, kind == SLIDING if forced is None else bool(forced)))
    return out


def trained_layers(layer_types: list[str], window: int | None) -> list[tuple[int | None, bool]]:
    """(window, causal in the block) of each layer as dflash-ipc trains it (drafter/attention.py)."""
    return [(window, True) if kind == SLIDING else (None, False) for kind in layer_types]
