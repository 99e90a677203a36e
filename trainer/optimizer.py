"""AdamW over all model parts, with fp32 master weights and state, optionally stepped in tiles.

Tiled step: torch's AdamW runs its multi-tensor (foreach) kernels once per parameter group, and the foreach
path allocates temporaries as large as the whole group (e.g. ``sqrt(exp_avg_sq)`` for every tensor of the group
at once). With a single group that is one extra copy of all parameters at the optimizer step, which is the
peak of a step whenever activations are small next to the weights (MoE: many large expert weights, small
batches). Splitting the parameters into groups of at most ``max_group_bytes`` caps that transient at one
group. The result is still a plain ``torch.optim.AdamW``: LR schedulers set ``lr`` on every group, and
``state_dict``/``load_state_dict``, DCP's ``get_optimizer_state_dict``/``set_optimizer_state_dict`` and
``zero_grad`` work unchanged. Same idea as DeepSpeed-MoE's ``max_group_size`` cap on expert parameter groups
(DeepSpeed PR #2079), measured here in ``benchmarks/tiled_optimizer.py`` and ``docs/memory.md``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from core.config import option


@dataclass
class OptimizerSection:
    """The optimizer and its hyperparameters."""

    name: str = option("AdamW", choices=["AdamW"])
    """Optimizer class."""
    lr: float = option(8e-4, gt=0)
    """Peak learning rate, reached at the end of warmup."""
    beta1: float = option(0.9, ge=0, lt=1)
    """Decay rate of the first-moment (mean) estimate."""
    beta2: float = option(0.95, ge=0, lt=1)
    """Decay rate of the second-moment (variance) estimate."""
    eps: float = option(1e-8, gt=0)
    """Added to the denominator for numerical stability."""
    weight_decay: float = option(0.1, ge=0)
    """Decoupled weight decay coefficient."""
    implementation: str = option("fused", choices=["foreach", "for-loop", "fused"])
    """Kernel strategy of the optimizer step: fused (one kernel per tensor, no step-wide temporaries; faster than
    foreach, see docs/performance.md), multi-tensor foreach, or one tensor at a time."""
    max_group_bytes: int = option(0, ge=0)
    """0 = step all parameters at once; >0 = tiled step over parameter groups of at most this many bytes,
    which caps the temporary memory of the foreach kernels (fused and for-loop have none to cap)."""


__all__ = ["build_optimizer", "local_nbytes", "tile_params"]


def local_nbytes(p: torch.Tensor) -> int:
    """Bytes of the part of ``p`` this rank holds (the local shard of a DTensor), which is what the step touches."""
    local = p.to_local() if isinstance(p, DTensor) else p
    return local.numel() * local.element_size()


def tile_params(params: list[torch.Tensor], max_group_bytes: int) -> list[list[torch.Tensor]]:
    """Split ``params`` in order into consecutive tiles of at most ``max_group_bytes`` local bytes each.

    A parameter larger than the limit gets a tile of its own (tensors are never split, so the step stays
    bit-identical to the untiled one). ``max_group_bytes <= 0`` returns one tile with everything.
    """
    if max_group_bytes <= 0:
        return [list(params)] if params else []
    tiles: list[list[torch.Tensor]] = []
    current: list[torch.Tensor] = []
    current_bytes = 0
    for p in params:
        nbytes = local_nbytes(p)
        if current and current_bytes + nbytes > max_group_bytes:
            tiles.append(current)
            current, current_bytes = [], 0
        current.append(p)
        current_bytes += nbytes
    if current:
        tiles.append(current)
    return tiles


def build_optimizer(model_parts: list[nn.Module], cfg) -> torch.optim.Optimizer:
    """AdamW over the parameters of every model part; `cfg` is the `[optimizer]` section.

    With ``cfg.max_group_bytes > 0`` the parameters are split into groups of at most that many bytes (see the
    module docstring); every group has the same hyperparameters.
    """
    params = [p for part in model_parts for p in part.parameters() if p.requires_grad]
    impl = {"foreach": dict(foreach=True), "for-loop": dict(foreach=False), "fused": dict(fused=True)}
    groups = [{"params": tile} for tile in tile_params(params, cfg.max_group_bytes)]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                             weight_decay=cfg.weight_decay, **impl[cfg.implementation])
