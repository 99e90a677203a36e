"""The FP8 GEMMs: a linear and the routed experts' grouped GEMM with every input, forward and backward, quantised
to e4m3 by a recipe, on the kernel `kernels.py` chooses for each GEMM.

The three GEMMs of a linear y = x W^T contract over different dimensions, so each quantises its operands along
its own K: forward x and W along in_features; dgrad dY along out_features and W^T (the same 128 x 128 blocks);
wgrad dY^T and x^T along the tokens (128 x 1 tiles of dY and x, as in the DeepSeek-V3 report). The emulation
(the CPU path, and the reference the CUDA tests compare the real kernels with) multiplies the dequantised operands
with `mm` / `torch._grouped_mm`, which accumulate in fp32: the numerics of the recipe, not its speed (docs/fp8.md).
The real kernels (`scaled_gemms.py`) multiply the same e4m3 operands. Rowwise linears are torchao's `Float8Linear`
where it runs (`convert.py`), this module's emulation elsewhere.
"""

from __future__ import annotations

import torch
from torch import nn

from quantization.fp8.kernels import (DEEPGEMM, EMULATED, PER_EXPERT, ROWWISE_GROUPED, LinearKernels, Platform,
                                      blockwise_linear_kernels, grouped_kernel)
from quantization.fp8.fsdp_all_gather import Fp8WeightBlocks
from quantization.fp8.quantize import (BLOCK, WeightBlocks, dequantize_row_segments, dequantize_weight_blocks,
                                       qdq_activation, qdq_weight, quantize_row_segments, quantize_weight_blocks,
                                       row_segments)
from quantization.fp8.scaled_gemms import blockwise_grouped, blockwise_mm, rowwise_grouped_mm, rowwise_grouped_wgrad

__all__ = ["Fp8GroupedMM", "Fp8Linear", "fp8_grouped_mm"]

_EMULATED_LINEAR = LinearKernels(EMULATED, EMULATED, EMULATED)


def _keeps_weight(recipe: str, weight_cast: bool, w: torch.Tensor) -> bool:
    """Whether an FP8 GEMM saves its forward's quantised weight w for the dgrad: blockwise (W^T's 128 x 128 blocks
    are W's, transposed; rowwise scales W^T along the other dimension), whole blocks only (a padded block's
    dequantised weight is a slice of a larger buffer, which saving would hold), and the weight a copy cast to the
    compute dtype for this call (the `.to()` of fp32 parameters under autocast, without FSDP), which the saved e4m3
    (real kernels, 1 byte per element) or dequantised (emulation, the copy's bytes) weight replaces. A weight that is
    the parameter itself (FSDP2's bf16 parameters, an fp32 run) is saved as it is and quantised again in the
    backward: saving its quantised copy would hold a weight-sized tensor that FSDP frees after the forward
    (docs/fp8.md, "Memory")."""
    return recipe == "blockwise" and weight_cast and w.shape[-1] % BLOCK == 0 and w.shape[-2] % BLOCK == 0


def _weight_and_blocks(w: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, tuple]:
    """(the weight a GEMM function takes, its gathered blocks' (e4m3 values, scales) or (None, None)): w cast to the
    compute `dtype`, or, where FSDP gathered it as blocks, w itself (its gradient's owner) and its blocks (exact in
    any dtype)."""
    if isinstance(w, Fp8WeightBlocks):
        return w, (w.q, w.scale)
    return w.to(dtype), (None, None)


def _dgrad_weight(ctx, weight: list[torch.Tensor], recipe: str, dtype: torch.dtype, real: bool):
    """The dgrad's weight operand from what the forward saved (`weight`, `ctx.kept`, `ctx.gathered`): for the
    `real` kernels W^T's blocks (the saved blocks transposed where kept or gathered, else W^T quantised), for the
    emulation W^T dequantised in W's layout (the forward's dequantised W where kept, the gathered blocks
    dequantised, else W^T quantised along N and transposed back)."""
    if real:
        if ctx.kept or ctx.gathered:
            return WeightBlocks(*weight).transposed()
        return quantize_weight_blocks(weight[0].transpose(-2, -1))
    if ctx.gathered:
        return dequantize_weight_blocks(WeightBlocks(*weight), dtype)
    if ctx.kept:
        return weight[0]
    return qdq_weight(weight[0].transpose(-2, -1), recipe, dtype).transpose(-2, -1)


