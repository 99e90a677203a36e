"""Learning-rate schedule: linear warmup, an optional stable phase, then linear / cosine / WSD decay."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from core.config import option


@dataclass
class LRSchedulerSection:
    """Learning-rate schedule: linear warmup, then an optional stable phase, then decay."""

    warmup_steps: int = option(2, ge=0)
    """Steps of linear warmup from near zero to the peak learning rate."""
    decay_type: str = option("linear", choices=["linear", "cosine", "wsd"])
    """Shape of the decay after warmup; wsd (warmup-stable-decay) holds the peak, then decays linearly."""
    decay_ratio: float = option(1.0, gt=0, le=1)
    """Fraction of the post-warmup steps spent decaying; with wsd the peak is held for the steps before."""
    min_lr_factor: float = option(0.0, ge=0, le=1)
    """Final learning rate as a fraction of the peak."""


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


_SHAPE_KEYS = ("warmup_steps", "decay_type", "decay_ratio", "min_lr_factor")
"""The `[lr_scheduler]` settings that shape the schedule (recorded in its state to report changes on resume)."""


class WarmupDecayLR(torch.optim.lr_scheduler.LambdaLR):
    """A LambdaLR over `lr_factor` whose checkpointed state is its position, not its learning rates.

    `cfg` is the `[lr_scheduler]` section. `state_dict()` holds the number of steps taken and, for the record, the
    settings that shape the schedule; `load_state_dict()` restores the position only and recomputes the LR from
    the current config, so a run resumed with another `training.steps` (or `lr_scheduler.*`, or `optimizer.lr`)
    follows the new schedule from its first step. `resume_changes` then lists what differs from the checkpoint.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, cfg, total_steps: int):
        def factor(last_epoch: int) -> float:
            # LambdaLR calls with 0 at construction (the LR of step 1) and k after k scheduler steps
            return lr_factor(last_epoch + 1, total_steps, cfg.warmup_steps, cfg.decay_type, cfg.decay_ratio,
                             cfg.min_lr_factor)

        super().__init__(optimizer, factor)
        self.settings = {"training.steps": total_steps, "optimizer.lr": self.base_lrs[0],
                         **{f"lr_scheduler.{k}": getattr(cfg, k) for k in _SHAPE_KEYS}}
        self.resume_changes: list[tuple[str, object, object]] = []

    def state_dict(self) -> dict:
        return {"last_epoch": self.last_epoch, "settings": dict(self.settings)}

    def load_state_dict(self, state_dict: dict) -> None:
        """Continue after `state_dict["last_epoch"]` steps with the LR of the current schedule at that point.

        The optimizer's param groups get that LR too: its own checkpoint holds the LR of the saved schedule.
        Also accepts the state of a plain LambdaLR (which records no settings).
        """
        self.last_epoch = int(state_dict["last_epoch"])
        self._step_count = self.last_epoch + 1  # as after that many step() calls (checked by LRScheduler.step)
        saved = state_dict.get("settings", {})
        self.resume_changes = [(k, saved[k], v) for k, v in self.settings.items() if k in saved and saved[k] != v]
        for group, base, lmbda in zip(self.optimizer.param_groups, self.base_lrs, self.lr_lambdas, strict=True):
            group["lr"] = base * lmbda(self.last_epoch)
        self._last_lr = [group["lr"] for group in self.optimizer.param_groups]


def build_lr_scheduler(optimizer: torch.optim.Optimizer, cfg, total_steps: int) -> WarmupDecayLR:
    """The schedule of `cfg` (the `[lr_scheduler]` section) over `total_steps` optimizer steps; checkpointable."""
    return WarmupDecayLR(optimizer, cfg, total_steps)
