"""The FP8 GEMMs: a linear and the routed experts' grouped GEMM with every input, forward and backward, quantised
to e4m3 by a recipe (`quantize.qdq_activation` / `qdq_weight`) and multiplied in the compute dtype.

The three GEMMs of a linear y = x W^T contract over different dimensions, so each quantises its operands along
its own K: forward x and W along in_features; dgrad dY along out_features and W^T (the same 128 x 128 blocks);
wgrad dY^T and x^T along the tokens (128 x 1 tiles of dY and x, as in the DeepSeek-V3 report). The dequantised
operands are multiplied with `mm` / `torch._grouped_mm`, which accumulate in fp32: the numerics of the recipe, not
its speed (docs/fp8.md). Rowwise linears are torchao's `Float8Linear` instead (`convert.py`).
"""

from __future__ import annotations

import torch
from torch import nn

from quantization.fp8.quantize import (BLOCK, dequantize_segments, qdq_activation, qdq_weight,
                                       quantize_segments)

__all__ = ["Fp8GroupedMM", "Fp8Linear", "fp8_grouped_mm"]


class _Fp8LinearFn(torch.autograd.Function):
    """y = x W^T with every GEMM input (forward, dgrad, wgrad) quantised to e4m3 by `recipe`.

    Saves the high-precision x and W (not their e4m3 copies) and quantises again in backward: a recompute, a
    second backward or FSDP's re-gathered W give the same e4m3 values bit for bit.
    """

    @staticmethod
    def forward(ctx, x_MK: torch.Tensor, w_NK: torch.Tensor, recipe: str) -> torch.Tensor:
        ctx.save_for_backward(x_MK, w_NK)
        ctx.recipe = recipe
        dtype = x_MK.dtype
        return qdq_activation(x_MK, recipe, dtype) @ qdq_weight(w_NK, recipe, dtype).t()

    @staticmethod
    def backward(ctx, dy_MN: torch.Tensor):
        x_MK, w_NK = ctx.saved_tensors
        recipe, dtype = ctx.recipe, x_MK.dtype
        dy_MN = dy_MN.to(dtype)
        dx = qdq_activation(dy_MN, recipe, dtype) @ qdq_weight(w_NK.t(), recipe, dtype).t()
        # weight gradient: contraction over the tokens, so both operands are tiled along them
        dw = qdq_activation(dy_MN.t(), recipe, dtype) @ qdq_activation(x_MK.t(), recipe, dtype).t()
        return dx, dw.to(w_NK.dtype), None


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a plain linear would compute in here: autocast's when it is on, else x's."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


class Fp8Linear(nn.Linear):
    """nn.Linear (no bias) whose GEMMs take e4m3 inputs quantised by the blockwise recipe.

    Holds the same `weight` Parameter as the linear it replaces (same name, same master weight); under autocast
    it computes in autocast's dtype like nn.Linear does.
    """

    recipe = "blockwise"

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "Fp8Linear":
        """Wrap `linear`'s weight (on whatever device it is, meta included) without copying it."""
        with torch.device("meta"):
            new = cls(linear.in_features, linear.out_features, bias=False)
        new.weight = linear.weight
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = _compute_dtype(x)
        x_MK = x.reshape(-1, x.shape[-1]).to(dtype)
        with torch.autocast(x.device.type, enabled=False):
            y = _Fp8LinearFn.apply(x_MK, self.weight.to(dtype), self.recipe)
        return y.view(*x.shape[:-1], -1)



def _segments(num_rows: int, offsets_E: torch.Tensor) -> torch.Tensor:
    """Group id of every row of a grouped layout; rows past the last offset get id E (an extra segment)."""
    return torch.bucketize(torch.arange(num_rows, device=offsets_E.device), offsets_E, right=True)