class _Fp8LinearFn(torch.autograd.Function):
    """y = x W^T with every GEMM input (forward, dgrad, wgrad) quantised to e4m3 by `recipe`, each GEMM on its
    kernel of `kernels` (default: all emulated); `weight_cast`: w is a copy cast for this call (`_keeps_weight`).

    Saves the high-precision x and quantises it again in backward: a recompute or a second backward give the same
    e4m3 values bit for bit. The weight: its forward's blockwise quantisation where `_keeps_weight`, for the dgrad
    (the real kernels take W^T's blocks as a transposed copy of the e4m3 values; the emulation multiplies the same
    dequantised weight), else the high-precision W, quantised again in backward (FSDP's re-gathered W gives the
    same bits). Where FSDP gathered w as blocks (`fsdp_all_gather.Fp8WeightBlocks`), their e4m3 values `w_q` and
    scales `w_scale` come as inputs of their own (torch.compile traces no tensor attribute of a tensor made in its
    graph inside a Function): both GEMMs multiply them, and the backward holds them as FSDP gathers them again.
    """

    @staticmethod
    def forward(ctx, x_MK: torch.Tensor, w_NK: torch.Tensor, recipe: str,
                kernels: LinearKernels = _EMULATED_LINEAR, weight_cast: bool = False,
                w_q: torch.Tensor | None = None, w_scale: torch.Tensor | None = None) -> torch.Tensor:
        ctx.recipe, ctx.kernels, ctx.w_dtype = recipe, kernels, w_NK.dtype
        gathered = None if w_q is None else WeightBlocks(w_q, w_scale)
        ctx.gathered = gathered is not None
        # the forward and the dgrad share the weight's blocks only on kernels of one kind (`blockwise_linear_kernels`
        # gives both the same)
        ctx.kept = not ctx.gathered and _keeps_weight(recipe, weight_cast, w_NK) and \
            (kernels.fwd == EMULATED) == (kernels.dgrad == EMULATED)
        dtype = x_MK.dtype
        if kernels.fwd != EMULATED:
            w_blocks = gathered if ctx.gathered else quantize_weight_blocks(w_NK)
            y, weight = blockwise_mm(x_MK, w_blocks), w_blocks
        else:
            x_q = qdq_activation(x_MK, recipe, dtype)
            w_dq = dequantize_weight_blocks(gathered, dtype) if ctx.gathered else qdq_weight(w_NK, recipe, dtype)
            y, weight = x_q @ w_dq.t(), (w_dq,)
        ctx.save_for_backward(x_MK, *(gathered if ctx.gathered else weight if ctx.kept else (w_NK,)))
        return y

    @staticmethod
    def backward(ctx, dy_MN: torch.Tensor):
        x_MK, *weight = ctx.saved_tensors
        recipe, dtype, kernels = ctx.recipe, x_MK.dtype, ctx.kernels
        dy_MN = dy_MN.to(dtype)
        if kernels.dgrad != EMULATED:
            dx = blockwise_mm(dy_MN, _dgrad_weight(ctx, weight, recipe, dtype, real=True))
        else:
            dy_q = qdq_activation(dy_MN, recipe, dtype)
            w_dq = _dgrad_weight(ctx, weight, recipe, dtype, real=False)
            dx = dy_q @ w_dq
            del dy_q, w_dq
        # weight gradient: contraction over the tokens, so both operands are tiled along them
        if kernels.wgrad != EMULATED:
            dw = blockwise_mm(dy_MN.t(), x_MK.t())
        else:
            dw = qdq_activation(dy_MN.t(), recipe, dtype) @ qdq_activation(x_MK.t(), recipe, dtype).t()
        return dx, dw.to(ctx.w_dtype), None, None, None, None, None


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a plain linear would compute in here: autocast's when it is on, else x's."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


