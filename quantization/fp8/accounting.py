"""What FP8 costs and what it runs, for the memory plan, the FLOP count and the step-time model: the extra backward
bytes of one emulated FP8 GEMM, the FLOPs per token a selection runs as FP8 GEMMs, and the operand elements it
quantises."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

from core.names import denotes
from quantization.fp8.config import Fp8Selection
from quantization.fp8.quantize import BLOCK, qdq_work_bytes

__all__ = ["FP8_DISPATCH_BYTES", "FP8_GATHER_BYTES", "fp8_flops_per_token", "fp8_operand_elements",
           "gemm_backward_extra_bytes"]

#: bytes per element of a weight that FSDP gathers as FP8 blocks (`fsdp_all_gather`): e4m3, and one fp32 scale per
#: 128 x 128 block
FP8_GATHER_BYTES = 1 + 4 / BLOCK ** 2
#: bytes per element of a row that FP8 dispatch sends (`TokenDispatcher.quantize_wire`): e4m3, and one fp32 scale
#: per 1 x 128 tile
FP8_DISPATCH_BYTES = 1 + 4 / BLOCK


def gemm_backward_extra_bytes(recipe: str, rows: int, in_features: int, out_features: int, act_bytes: int,
                              experts: int = 0, weight_kept: bool = False, weight_gathered: bool = False) -> int:
    """Peak bytes the backward of one emulated FP8 GEMM allocates beyond the high-precision GEMM's backward (whose
    peak is its two gradients), for the memory plan.

    x [rows, in], W [out, in] (a linear, `experts` = 0) or [experts, out, in] (grouped), dY [rows, out], in the
    compute dtype of `act_bytes` per element; `weight_kept`: the forward saved its quantised weight for the dgrad
    (`gemms._keeps_weight`), which then quantises no W^T; `weight_gathered`: FSDP gathered the weight as blocks
    (`fsdp_all_gather`), which the dgrad dequantises (on CPU through an fp16 image: 2 + `act_bytes` per element at
    the peak) instead of quantising W^T. The peak is the largest of the backward's phases, in the
    order `gemms._Fp8LinearFn.backward` / `gemms._Fp8GroupedMMFn.backward` run them: each quantise-dequantise of an
    operand peaks at `qdq_work_bytes` per element (its result included), while the copies made before it are still
    held. Measured against the exact tracker within 1% (docs/fp8.md, "Memory"). Rowwise linears are torchao's;
    they are planned as ours.
    """
    a, qdq = act_bytes, qdq_work_bytes(act_bytes)
    x, dy = rows * in_features, rows * out_features
    w = max(experts, 1) * in_features * out_features
    wt = 0 if weight_kept else a * w  # W^T's dequantised copy, until the dgrad GEMM has run
    # what making W^T's operand allocates: nothing (kept), the gathered blocks dequantised, or W^T quantised
    w_op = 0 if weight_kept else (2 + a) * w if weight_gathered else qdq * w
    if not experts:
        phases = (qdq * dy,  # dgrad: dY quantised
                  0 if weight_kept else a * dy + w_op,  # W^T's operand, dY's copy held
                  a * (dy + x) + wt,  # the dgrad GEMM: both operands and dx
                  a * x + qdq * dy,  # wgrad: dY^T quantised, dx held
                  a * (x + dy) + qdq * x,  # x^T quantised
                  a * (2 * x + dy + w))  # the wgrad GEMM: both copies, dx and dW
    else:
        # the rowwise experts' wgrad quantises per expert segment (fp32 product and e4m3, then the transposed e4m3),
        # then dequantises with each element's scale expanded: e4m3, result and scales, 1 + 2a per element
        wq = qdq if recipe == "blockwise" else max(qdq, 1 + 2 * a)
        held = a * dy  # the zero-tailed dY, held throughout
        # W^T: reshaped into a copy, then quantised; or the gathered blocks dequantised
        phases = (held + (0 if weight_kept else w_op if weight_gathered else (a + qdq) * w),
                  held + wt + qdq * dy,  # dgrad: dY quantised
                  held + wt + a * (dy + x),  # the dgrad GEMM
                  held + a * x + wq * dy,  # wgrad: dY^T quantised, dx held
                  held + a * (x + dy) + wq * x,  # x^T quantised
                  held + a * (dy + 2 * x + 2 * w),  # the wgrad GEMM, and dW with its empty experts zeroed
                  held + a * (dy + 3 * x + w))  # dx with its padding rows zeroed
    return max(phases) - a * (x + w)


def fp8_flops_per_token(selection: Fp8Selection, module_flops: Mapping[str, float]) -> float:
    """The training FLOPs per token that the selection runs as FP8 GEMMs: the sum over the modules it selects of a
    model's {block-relative FQN: FLOPs per token} table (a model spec's `module_flops`); 0 for recipe none."""
    if selection.recipe == "none":
        return 0.0
    return sum(flops for fqn, flops in module_flops.items() if selection.selects(fqn))


def fp8_operand_elements(selection: Fp8Selection, module_flops: Mapping[str, float],
                         param_shapes: Iterable[tuple[str, tuple[int, ...]]]) -> tuple[float, int, int]:
    """What the selection's GEMMs quantise: (activation and output-gradient elements per token, weight elements of
    the plain linears, weight elements of the stacked experts), for the step-time model.

    Each FP8 GEMM quantises both its operands along its own K: forward x and W, dgrad dY and W^T, wgrad dY^T and
    x^T. So a weight [N, K] (of `copies` experts) with R rows per token through it costs 2 R (K + N) activation
    elements per token and 2 N K weight elements per pass. R comes from the module's FLOPs per token (`module_flops`,
    6 R N K summed over its blocks), the shapes from the model's parameters (`param_shapes`: (name, shape),
    matched to the block-relative names by `core.names.denotes`). The weights are counted once here (the caller
    doubles them and shares them out over pipeline stages and expert-parallel ranks).
    """
    params = list(param_shapes)
    activations, linears, experts = 0.0, 0, 0
    for fqn, flops in module_flops.items():
        if selection.recipe == "none" or not selection.selects(fqn):
            continue
        by_module: dict[str, list[tuple[int, ...]]] = {}
        for name, shape in params:
            module = name.rpartition(".")[0]
            if len(shape) >= 2 and denotes(module, fqn):
                by_module.setdefault(module, []).append(shape)
        if not by_module:
            continue
        shapes = next(iter(by_module.values()))
        numel = sum(math.prod(s) for s in shapes)
        # rows per token through one copy of a weight: flops / (6 numel x blocks); the K + N elements of each row
        activations += flops * sum(math.prod(s[:-2]) * (s[-1] + s[-2]) for s in shapes) / (3 * numel)
        if any(len(s) > 2 for s in shapes):
            experts += numel * len(by_module)
        else:
            linears += numel * len(by_module)
    return activations, linears, experts
