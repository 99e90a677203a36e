"""FP8 quantisation: e4m3 values with one power-of-two fp32 scale per tile, and the quantise-dequantise a GEMM
emulating e4m3 inputs multiplies (`_qdq`, a custom op under torch.compile).

The tiles of each recipe (docs/fp8.md): blockwise quantises activations and output gradients in 1 x `BLOCK` tiles
along the contraction dimension and weights in `BLOCK` x `BLOCK` blocks; rowwise uses one scale per row. Scales are
powers of two (the smallest with amax / scale <= 448), so scaling is exact and a dequantised value is exactly
representable in bf16 as well as fp32. FP8 dispatch (the comm backends) sends e4m3 rows in the same 1 x `BLOCK`
tiles.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from core.quantization import FP8_TILE

__all__ = ["BLOCK", "E4M3", "E4M3_MAX", "ROWWISE_ALIGN", "WeightBlocks", "dequantize", "dequantize_row_segments",
           "dequantize_weight_blocks", "e4m3_to", "qdq_activation", "qdq_weight", "qdq_work_bytes", "quantize",
           "quantize_row_segments", "quantize_tiles", "quantize_weight_blocks", "row_major", "row_segments"]

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
BLOCK = FP8_TILE
#: every dim of a rowwise GEMM operand must be a multiple of this (torch._scaled_mm's constraint on CUDA)
ROWWISE_ALIGN = 16


def qdq_work_bytes(dtype_bytes: int) -> int:
    """Peak bytes per element that `_qdq` allocates besides its input, its result included, for a result of
    `dtype_bytes` per element: the fp32 tiles and the e4m3 copy (5), or the fp16 image and the result."""
    return max(5, 2 + dtype_bytes)


_EXPONENT_BITS, _ONE = 0x7F800000, 127 << 23  # fp32's exponent field; 1.0's bits
# 448 = 1.75 * 2^8: for amax = 1.m * 2^E, amax / 448 <= 2^(E - 8) exactly when 1.m <= 1.75 (mantissa <= 0x600000).
# Adding 0x800000 - 0x600001 to the bits carries into the exponent field exactly when the mantissa is above that
_CARRY_ABOVE_1_75 = 0x800000 - 0x600001


def _pow2_scales(amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, 1 / s) in fp32: s the smallest power of two with amax / s <= 448 (at least 2^-126; 1 where amax is 0).

    Computed on amax's bits: integer arithmetic and comparisons only, no division, frexp, ldexp or exp2, which a
    compiler may lower to approximations (Triton's fp32 division and exp2 are). So torch.compile on a GPU quantises
    to the same bits as eager code, and the quantised values are t * (1 / s): a product by a power of two, exact
    like the division it stands for. Few ops, as every FP8 GEMM operand of a compiled graph holds them."""
    bits = amax.float().clamp_min(2.0 ** -126).view(torch.int32)  # normal: the exponent field is E + 127
    # the exponent field of 2^(E-8), or of 2^(E-7) when the carry came: at least 2^-126's
    scale_bits = (((bits + _CARRY_ABOVE_1_75) & _EXPONENT_BITS) - (8 << 23)).clamp_min(1 << 23)
    scale_bits = torch.where(amax > 0, scale_bits, _ONE)
    return scale_bits.view(torch.float32), (2 * _ONE - scale_bits).view(torch.float32)