#: a tensor not on the device its module's kernels were chosen for (a CPU model on a GPU machine): no FP8 kernels
_ELSEWHERE = Platform("elsewhere")


def _platform(platform: Platform, x: torch.Tensor) -> Platform:
    return platform if x.device.type == platform.device else _ELSEWHERE


class Fp8Linear(nn.Linear):
    """nn.Linear (no bias) whose GEMMs take e4m3 inputs quantised by `recipe` (blockwise; rowwise where torchao's
    Float8Linear does not run), on the kernels `kernels.blockwise_linear_kernels` chooses for each call's shape
    (`kernels` = "emulated": always the emulation).

    Holds the same `weight` Parameter as the linear it replaces (same name, same master weight); under autocast
    it computes in autocast's dtype like nn.Linear does.
    """

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe: str = "blockwise", kernels: str = "auto",
                    platform: Platform | None = None) -> "Fp8Linear":
        """Wrap `linear`'s weight (on whatever device it is, meta included) without copying it; `platform`: the
        machine the kernels are chosen for (default: this one)."""
        with torch.device("meta"):
            new = cls(linear.in_features, linear.out_features, bias=False)
        new.weight = linear.weight
        new.recipe, new.kernels = recipe, kernels
        new.platform = Platform.detect() if platform is None else platform
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = _compute_dtype(x)
        x_MK = x.reshape(-1, x.shape[-1]).to(dtype)
        kernels = _EMULATED_LINEAR
        if self.recipe == "blockwise" and self.kernels != EMULATED:
            kernels = blockwise_linear_kernels(_platform(self.platform, x), dtype, x_MK.shape[0], self.in_features,
                                               self.out_features)
        weight, blocks = _weight_and_blocks(self.weight, dtype)
        with torch.autocast(x.device.type, enabled=False):
            y = _Fp8LinearFn.apply(x_MK, weight, self.recipe, kernels, self.weight.dtype != dtype, *blocks)
        return y.view(*x.shape[:-1], -1)


def _to_host(offs_E: torch.Tensor) -> torch.Tensor:
    """A copy of the group offsets on the host (a host sync from a GPU), for the per-expert loop; a copy from host
    memory too, so that a CPU run's graphs hold the same copy a GPU run's do (tests/test_fp8.py counts it)."""
    return offs_E.to("cpu", copy=True)


