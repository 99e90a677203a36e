"""Language-model loss: summed cross-entropy over valid label tokens.

The trainer divides the sum by the number of valid tokens in the *global* batch (all data-parallel ranks and all
gradient-accumulation microbatches), so every token weighs the same whatever the layout.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of token cross-entropies in fp32; labels equal to IGNORE_INDEX do not count."""
    return F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten(), ignore_index=IGNORE_INDEX,
                           reduction="sum")


def count_valid_tokens(labels: torch.Tensor) -> torch.Tensor:
    """Number of labels that contribute to the loss (int64 scalar tensor on the labels' device)."""
    return (labels != IGNORE_INDEX).sum()
