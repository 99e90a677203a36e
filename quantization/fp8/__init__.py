"""FP8 training: DeepSeek-V3's blockwise recipe and a rowwise one, applied as a model conversion.

Every GEMM input, forward and backward, is quantised to e4m3 along the GEMM's contraction dimension K, with one
fp32 scale per tile:

    recipe      activations and output gradients        weights
    blockwise   1 x 128 tiles (per row, 128 along K)    128 x 128 blocks
    rowwise     one scale per row (all of K)            one scale per row (all of K)

The three GEMMs of a linear y = x W^T contract over different dimensions, so each quantises its operands along
its own K: forward x and W along in_features; dgrad dY along out_features and W^T (the same 128 x 128 blocks);
wgrad dY^T and x^T along the tokens (128 x 1 tiles of dY and x, as in the DeepSeek-V3 report). Scales are powers
of two (the smallest with amax / scale <= 448): scaling is then exact, and a dequantised value is exactly
representable in bf16 as well as fp32.

GEMMs: rowwise linears are torchao's `Float8Linear` (rowwise recipe, `torch._scaled_mm`), an optional dependency.
Blockwise linears and the grouped experts (both recipes) run `gemms.py`: on CUDA sm90 real FP8 kernels; elsewhere
the emulation, which dequantises the quantised operands exactly and multiplies them with `mm` /
`torch._grouped_mm` in the compute dtype, accumulating in fp32 (see docs/fp8.md): the numerics of the recipe, not
its speed.

The package, one concern per module:

    quantize.py         e4m3 quantisation with power-of-two tile scales, and the quantise-dequantise of operands
    gemms.py            the FP8 linear and grouped GEMM (autograd functions: every GEMM input quantised)
    kernels.py          which kernel runs each GEMM kind on a platform
    scaled_gemms.py     the real FP8 GEMMs (scaled_mm, _scaled_grouped_mm, the per-expert loop)
    fsdp_all_gather.py  FSDP2 gathering blockwise weights as e4m3 blocks (tensor subclasses)
    config.py           the [fp8] section, which modules it selects (by name, inside the blocks), its checks
    convert.py          apply_fp8: the conversion of the selected modules; apply_fp8_all_gather before FSDP
    accounting.py       extra backward bytes of an FP8 GEMM and gathered bytes (the memory plan), FP8 FLOPs
"""