class _Fp8GroupedMMFn(torch.autograd.Function):
    """`torch._grouped_mm(x, w.transpose(-2, -1), offs)` with e4m3 inputs quantised by `recipe`, on `kernel`
    (emulated, `_scaled_grouped_mm` rowwise, or blockwise scaled_mm per expert) for all three GEMMs.

    x_PK holds the rows of expert e in [offs[e-1], offs[e]), each group starting and ending on a multiple of 128
    rows, so the weight gradient's token tiles never straddle two experts (nor the last expert and the rows past
    it), and P should be a multiple of 128 (the rowwise weight gradient's transposed operands are then laid out as
    `_grouped_mm` requires; the emulation pads other counts); rows past offs[-1] come out as zeros and get a zero
    gradient (CPU `_grouped_mm` leaves them uninitialised). An expert with no rows gets a zero weight gradient.
    The weights are saved as `_Fp8LinearFn` saves its weight (`weight_cast`, `_keeps_weight`).
    """

    @staticmethod
    def forward(ctx, x_PK: torch.Tensor, w_ENK: torch.Tensor, offs_E: torch.Tensor, recipe: str,
                kernel: str = EMULATED, host_offs_E: torch.Tensor | None = None,
                weight_cast: bool = False, w_q: torch.Tensor | None = None,
                w_scale: torch.Tensor | None = None) -> torch.Tensor:
        # the per-expert loop needs the group ends on the host: the caller's copy (one per MoE layer), else
        # copied here (a host sync), saved for the backward's two GEMMs (on an H200 a read per GEMM left the GPU
        # idle 43 ms of a 285 ms step)
        ends_E = offs_E
        if kernel == PER_EXPERT:
            ends_E = _to_host(offs_E) if host_offs_E is None else host_offs_E
        ctx.recipe, ctx.kernel, ctx.w_dtype = recipe, kernel, w_ENK.dtype
        gathered = None if w_q is None else WeightBlocks(w_q, w_scale)
        ctx.gathered = gathered is not None
        ctx.kept = not ctx.gathered and _keeps_weight(recipe, weight_cast, w_ENK) and kernel in (EMULATED, PER_EXPERT)
        dtype = x_PK.dtype
        weight = (w_ENK,)
        if kernel == ROWWISE_GROUPED:
            y = rowwise_grouped_mm(x_PK, w_ENK, offs_E)
        elif kernel == PER_EXPERT:
            w_blocks = gathered if ctx.gathered else quantize_weight_blocks(w_ENK)
            y, weight = blockwise_grouped(x_PK, w_blocks, offs_E, ends_E, "fwd"), w_blocks
        else:
            x_q = qdq_activation(x_PK, recipe, dtype)
            w_dq = dequantize_weight_blocks(gathered, dtype) if ctx.gathered else qdq_weight(w_ENK, recipe, dtype)
            y, weight = torch._grouped_mm(x_q, w_dq.transpose(-2, -1), offs=offs_E), (w_dq,)
            del x_q
        ctx.save_for_backward(x_PK, offs_E, ends_E, *(gathered if ctx.gathered else weight if ctx.kept else (w_ENK,)))
        return _zero_tail(y, offs_E)

    @staticmethod
    def backward(ctx, dy_PN: torch.Tensor):
        x_PK, offs_E, ends_E, *weight = ctx.saved_tensors
        recipe, dtype, kernel = ctx.recipe, x_PK.dtype, ctx.kernel
        dy_PN = _zero_tail(dy_PN.to(dtype), offs_E)
        if kernel == ROWWISE_GROUPED:
            dx = rowwise_grouped_mm(dy_PN, weight[0].transpose(-2, -1), offs_E)
            dw = rowwise_grouped_wgrad(dy_PN, x_PK, offs_E, row_segments(x_PK.shape[0], offs_E))
        elif kernel == PER_EXPERT:
            # W^T quantised on its own where not kept (the forward's quantisation of W, which the same ops here
            # would repeat, is what torch.compile's partitioner would then save for the backward instead)
            dx = blockwise_grouped(dy_PN, _dgrad_weight(ctx, weight, recipe, dtype, real=True), offs_E, ends_E,
                                   "dgrad")
            dw = blockwise_grouped(dy_PN, x_PK, offs_E, ends_E, "wgrad")
        else:
            # dgrad contracts over N: W^T [E, K, N] is quantised along N (the same blocks as W for blockwise)
            w_dq = _dgrad_weight(ctx, weight, recipe, dtype, real=False)
            dx = torch._grouped_mm(qdq_activation(dy_PN, recipe, dtype), w_dq, offs=offs_E)
            del w_dq
            if recipe == "blockwise":
                a, b = qdq_activation(dy_PN.t(), recipe, dtype), qdq_activation(x_PK.t(), recipe, dtype)
            else:
                # one scale per channel and expert: the contraction runs over each expert's rows only
                seg_P, E = row_segments(x_PK.shape[0], offs_E), offs_E.shape[0]
                a, b = (dequantize_row_segments(*quantize_row_segments(t, seg_P, E + 1), seg_P, dtype)
                        for t in (dy_PN, x_PK))
            dw = torch._grouped_mm(a, b.t(), offs=offs_E)
        counts_E = torch.diff(offs_E, prepend=offs_E.new_zeros(1))
        dw = torch.where((counts_E > 0).view(-1, 1, 1), dw, 0)
        return _zero_tail(dx, offs_E), dw.to(ctx.w_dtype), None, None, None, None, None, None, None