class _Fp8GroupedMMFn(torch.autograd.Function):
    """`torch._grouped_mm(x, w.transpose(-2, -1), offs)` with e4m3 inputs quantised by `recipe`.

    x_PK holds the rows of expert e in [offs[e-1], offs[e]), each group starting on a multiple of 128 rows, so
    the weight gradient's token tiles never straddle two experts, and P is a multiple of 128 (the rowwise weight
    gradient's transposed operands are then laid out as `_grouped_mm` requires); rows past offs[-1] come out as
    zeros and get a
    zero gradient (CPU `_grouped_mm` leaves them uninitialised). An expert with no rows gets a zero weight
    gradient.
    """

    @staticmethod
    def forward(ctx, x_PK: torch.Tensor, w_ENK: torch.Tensor, offs_E: torch.Tensor, recipe: str) -> torch.Tensor:
        ctx.save_for_backward(x_PK, w_ENK, offs_E)
        ctx.recipe = recipe
        dtype = x_PK.dtype
        y = torch._grouped_mm(qdq_activation(x_PK, recipe, dtype), qdq_weight(w_ENK, recipe, dtype).transpose(-2, -1),
                              offs=offs_E)
        return _zero_tail(y, offs_E)

    @staticmethod
    def backward(ctx, dy_PN: torch.Tensor):
        x_PK, w_ENK, offs_E = ctx.saved_tensors
        recipe, dtype = ctx.recipe, x_PK.dtype
        dy_PN = _zero_tail(dy_PN.to(dtype), offs_E)
        # dgrad contracts over N: W^T [E, K, N] is quantised along N (the same blocks as W for blockwise)
        w_EKN = qdq_weight(w_ENK.transpose(-2, -1), recipe, dtype)
        dx = torch._grouped_mm(qdq_activation(dy_PN, recipe, dtype), w_EKN.transpose(-2, -1), offs=offs_E)
        dy_NP, x_KP = dy_PN.t(), x_PK.t()
        if recipe == "blockwise":
            a, b = qdq_activation(dy_NP, recipe, dtype), qdq_activation(x_KP, recipe, dtype)
        else:
            # one scale per channel and expert: the contraction runs over each expert's rows only
            seg_P, E = _segments(x_PK.shape[0], offs_E), offs_E.shape[0]
            a, b = (dequantize_segments(*quantize_segments(t, seg_P, E + 1), seg_P, dtype) for t in (dy_NP, x_KP))
        dw = torch._grouped_mm(a, b.t(), offs=offs_E)
        counts_E = torch.diff(offs_E, prepend=offs_E.new_zeros(1))
        dw = torch.where((counts_E > 0)[:, None, None], dw, 0)
        return _zero_tail(dx, offs_E), dw.to(w_ENK.dtype), None, None


def _zero_tail(t_PX: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    valid_P1 = (torch.arange(t_PX.shape[0], device=t_PX.device) < offs_E[-1]).unsqueeze(-1)
    return torch.where(valid_P1, t_PX, 0)


def fp8_grouped_mm(x_PK: torch.Tensor, w_ENK: torch.Tensor, offs_E: torch.Tensor, recipe: str) -> torch.Tensor:
    """Rows of expert e times w[e]^T, in e4m3 by `recipe`, computed in x's dtype (autocast off inside).

    Groups must start on multiples of 128 rows, and the row count be one (pad with zero rows); see
    `_Fp8GroupedMMFn`.
    """
    with torch.autocast(x_PK.device.type, enabled=False):
        return _Fp8GroupedMMFn.apply(x_PK, w_ENK.to(x_PK.dtype), offs_E, recipe)


class Fp8GroupedMM:
    """`fp8_grouped_mm` with a fixed recipe, as the routed experts call it (`core.quantization.QuantizedGroupedMM`).

    Groups start on multiples of 128 rows, and the row count is one: the token tiles of the weight gradients'
    quantisation must not straddle two experts.
    """

    row_align = BLOCK

    def __init__(self, recipe: str):
        self.recipe = recipe

    def __call__(self, x_PK: torch.Tensor, w_ENK: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
        return fp8_grouped_mm(x_PK, w_ENK, offs_E, self.recipe)
