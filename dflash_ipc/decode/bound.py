"""The weight-bandwidth bound of decoding: how fast the steps run could have been, at best.

A decode step reads every weight of the model once (the input embedding excepted: a lookup
reads one row per token) and, in attention, the cached K/V of the key span of every row. At
``hbm`` bytes/s, ``steps`` steps cannot take less than

    weights:        steps x weight_bytes / hbm
    weights + KV:   (steps x weight_bytes + positions read x kv_bytes_per_token) / hbm

so the bound in tokens/s is tokens / that time (= batch x hbm / bytes per step), and a run's
ratio to the bound is that time over its wall time. The benches print both.
"""

from __future__ import annotations

from dataclasses import dataclass

H200_HBM_BYTES_PER_S = 4.8e12
"""H200 HBM3e, NVIDIA's figure (the bound where the GPU is not one of HBM_TBPS; --hbm-tbps sets another)."""
HBM_TBPS = (("GH200", None), ("H200", 4.8), ("H100 NVL", 3.9), ("H100 PCIe", 2.0), ("H100", 3.35))
"""NVIDIA's memory bandwidth figures (TB/s) by a part of the device name, first match (an
"NVIDIA H100 80GB HBM3" is the SXM part); None: a name whose parts differ in bandwidth (a GH200
of HBM3 or HBM3e), taken as an unknown GPU."""


def hbm_tbps(device, given: float | None = None) -> float:
    """``given``, else the bandwidth of CUDA ``device`` (HBM_TBPS), else the H200's (an unknown
    GPU: pass its figure, --hbm-tbps)."""
    if given is not None:
        return given
    import torch
    dev = torch.device(device)
    if dev.type == "cuda" and torch.cuda.is_available():
        name = torch.cuda.get_device_name(dev)
        for part, tbps in HBM_TBPS:
            if part in name:
                if tbps is None:
                    break
                return tbps
    return H200_HBM_BYTES_PER_S / 1e12


def weight_bytes(model) -> int:
    """Bytes of the weights a decode step reads: every parameter but an input embedding that is
    not also the LM head (tied weights are read as the head)."""
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    skip = embed.weight if embed is not None and (head is None or head.weight is not embed.weight) else None
    seen, total = set(), 0
    for p in model.parameters():
        if id(p) in seen or p is skip:
            continue
        seen.add(id(p))
        total += p.numel() * p.element_size()
    return total


@dataclass(frozen=True, slots=True)
class Bound:
    """A run measured against the bound."""

    tokens: int
    seconds: float
    weights_s: float
    """Least time of its steps reading the weights alone."""
    with_kv_s: float | None
    """Least time reading the weights and the K/V attended (None: positions not counted)."""

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else float("nan")

    @property
    def bound_tokens_per_s(self) -> float:
        return self.tokens / self.weights_s if self.weights_s > 0 else float("nan")

    @property
    def ratio(self) -> float:
        """Measured tok/s over the weights-only bound."""
        return self.weights_s / self.seconds if self.seconds > 0 else float("nan")

    @property
    def ratio_with_kv(self) -> float | None:
        if self.with_kv_s is None or self.seconds <= 0:
            return None
        return self.with_kv_s / self.seconds


def bound(*, tokens: int, seconds: float, steps: int, weight_bytes: int, hbm_bytes_per_s: float,
          kv_positions_read: int | None = None, kv_bytes_per_token: int = 0) -> Bound:
    """See the module docstring."""
    weights_s = steps * weight_bytes / hbm_bytes_per_s
    with_kv = None
    if kv_positions_read is not None:
        with_kv = weights_s + kv_positions_read * kv_bytes_per_token / hbm_bytes_per_s
    return Bound(tokens=tokens, seconds=seconds, weights_s=weights_s, with_kv_s=with_kv)
