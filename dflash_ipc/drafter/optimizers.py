"""The drafter's optimizer: AdamW for everything, or Muon for the hidden matrices.

`optimizer.name: muon` uses torch's own ``torch.optim.Muon`` (torch >= 2.9): momentum, then
the update orthogonalised by a Newton-Schulz iteration, for every trainable matrix of the
drafter: the decoder layers' q/k/v/o and gate/up/down projections and ``fc`` (the
projection of the concatenated target features). That is speculators' split (its DFlash
default optimizer: every 2-D parameter with both sides > 1 except embeddings and LM head,
which the drafter does not train: they are the target's). Muon is defined for matrices
only, so AdamW keeps the rest: the RMSNorm weights and anything 1-D or degenerate.

The two are one :class:`ChainedOptimizer`, a ``torch.optim.Optimizer`` whose param groups
are its parts' (Muon's first), so the LR scheduler scales both and the checkpoint
(training_state.py) stores one state dict, numbered as a single optimizer with several
param groups would number it. With ``muon_adjust_lr: match_rms_adamw`` torch scales each
matrix's step to AdamW's update RMS (0.2 * sqrt(max(A, B)), Moonshot's rule), so
optimizer.lr can serve both parts; ``muon_lr`` sets Muon's apart (speculators uses 10x the
AdamW rate). The scheduler scales both rates by the same factor.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import torch
from torch import nn

from dflash_ipc.config.schema import OptimizerConfig
from dflash_ipc.errors import ConfigError

logger = logging.getLogger(__name__)



def muon_class() -> type[torch.optim.Optimizer]:
    """``torch.optim.Muon``, or a ConfigError naming the torch that has it."""
    muon = getattr(torch.optim, "Muon", None)
    if muon is None:
        raise ConfigError(f"optimizer.name=muon needs torch.optim.Muon (torch >= 2.9); this torch is "
                          f"{torch.__version__}: upgrade torch or use optimizer.name=adamw")
    return muon


def split_parameters(model: nn.Module) -> tuple[list[tuple[str, nn.Parameter]], list[tuple[str, nn.Parameter]]]:
    """(Muon's, AdamW's) trainable (name, parameter) pairs, in ``named_parameters`` order.

    Muon's: every matrix (2-D, both sides > 1: a [1, N] row orthogonalises to nothing useful).
    Everything else (norms, any 1-D or degenerate tensor) is AdamW's.
    """
    muon, adamw = [], []
    for name, param in model.named_parameters():
        if param.requires_grad:
            (muon if param.ndim == 2 and min(param.shape) > 1 else adamw).append((name, param))
    return muon, adamw


class ChainedOptimizer(torch.optim.Optimizer):
    """Several optimizers over disjoint parameters, stepped together, seen as one.

    ``param_groups`` is the list of the parts' groups (the same dicts, so a scheduler's
    writes reach the parts); ``state_dict`` numbers the parameters across the parts in
    that order, the format of one optimizer with several groups.
    """

    def __init__(self, parts: list[torch.optim.Optimizer]) -> None:
        if not parts:
            raise ValueError("ChainedOptimizer needs at least one optimizer")
        params = [p for part in parts for group in part.param_groups for p in group["params"]]
        super().__init__(params, {})  # the base's bookkeeping (hooks, duplicate check)
        self.parts = parts
        self._share_groups()

    def _share_groups(self) -> None:
        self.param_groups = [group for part in self.parts for group in part.param_groups]
        self.state = self.parts[0].state if len(self.parts) == 1 else _StateView(self.parts)

    @torch.no_grad()
    def step(self, closure=None):  # noqa: D102
        if closure is not None:
            raise ValueError("ChainedOptimizer.step takes no closure")
        for part in self.parts:
            part.step()

    def zero_grad(self, set_to_none: bool = True) -> None:  # noqa: D102
        for part in self.parts:
            part.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:  # noqa: D102
        state, groups, offset = {}, [], 0
        for part in self.parts:
            sd = part.state_dict()
            groups += [{**g, "params": [i + offset for i in g["params"]]} for g in sd["param_groups"]]
            state.update({i + offset: v for i, v in sd["state"].items()})
            offset += sum(len(g["params"]) for g in part.param_groups)
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:  # noqa: D102
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ValueError(f"state dict has {len(groups)} param groups, this optimizer {len(self.param_groups)}")
        first_group, offset = 0, 0
        for part in self.parts:
            mine = groups[first_group:first_group + len(part.param_groups)]
            count = sum(len(g["params"]) for g in part.param_groups)
            part.load_state_dict({
                "param_groups": [{**g, "params": [i - offset for i in g["params"]]} for g in mine],
                "state": {i - offset: v for i, v in state_dict["state"].items() if offset <= i < offset + count},
            })
            first_group += len(part.param_groups)
            offset += count
        self._share_groups()  # load_state_dict gave the parts new group dicts


class _StateView(Mapping):
    """A live, read-only view of the parts' per-parameter state (``optimizer.state[p]`` readers):
    a part's state made by a later step shows here too. Looked up with ``in`` first, since each
    part's state is a defaultdict that a plain lookup would fill with an empty entry."""

    def __init__(self, parts: list[torch.optim.Optimizer]) -> None:
        self.parts = parts

    def __getitem__(self, param):
        for part in self.parts:
            if param in part.state:
                return part.state[param]
        raise KeyError(param)

    def __iter__(self):
        return (p for part in self.parts for p in part.state)

    def __len__(self) -> int:
        return sum(len(part.state) for part in self.parts)


def build_optimizer(model: nn.Module, cfg: OptimizerConfig, device: torch.device) -> torch.optim.Optimizer:
    """The optimizer ``cfg.name`` asks for over the model's trainable parameters."""
    fused = device.type == "cuda"
    adamw_kw = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), weight_decay=cfg.weight_decay, fused=fused)
    if cfg.name == "adamw":
        return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], **adamw_kw)
    if cfg.name != "muon":
        raise ConfigError(f"optimizer.name: {cfg.name!r} not allowed; allowed: adamw, muon")
    muon_cls = muon_class()
    matrices, rest = split_parameters(model)
    if not matrices:
        raise ConfigError("optimizer.name=muon: the drafter has no matrices to give Muon")
    lr = cfg.muon_lr if cfg.muon_lr is not None else cfg.lr
    muon = muon_cls([p for _, p in matrices], lr=lr, weight_decay=cfg.muon_weight_decay,
                    momentum=cfg.muon_momentum, nesterov=True, adjust_lr_fn=cfg.muon_adjust_lr)
    parts = [muon] + ([torch.optim.AdamW([p for _, p in rest], **adamw_kw)] if rest else [])
    logger.info("optimizer: Muon for %d matrices (%.1fM), AdamW for %d other tensors (%.1fM)", len(matrices),
                sum(p.numel() for _, p in matrices) / 1e6, len(rest), sum(p.numel() for _, p in rest) / 1e6)
    return ChainedOptimizer(parts)
