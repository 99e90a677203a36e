"""AdamW over all model parts, with fp32 master weights and state."""

from __future__ import annotations

import torch
from torch import nn


def build_optimizer(model_parts: list[nn.Module], cfg) -> torch.optim.Optimizer:
    """AdamW over the parameters of every model part; `cfg` is the `[optimizer]` section."""
    params = [p for part in model_parts for p in part.parameters() if p.requires_grad]
    impl = {"foreach": dict(foreach=True), "for-loop": dict(foreach=False), "fused": dict(fused=True)}
    return torch.optim.AdamW(params, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                             weight_decay=cfg.weight_decay, **impl[cfg.implementation])
