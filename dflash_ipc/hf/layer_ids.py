"""Which target layers feed the drafter: the paper's spacing, and what looks wrong for a target.

    default_target_layer_ids(36, 5)            # [1, 9, 17, 25, 33]
    captured_layer_ids(4, 2)                   # [1, 2]: made distinct for a shallow target
"""

from __future__ import annotations

from dflash_ipc.errors import ConfigError


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Target layers whose outputs feed the drafter: ``round(1 + i*(L-4)/(n-1))``.

    ``[1, 9, 17, 25, 33]`` for L=36, n=5. A single draft layer takes the middle layer
    (SGLang's rule). Ids are 0-based; the feature is the output AFTER that layer.
    """
    if num_target_layers < 1 or num_draft_layers < 1:
        raise ConfigError(
            f"num_target_layers={num_target_layers} and num_draft_layers={num_draft_layers} must be >= 1"
        )
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    if num_target_layers < 4:
        raise ConfigError(f"num_target_layers={num_target_layers}: the default layer choice needs >= 4")
    span = num_target_layers - 4
    return [int(round(1 + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)]


def _spread(low: int, high: int, n: int) -> list[int]:
    return [int(round(low + i * (high - low) / (n - 1))) for i in range(n)]


def captured_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The paper's layer choice (`default_target_layer_ids`), made distinct for shallow targets.

    The paper spreads n ids over layers 1..L-3; a target with fewer than n+3 layers gives
    repeated ids there, so the spread widens to 1..L-2, then 0..L-2, then 0..L-1 (the last
    layer only when nothing else is left: a 4-layer target and a 2-layer drafter: [1, 2]).
    """
    if num_draft_layers > num_target_layers:
        raise ConfigError(f"model.num_layers={num_draft_layers}: cannot choose that many distinct captured layers "
                          f"from a {num_target_layers}-layer target; set model.target_layer_ids")
    if num_draft_layers == 1 or num_target_layers >= num_draft_layers + 3:
        return default_target_layer_ids(num_target_layers, num_draft_layers)
    for low, high in ((1, num_target_layers - 2), (0, num_target_layers - 2), (0, num_target_layers - 1)):
        if high - low + 1 >= num_draft_layers:
            return _spread(low, high, num_draft_layers)
    raise AssertionError("unreachable: n <= L always fits 0..L-1")


def layer_id_warnings(ids: list[int], num_target_layers: int, num_draft_layers: int) -> list[str]:
    """Why given `model.target_layer_ids` look wrong for an L-layer target (empty: they look fine)."""
    L = num_target_layers
    try:
        paper = captured_layer_ids(L, num_draft_layers)
        hint = f"the paper's choice for {L} layers and {num_draft_layers} drafter layers is {paper}"
    except ConfigError:  # more drafter layers than target layers: given ids are the only choice
        hint = f"the target has {L} layers"
    out = []
    if L >= 8 and max(ids) < L // 2:
        out.append(f"model.target_layer_ids={ids} all lie in the first half of the target's {L} layers "
                   f"(ids written for a smaller target?); {hint}")
    if L - 1 in ids:
        out.append(f"model.target_layer_ids={ids} include the last layer {L - 1}: HF hidden_states[{L}] is taken "
                   "after the final norm there, while capture (and SGLang / vLLM) take its output before it; "
                   f"{hint}")
    if ids != sorted(ids):
        out.append(f"model.target_layer_ids={ids} are not increasing: features are concatenated in this order, "
                   "and a server reading them in increasing order would feed the drafter shuffled features")
    return out
