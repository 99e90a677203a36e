"""Learning-rate schedule: linear warmup, an optional stable phase, then linear / cosine / WSD decay."""

from __future__ import annotations

import math

import torch


def lr_factor(step: int, total_steps: int, warmup_steps: int, decay_type: str, decay_ratio: float,
              min_lr_factor: float) -> float:
    """Multiplier of the peak LR for optimizer step `step` (1-based: the first step uses step=1).

    Warmup rises linearly to 1 over `warmup_steps`; the last `decay_ratio` of the remaining steps decay to
    `min_lr_factor` (linear, cosine, or WSD's linear cool-down); steps in between stay at the peak.
    """
    if step <= warmup_steps:
        return step / (warmup_steps + 1)
    post_warmup = max(total_steps - warmup_steps, 1)
    decay_steps = max(int(math.ceil(post_warmup * decay_ratio)), 1)
    stable_steps = post_warmup - decay_steps
    into_decay = step - warmup_steps - stable_steps
    if into_decay <= 0:
        return 1.0
    progress = min(into_decay / decay_steps, 1.0)
    if decay_type == "cosine":
        shape = 0.5 * (1 + math.cos(math.pi * progress))
    else:  # "linear" and "wsd" both cool down linearly; wsd's default decay_ratio is what makes it WSD
        shape = 1 - progress
    return min_lr_factor + (1 - min_lr_factor) * shape


def build_lr_scheduler(optimizer: torch.optim.Optimizer, cfg, total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR over `lr_factor`; `cfg` is the `[lr_scheduler]` section. Its state is checkpointable."""

    def factor(last_epoch: int) -> float:
        # LambdaLR calls with 0 at construction (the LR of step 1) and k after k scheduler steps
        return lr_factor(last_epoch + 1, total_steps, cfg.warmup_steps, cfg.decay_type, cfg.decay_ratio,
                         cfg.min_lr_factor)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