def _tiles(t: torch.Tensor, tile_rows: int, tile_cols: int) -> torch.Tensor:
    """[R, C] as a new fp32 tensor of tiles [R / tile_rows, tile_rows, C / tile_cols, tile_cols], zero-padded at
    the ends. Always a fresh buffer (never `t` itself), so callers may scale it in place."""
    R, C = t.shape
    pad_r, pad_c = -R % tile_rows, -C % tile_cols
    out = t.new_zeros(R + pad_r, C + pad_c, dtype=torch.float32) if pad_r or pad_c else \
        t.new_empty(R, C, dtype=torch.float32)
    out[:R, :C] = t
    # every size spelled out: a view of no rows (an EP rank that receives none) leaves a -1 undetermined
    return out.view((R + pad_r) // tile_rows, tile_rows, (C + pad_c) // tile_cols, tile_cols)


def _abs_max(t: torch.Tensor, dim, keepdim: bool = False) -> torch.Tensor:
    """max |x| over `dim`, without the tensor-sized temporary that abs().amax() makes. On CPU as max(amax, -amin):
    ATen's CPU inf-norm reduces element by element, 10-17x slower than the two vectorised reductions (2-core
    machine, torch 2.13); elsewhere as the inf-norm, one pass."""
    if t.device.type == "cpu":
        return torch.maximum(t.amax(dim, keepdim=keepdim), t.amin(dim, keepdim=keepdim).neg_())
    return torch.linalg.vector_norm(t, ord=float("inf"), dim=dim, keepdim=keepdim)


def _tile_amax(tiles: torch.Tensor, keepdim: bool = False) -> torch.Tensor:
    """max |x| per tile of a [R / tile_rows, tile_rows, C / tile_cols, tile_cols] view."""
    return _abs_max(tiles, (1, 3), keepdim)


# e4m3's sign and 7 exponent-mantissa bits, shifted left by 7, sit where fp16 keeps its sign, the low 4 bits of its
# exponent and its top 3 mantissa bits: the fp16 number is the e4m3 value times 2^-8 (fp16's exponent bias is 15,
# e4m3's 7), subnormals included, as both formats' subnormals scale the mantissa by the smallest exponent.
_F16_OF_E4M3 = -16512  # 0xBF80 as int16: fp16's sign bit and bits 7-13
_E4M3_NAN_BITS, _F16_TOP_EXPONENT_BIT = 0x3F80, 0x4000


def _e4m3_as_f16(q: torch.Tensor) -> torch.Tensor:
    """q's e4m3 values times 2^-8, exactly, as fp16 (NaN stays NaN), in integer ops: on CPU, ATen converts e4m3
    element by element (5.6 ms per million elements to fp32 on the 2-core machine, torch 2.13), fp16 in vector
    instructions (this and the conversion of its result to fp32: 0.6 ms; to bf16: 1.8 ms)."""
    h = q.view(torch.int8).to(torch.int16)  # sign-extended: bit 15 is e4m3's sign
    h.bitwise_left_shift_(7).bitwise_and_(_F16_OF_E4M3)
    # e4m3's NaN (S.1111.111) would read as 480: adding one to its 7 ones carries into fp16's top exponent bit
    h.bitwise_or_(h.bitwise_and(_E4M3_NAN_BITS).add_(1 << 7).bitwise_and_(_F16_TOP_EXPONENT_BIT))
    return h.view(torch.float16)


def e4m3_to(q: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`q.to(dtype)` for an e4m3 tensor: the same numbers, bit for bit, and NaN for NaN (in bf16 with another NaN
    payload); on CPU through `_e4m3_as_f16`, 2-8x faster."""
    if q.device.type != "cpu":
        return q.to(dtype)
    return _e4m3_as_f16(q).to(dtype).mul_(256)


def quantize(t: torch.Tensor, tile_rows: int, tile_cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise a 2-D tensor [R, C] to e4m3 with one fp32 scale per tile of tile_rows x tile_cols.

    Returns (q [R, C] float8_e4m3fn, scale [ceil(R / tile_rows), ceil(C / tile_cols)] fp32) with
    t ~= q * scale of its tile. Partial tiles at the ends are scaled by the values they hold.
    """
    R, C = t.shape
    tiles = _tiles(t, tile_rows, tile_cols)
    scale, inverse = _pow2_scales(_tile_amax(tiles))
    tiles.mul_(inverse[:, None, :, None])
    del inverse  # freed before the e4m3 copy exists
    q = tiles.to(E4M3)
    return q.view(-1, q.shape[2] * tile_cols)[:R, :C], scale


def row_major(t: torch.Tensor) -> torch.Tensor:
    """t itself when contiguous, else a contiguous copy (`clone`: unlike `contiguous`, also under a fake CUDA
    tensor mode, in which the CPU tests check the real kernels' layouts)."""
    return t if t.is_contiguous() else t.clone(memory_format=torch.contiguous_format)


def quantize_tiles(t: torch.Tensor, tile_rows: int, tile_cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize` for the real FP8 kernels: [R, C] with dims that are multiples of the tile, in t's dtype (no
    padding, no fp32 copy of t). The same e4m3 values and scales as `quantize`, bit for bit: the tile maximum is
    one of t's values, and scaling by a power of two in fp32 is exact.

    Returns (q [R, C] contiguous e4m3, scale [R / tile_rows, C / tile_cols] contiguous fp32). Eager, it passes
    over t three times (maximum, fp32 product, cast); torch.compile fuses them.
    """
    R, C = t.shape
    tiles = row_major(t).view(R // tile_rows, tile_rows, C // tile_cols, tile_cols)
    scale, inverse = _pow2_scales(_tile_amax(tiles, keepdim=True))
    q = torch.mul(tiles, inverse).to(E4M3)
    return q.view(R, C), scale.view(R // tile_rows, C // tile_cols)


class WeightBlocks(NamedTuple):
    """A weight [..., N, K] (a stack of experts' too) in e4m3, with one fp32 scale per `BLOCK` x `BLOCK` block: the
    forward's operand of the real blockwise kernels, whose dgrad takes W^T's blocks, the same ones transposed."""

    q: torch.Tensor
    """[..., N, K] e4m3, row-major."""
    scale: torch.Tensor
    """[..., N / BLOCK, K / BLOCK] fp32."""

    def transposed(self) -> "WeightBlocks":
        """W^T's blocks: the same e4m3 values and scales, transposed, the values copied row-major (the layout the
        GEMMs take: K last). Bit for bit what `quantize_weight_blocks` gives of W^T, for a read and a write of one
        byte per element where quantising W^T again reads the weight in bf16 for its maxima and its scaling."""
        return WeightBlocks(row_major(self.q.transpose(-2, -1)), self.scale.transpose(-2, -1))


def quantize_weight_blocks(w: torch.Tensor) -> WeightBlocks:
    """`quantize_tiles` of a weight [..., N, K] in `BLOCK` x `BLOCK` blocks (N and K multiples of `BLOCK`, so no
    block straddles two experts of a stack)."""
    *lead, N, K = w.shape
    q, scale = quantize_tiles(w.reshape(-1, K), BLOCK, BLOCK)
    return WeightBlocks(q.view(w.shape), scale.view(*lead, N // BLOCK, K // BLOCK))


def dequantize_weight_blocks(blocks: WeightBlocks, dtype: torch.dtype) -> torch.Tensor:
    """The weight [..., N, K] that `blocks` hold, in `dtype`: bit for bit `qdq_weight` of the weight they were
    quantised from (exact: e4m3 values times powers of two)."""
    *lead, N, K = blocks.q.shape
    w = e4m3_to(blocks.q, dtype).view(*lead, N // BLOCK, BLOCK, K // BLOCK, BLOCK)
    return w.mul_(blocks.scale.to(dtype).unsqueeze(-1).unsqueeze(-3)).view(blocks.q.shape)


def dequantize(q: torch.Tensor, scale: torch.Tensor, tile_rows: int, tile_cols: int,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q * scale of its tile, in `dtype` (exact in fp32 and bf16: e4m3 values times a power of two)."""
    R, C = q.shape
    tiles = _tiles(q, tile_rows, tile_cols).to(dtype)
    return (tiles * scale[:, None, :, None].to(dtype)).view(-1, tiles.shape[2] * tile_cols)[:R, :C]


def row_segments(num_rows: int, offsets_E: torch.Tensor) -> torch.Tensor:
    """Group id of every row of a grouped layout whose groups end at offsets_E; rows past the last offset get id E
    (an extra segment)."""
    return torch.bucketize(torch.arange(num_rows, device=offsets_E.device), offsets_E, right=True)


def quantize_row_segments(t_PC: torch.Tensor, segment_P: torch.Tensor, num_segments: int
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise t^T for a GEMM that contracts over t's rows segment by segment: one fp32 scale per column of t and
    segment of its rows (`segment_P[p]` in [0, num_segments), constant on each tile of `BLOCK` rows).

    The rowwise recipe's expert weight gradients contract over each expert's own tokens: one scale per channel and
    expert. The grouped layout starts and ends every group on a multiple of `BLOCK` rows (`gemms.Fp8GroupedMM`;
    rows past the last group that shared its last tile would count toward its scale), so each segment's maximum is
    the maximum of its tiles' maxima: a plain reduction over the tiles, then a scatter over
    P / BLOCK tile maxima, not over every element (a scatter_reduce of every element of a row into its few
    segments serialises on atomics: 9 ms per call at the 671B shapes on an H200, 47% of the FP8 step).

    t_PC: [P, C] (the grouped layout's P is a multiple of `BLOCK`; otherwise t is padded with zero rows here).
    Returns (q [C, P] row-major e4m3, the transposed layout the weight gradient's GEMM takes; scale
    [num_segments, C]).
    """
    P, C = t_PC.shape
    pad = -P % BLOCK
    if pad:
        t_PC = torch.nn.functional.pad(t_PC, (0, 0, 0, pad))
        segment_P = torch.cat([segment_P, segment_P.narrow(0, P - 1, 1).expand(pad)])
    tiles = row_major(t_PC).view(-1, BLOCK, C)
    tile_segment = segment_P.view(-1, BLOCK).select(1, 0)  # no indexing: fake CUDA tensors refuse it
    tile_amax = _abs_max(tiles, 1)  # [tiles, C], exact: one of t's values
    amax = tile_amax.new_zeros(num_segments, C).scatter_reduce_(
        0, tile_segment.unsqueeze(1).expand(tile_amax.shape), tile_amax, "amax")
    scale, inverse = _pow2_scales(amax)
    q = torch.mul(tiles, inverse.index_select(0, tile_segment).unsqueeze(1)).to(E4M3)
    return row_major(q.view(P + pad, C).narrow(0, 0, P).t()), scale


def dequantize_row_segments(q_CP: torch.Tensor, scale: torch.Tensor, segment_P: torch.Tensor,
                            dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The inverse of `quantize_row_segments`: t^T [C, P] in `dtype`."""
    # exact in place in bf16 and fp32: e4m3 values times a power of two (in fp16 scales below 2^-24 underflow, as
    # in `_qdq`)
    return e4m3_to(q_CP, dtype).mul_(scale.to(dtype).index_select(0, segment_P).t())


def _qdq(t: torch.Tensor, tile_rows: int, tile_cols: int, dtype: torch.dtype) -> torch.Tensor:
    """Quantise and dequantise [R, C] (the operand a GEMM emulating e4m3 inputs multiplies), in one pass over
    the tiles: `dequantize(*quantize(t, ...), ...)` without materialising the e4m3 tensor's layout twice.

    Memory beyond t: the fp32 tiles (4 bytes per element, scaled in place) and the e4m3 copy (1), then the e4m3
    copy and, on CPU, its fp16 image (2 and a temporary of 2), then the fp16 image and the result: `qdq_work_bytes`
    per element at the peak (docs/fp8.md, "Memory"). Under torch.compile it is the custom op `_qdq_op`."""
    if torch.compiler.is_compiling():
        return _qdq_op(t, tile_rows, tile_cols, dtype)
    R, C = t.shape
    tiles = _tiles(t, tile_rows, tile_cols)
    scale, inverse = _pow2_scales(_tile_amax(tiles, keepdim=True))
    tiles.mul_(inverse)
    del inverse  # freed before the e4m3 copy exists
    q = tiles.to(E4M3)
    del tiles  # freed before the dequantised copy exists
    cols = q.shape[2] * tile_cols
    if q.device.type == "cpu":  # `e4m3_to`, with the e4m3 copy freed before the result exists
        q = _e4m3_as_f16(q)
        deq = q.to(dtype).mul_(256)
    else:
        deq = q.to(dtype)
    deq.mul_(scale.to(dtype))
    return deq.view(-1, cols)[:R, :C]


@torch.library.custom_op("dsv3_fp8::qdq", mutates_args=())
def _qdq_op(t: torch.Tensor, tile_rows: int, tile_cols: int, dtype: torch.dtype) -> torch.Tensor:
    """`_qdq` as one opaque kernel for torch.compile: inductor's CPU code generation fails on block graphs that
    fuse its tilings with their neighbours (an assertion in its loop split, torch 2.13). Eager code calls `_qdq`
    itself, so that exact memory tracking sees its working memory (a dispatch mode sees a custom op's inner ops
    not at all)."""
    return _qdq(t, tile_rows, tile_cols, dtype).contiguous()


@_qdq_op.register_fake
def _(t: torch.Tensor, tile_rows: int, tile_cols: int, dtype: torch.dtype) -> torch.Tensor:
    return t.new_empty(t.shape, dtype=dtype)


def qdq_activation(t: torch.Tensor, recipe: str, dtype: torch.dtype) -> torch.Tensor:
    """An activation-like operand [R, K] (input, output gradient), K last: 1 x 128 tiles or one scale per row."""
    return _qdq(t, 1, BLOCK if recipe == "blockwise" else t.shape[-1], dtype)


def qdq_weight(w: torch.Tensor, recipe: str, dtype: torch.dtype) -> torch.Tensor:
    """A weight operand [..., N, K], K last: 128 x 128 blocks or one scale per row (per matrix of a stack)."""
    w2 = w.reshape(-1, w.shape[-1])  # blocks never straddle two experts: N is a multiple of 128 (validated)
    if recipe == "blockwise":
        return _qdq(w2, BLOCK, BLOCK, dtype).view(w.shape)
    return _qdq(w2, 1, w.shape[-1], dtype).view(w.shape)
