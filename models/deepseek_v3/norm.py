"""RMSNorm that keeps torch's fused kernel under autocast."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.RMSNorm):
    """`nn.RMSNorm` whose weight takes the input's dtype, as autocast does for a linear layer's weight.

    Under autocast MLA's latents come out of bf16 linears and meet the fp32 norm weight; torch's fused rms_norm
    kernel (CUDA) needs one dtype for both, so mixed dtypes fall back to the decomposed ops with a warning. With
    the weight cast the fused kernel runs (it computes the RMS in fp32 either way). Same parameters and state_dict
    as `nn.RMSNorm`; an fp32 input with an fp32 weight is unchanged.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if weight is not None and weight.dtype != x.dtype:
            weight = weight.to(x.dtype)
        return F.rms_norm(x, self.normalized_shape, weight, self.eps)