def _zero_tail(t_PX: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    valid_P1 = (torch.arange(t_PX.shape[0], device=t_PX.device) < offs_E[-1]).unsqueeze(-1)
    return torch.where(valid_P1, t_PX, 0)


def fp8_grouped_mm(x_PK: torch.Tensor, w_ENK: torch.Tensor, offs_E: torch.Tensor, recipe: str,
                   kernel: str = EMULATED, host_offs_E: torch.Tensor | None = None) -> torch.Tensor:
    """Rows of expert e times w[e]^T, in e4m3 by `recipe`, computed in x's dtype (autocast off inside), on `kernel`
    (`kernels.grouped_kernel`); `host_offs_E`, a host copy of offs_E for the kernels that read it there (copied
    here where not given).

    Groups must start and end on multiples of 128 rows, and the row count be one (pad with zero rows); see
    `_Fp8GroupedMMFn`.
    """
    with torch.autocast(x_PK.device.type, enabled=False):
        weight, blocks = _weight_and_blocks(w_ENK, x_PK.dtype)
        if kernel == DEEPGEMM:
            return _zero_tail(_deepgemm_grouped_mm(x_PK, weight, offs_E), offs_E)
        return _Fp8GroupedMMFn.apply(x_PK, weight, offs_E, recipe, kernel, host_offs_E, w_ENK.dtype != x_PK.dtype,
                                     *blocks)


def _deepgemm_grouped_mm(x_PK: torch.Tensor, w_ENK: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    """torchao's blockwise FP8 MoE GEMM, which runs DeepGEMM's grouped kernels (forward, dgrad, and wgrad over
    each group's rows) with its own autograd and quantisation (scales amax / 448, not powers of two)."""
    from torchao.prototype.moe_training.blockwise_fp8.grouped_mm import \
        _to_fp8_blockwise_then_scaled_grouped_mm  # optional: CUDA with triton and deep_gemm (kernels.Platform)

    return _to_fp8_blockwise_then_scaled_grouped_mm(x_PK, w_ENK.transpose(-2, -1), offs_E, out_dtype=x_PK.dtype,
                                                    pad_token_groups_for_grouped_mm=False)


class Fp8GroupedMM:
    """`fp8_grouped_mm` with a fixed recipe, as the routed experts call it (`core.quantization.QuantizedGroupedMM`),
    on the kernel `kernels.grouped_kernel` chooses for `platform` (default: this machine) and each call's dtype and
    weight shape; `kernels` = "emulated": always the emulation.

    Groups start and end on multiples of 128 rows, and the row count is one: the token tiles of the weight gradients'
    quantisation must not straddle two experts.
    """

    row_align = BLOCK

    def __init__(self, recipe: str, kernels: str = "auto", platform: Platform | None = None):
        self.recipe, self.kernels = recipe, kernels
        self.platform = Platform.detect() if platform is None else platform

    def _kernel(self, x_PK: torch.Tensor, w_ENK: torch.Tensor) -> str:
        if self.kernels == EMULATED:
            return EMULATED
        return grouped_kernel(_platform(self.platform, x_PK), self.recipe, x_PK.dtype, w_ENK.shape[2],
                              w_ENK.shape[1])

    def takes_blocks(self, w_ENK: torch.Tensor) -> bool:
        """Whether the GEMM of weights like w_ENK takes weights that FSDP gathered as blocks (`fsdp_all_gather`):
        blockwise, not on DeepGEMM (whose GEMM quantises W itself, with other scales; the kernel of bf16, in which
        the experts compute on CUDA whatever the param dtype)."""
        return self.recipe == "blockwise" and (self.kernels == EMULATED or grouped_kernel(
            self.platform, self.recipe, torch.bfloat16, w_ENK.shape[2], w_ENK.shape[1]) != DEEPGEMM)

    def host_offsets(self, x_PK: torch.Tensor, w_ENK: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor | None:
        """A host copy of offs_E where these operands run on the per-expert loop (which reads it), else None."""
        return _to_host(offs_E) if self._kernel(x_PK, w_ENK) == PER_EXPERT else None

    def __call__(self, x_PK: torch.Tensor, w_ENK: torch.Tensor, offs_E: torch.Tensor,
                 host_offs_E: torch.Tensor | None = None) -> torch.Tensor:
        return fp8_grouped_mm(x_PK, w_ENK, offs_E, self.recipe, self._kernel(x_PK, w_ENK), host_offs_E)
