"""The real FP8 GEMMs on CUDA (`kernels.py` says when each runs): e4m3 operands from `quantize.quantize_tiles` /
`quantize_row_segments` (the emulation's values and power-of-two scales, bit for bit), laid out as torch's kernels
require them.

torch.nn.functional.scaled_mm, blockwise (the layouts of torch's checks, `_meta_registrations.py`):
    a [M, K] e4m3 with K unit-stride (row-major, or a column slice of a row-major tensor: its leading stride
    is passed on), 1 x 128 tiles along K: scale [M, K/128] fp32, column-major (strides (1, M))
    b as mat2 [K, N] column-major (b stored [N, K], K last):
        128 x 128 blocks: scale [L4, N/128], strides (1, L4), L4 = K/128 rounded up to a multiple of 4 (padding 1s)
        1 x 128 tiles along K: scale [N, K/128], column-major (strides (1, N))
The scales are laid out before the opaque GEMM ops (`_mm_scales`, `_grouped_col_major`, `_padded_blocks`), in the
code torch.compile generates with their quantisation; inside the ops every scale, each expert's included, is a
view, and so is every operand cuBLASLt takes as it is (`_k_major`). (Before, each per-expert GEMM copied its
scales into these layouts itself: 2 small kernels per GEMM, 576 a step at the 671B benchmark's shapes, each
launched from Python in the per-expert loop.)
torch._scaled_grouped_mm, rowwise: a [P, K] row-major with one scale per row ([P]); b as [E, K, N] column-major in
    its last two dims with one scale per expert and output column ([E, N]); the weight gradient's 2D x 2D form
    (groups along the contraction) takes one scale per row and group, group-major ([E * rows]).

A linear's three GEMMs are all `blockwise_mm`: forward (x, W, blocks), dgrad (dY, W^T, blocks), wgrad (dY^T, x^T,
1 x 128 tiles along the tokens). Blockwise grouped experts without DeepGEMM run one scaled_mm per expert
(`dsv3_fp8::blockwise_grouped_mm`, a custom op on operands quantised before it: it reads the group offsets on the
host, which torch.compile must not trace). The blockwise scaled_mm itself is a custom op too
(`dsv3_fp8::scaled_mm_blockwise`): torch 2.11's dynamo refuses to trace `F.scaled_mm` (`torch._scaled_mm_v2` is
marked skipped; seen on an H200), so a compiled model keeps it opaque while the quantisation around it is fused.
Its fake kernel is the same code on fake tensors: torch's meta checks of the layouts run there too.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from quantization.fp8.quantize import (BLOCK, WeightBlocks, quantize_row_segments, quantize_tiles, row_major,
                                       row_segments)

__all__ = ["blockwise_grouped", "blockwise_mm", "per_expert_blockwise", "quantize_per_expert", "rowwise_grouped_mm",
           "rowwise_grouped_wgrad"]


def _col_major(scale: torch.Tensor) -> torch.Tensor:
    """The same [R, C] values with strides (1, R)."""
    return row_major(scale.t()).t()


#: cuBLASLt's FP8 operands: leading dimension and start address multiples of 16 bytes (1 byte per e4m3 element)
_FP8_ALIGN = 16


def _k_major(t: torch.Tensor) -> torch.Tensor:
    """t [R, K] e4m3 itself when its K is unit-stride with a leading stride of at least K, both it and its start
    16-byte aligned, else a row-major copy. torch hands such a view (a column slice of a wider row-major tensor)
    to cuBLASLt with its leading dimension, without copying it (`prepare_matrix_for_cublas`)."""
    rows_apart = t.stride(0)
    if (t.stride(1) == 1 and rows_apart >= t.shape[1] and rows_apart % _FP8_ALIGN == 0
            and t.storage_offset() % _FP8_ALIGN == 0):
        return t
    return row_major(t)


def _padded_blocks(scale: torch.Tensor) -> torch.Tensor:
    """128 x 128 block scales [..., N/128, K/128] padded with ones to [..., N/128, L4] (L4: K/128 rounded up to a
    multiple of 4), contiguous: each [N/128, L4] matrix, transposed, is the layout scaled_mm takes (strides
    (1, L4)); a stack of experts' is padded at once."""
    pad = -scale.shape[-1] % 4
    return F.pad(scale, (0, pad), value=1.0) if pad else row_major(scale)


def _mm_scales(a_s: torch.Tensor, b_s: torch.Tensor, b_blocks: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_tiles`' scales of a (1 x 128 tiles) and b (128 x 128 blocks, or 1 x 128 tiles) in the layouts
    `_blockwise_operands` passes on as views: a's column-major; b's padded blocks or column-major."""
    return _col_major(a_s), (_padded_blocks(b_s) if b_blocks else _col_major(b_s))


def _grouped_col_major(scale_PX: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    """The 1 x 128 scales [P, X] of a grouped operand as one flat buffer [P * X] in which each group's rows [s, s + n)
    (the groups end at offs_E, on the device; the rows past the last group are one more) hold their [n, X] scales
    column-major from s * X on: `_group_scales` takes each expert's as a view in the layout scaled_mm wants
    (strides (1, n)). One scatter for every group, without reading the offsets on the host."""
    P, X = scale_PX.shape
    ends = torch.cat([offs_E.to(torch.int64), offs_E.new_full((1,), P, dtype=torch.int64)])
    starts = torch.cat([ends.new_zeros(1), ends.narrow(0, 0, ends.shape[0] - 1)])
    group = row_segments(P, offs_E)
    start, count = starts.index_select(0, group), (ends - starts).index_select(0, group)
    row = torch.arange(P, device=scale_PX.device)
    # row i of its group, column j: at s X + j n + i
    dest_PX = (start * (X - 1) + row).unsqueeze(1) + torch.arange(X, device=row.device) * count.unsqueeze(1)
    return scale_PX.new_empty(P * X).index_copy_(0, dest_PX.view(-1), scale_PX.reshape(-1))


def _group_scales(flat: torch.Tensor, start: int, rows: int, cols: int) -> torch.Tensor:
    """The [rows, cols] column-major scales of the group starting at row `start` in `_grouped_col_major`'s buffer."""
    return flat.narrow(0, start * cols, rows * cols).view(cols, rows).t()


def _blockwise_operands(a_q: torch.Tensor, a_s: torch.Tensor, b_q: torch.Tensor, b_s: torch.Tensor, b_blocks: bool
                        ) -> tuple:
    """scaled_mm's (mat_a, mat_b, scale_a, recipe_a, scale_b, recipe_b) for a_q [M, K] @ b_q [N, K]^T from e4m3
    operands, both quantised along K, and their scales laid out as `_mm_scales` does (a: [M, K/128]
    column-major; b: 128 x 128 blocks [N/128, L4] or 1 x 128 tiles [N, K/128] column-major): views only. The
    operands go in K-major (`_k_major`): the weight gradient's per-expert column slices as views (on an H200
    copying them took 8.3 ms of a 285 ms step)."""
    a_q, b_q = _k_major(a_q), _k_major(b_q)
    ScalingType = F.ScalingType
    b_scale, b_recipe = (b_s.t(), ScalingType.BlockWise128x128) if b_blocks else (b_s, ScalingType.BlockWise1x128)
    return a_q, b_q.t(), a_s, ScalingType.BlockWise1x128, b_scale, b_recipe


def _blockwise_scaled_mm(a_q: torch.Tensor, a_s: torch.Tensor, b_q: torch.Tensor, b_s: torch.Tensor, b_blocks: bool,
                         out_dtype: torch.dtype) -> torch.Tensor:
    """a_q @ b_q^T in `out_dtype` (`_blockwise_operands`)."""
    return F.scaled_mm(*_blockwise_operands(a_q, a_s, b_q, b_s, b_blocks), output_dtype=out_dtype)


@torch.library.custom_op("dsv3_fp8::scaled_mm_blockwise", mutates_args=())
def _scaled_blockwise(a_q: torch.Tensor, a_s: torch.Tensor, b_q: torch.Tensor, b_s: torch.Tensor, b_blocks: bool,
                      out_dtype: torch.dtype) -> torch.Tensor:
    """`_blockwise_scaled_mm` as an op that torch.compile keeps opaque (module docstring)."""
    return _blockwise_scaled_mm(a_q, a_s, b_q, b_s, b_blocks, out_dtype)


_scaled_blockwise.register_fake(_blockwise_scaled_mm)


def _blockwise_into(out: torch.Tensor, a_q: torch.Tensor, a_s: torch.Tensor, b_q: torch.Tensor, b_s: torch.Tensor,
                    b_blocks: bool) -> None:
    """`_blockwise_scaled_mm` written into `out` [M, N] (row-major, or rows of a wider one: cuBLASLt takes its
    leading stride), in out's dtype: the per-expert GEMMs write their rows of one output, with no concatenation
    after (on an H200 the 18 concatenations took 5.0 ms of a 285 ms step). A plain function, called inside the
    opaque per-expert op: while it was a custom op of its own (dispatch, mutation bookkeeping) the loop took 73-102
    us of host time per expert GEMM, 21-44 us as a plain call (2-core CPU, torch 2.13,
    `benchmarks/per_expert_host_time.py`), for 288 calls a step at the 671B benchmark's shapes."""
    a, b, scale_a, recipe_a, scale_b, recipe_b = _blockwise_operands(a_q, a_s, b_q, b_s, b_blocks)
    torch._scaled_mm_v2(a, b, [scale_a], [recipe_a.value], [], [scale_b], [recipe_b.value], [], None, out.dtype,
                        out=out)


def _blockwise_into_checked(out: torch.Tensor, a_q: torch.Tensor, a_s: torch.Tensor, b_q: torch.Tensor,
                            b_s: torch.Tensor, b_blocks: bool) -> None:
    """`_blockwise_into` on fake tensors (the CPU layout tests): scaled_mm's out= variant has no fake kernel, so
    torch's checks of the functional one, and out's shape."""
    got = _blockwise_scaled_mm(a_q, a_s, b_q, b_s, b_blocks, out.dtype)
    if got.shape != out.shape or out.stride(-1) != 1:
        raise RuntimeError(f"scaled_mm into out {tuple(out.shape)} strides {out.stride()}: the product is "
                           f"{tuple(got.shape)} and out must be row-major")


def blockwise_mm(a_MK: torch.Tensor, b: WeightBlocks | torch.Tensor) -> torch.Tensor:
    """a @ b^T in e4m3 (a's dtype out), a quantised here in 1 x 128 tiles along K; b [N, K] a weight's 128 x 128
    blocks, quantised by the caller (`quantize_weight_blocks`; W^T's for the dgrad: `WeightBlocks.transposed`), or a
    tensor quantised here in 1 x 128 tiles along K (the weight gradient's x^T). All dims multiples of 128."""
    a_q, a_s = quantize_tiles(a_MK, 1, BLOCK)
    b_blocks = isinstance(b, WeightBlocks)
    b_q, b_s = b if b_blocks else quantize_tiles(b, 1, BLOCK)
    a_s, b_s = _mm_scales(a_s, b_s, b_blocks)
    return _scaled_blockwise(a_q, a_s, b_q, b_s, b_blocks, a_MK.dtype)


def rowwise_grouped_mm(a_PK: torch.Tensor, b_ENK: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    """Rows of group e times b[e]^T with one scale per row of a and per row of each b[e], both along K."""
    P, K = a_PK.shape
    E, N, _ = b_ENK.shape
    a_q, a_s = quantize_tiles(a_PK, 1, K)
    b_q, b_s = quantize_tiles(b_ENK.reshape(E * N, K), 1, K)
    return torch._scaled_grouped_mm(a_q, b_q.view(E, N, K).transpose(-2, -1), a_s.view(P), b_s.view(E, N),
                                    offs=offs_E, out_dtype=a_PK.dtype)


def rowwise_grouped_wgrad(dy_PN: torch.Tensor, x_PK: torch.Tensor, offs_E: torch.Tensor,
                          segment_P: torch.Tensor) -> torch.Tensor:
    """dW [E, N, K]: dY^T x over each group's rows, one scale per channel and group (`segment_P`: each row's group,
    E for rows past the last group)."""
    E = offs_E.shape[0]
    a_q, a_s = quantize_row_segments(dy_PN, segment_P, E + 1)  # [N, P] row-major, scales [E + 1, N]
    b_q, b_s = quantize_row_segments(x_PK, segment_P, E + 1)  # [K, P]
    group_major = [s.narrow(0, 0, E).reshape(-1) for s in (a_s, b_s)]
    return torch._scaled_grouped_mm(a_q, b_q.t(), *group_major, offs=offs_E, out_dtype=dy_PN.dtype)


def _per_expert(a_q: torch.Tensor, a_s: torch.Tensor, b_q: torch.Tensor, b_s: torch.Tensor, ends: list[int],
                gemm: str, out_dtype: torch.dtype, into: Callable[..., None] = _blockwise_into) -> torch.Tensor:
    """One blockwise scaled_mm per non-empty group, for the group ends `ends` (host ints, multiples of 128), on
    e4m3 operands and their scales as `quantize_per_expert` lays them out:

        fwd    a = x [P, K] (1 x 128),  b = W [E, N, K] (128 x 128)    -> [P, N]
        dgrad  a = dY [P, N] (1 x 128), b = W^T [E, K, N] (128 x 128)  -> [P, K]
        wgrad  a = dY^T [N, P], b = x^T [K, P] (1 x 128 along the rows) -> [E, N, K]

    Each group's GEMM writes its rows (its [N, K] slab for wgrad) of one output (`into`: `_blockwise_into`); rows
    past the last group and the weight gradients of empty groups are zeroed. Every operand and scale of a group's
    GEMM is a view: the weight gradient's operands are column slices of the [N, P] and [K, P] e4m3 tensors
    (`_k_major`; group starts are multiples of 128) and their scales column slices of column-major ones; the
    forward's and dgrad's scales are the groups' column-major blocks (`_group_scales`) and each expert's padded
    weight blocks. (Views by `narrow`, `view`, `select` and `t`: the fake CUDA tensors of the CPU layout tests
    support these.)"""
    groups = [(s, t - s) for s, t in zip([0] + ends[:-1], ends)]
    if gemm == "wgrad":
        out = a_q.new_empty(len(groups), a_q.shape[0], b_q.shape[0], dtype=out_dtype)
        for e, (s, n) in enumerate(groups):
            if n:
                into(out.select(0, e), a_q.narrow(1, s, n), a_s.narrow(1, s // BLOCK, n // BLOCK), b_q.narrow(1, s, n),
                     b_s.narrow(1, s // BLOCK, n // BLOCK), False)
            else:
                out.select(0, e).zero_()
        return out
    out = a_q.new_empty(a_q.shape[0], b_q.shape[1], dtype=out_dtype)
    tiles = a_q.shape[1] // BLOCK
    for e, (s, n) in enumerate(groups):
        if n:
            into(out.narrow(0, s, n), a_q.narrow(0, s, n), _group_scales(a_s, s, n, tiles), b_q.select(0, e),
                 b_s.select(0, e), True)
    out.narrow(0, ends[-1], a_q.shape[0] - ends[-1]).zero_()
    return out


@torch.library.custom_op("dsv3_fp8::blockwise_grouped_mm", mutates_args=())
def _per_expert_op(a_q: torch.Tensor, a_s: torch.Tensor, b_q: torch.Tensor, b_s: torch.Tensor, offs_E: torch.Tensor,
                   gemm: str, out_dtype: torch.dtype) -> torch.Tensor:
    """`_per_expert` with the group ends read from `offs_E` (on the device a host sync, which torch.compile must not
    trace; the routed experts hand it a copy on the host, made once per MoE layer's forward)."""
    return _per_expert(a_q, a_s, b_q, b_s, offs_E.tolist(), gemm, out_dtype)


@_per_expert_op.register_fake
def _(a_q: torch.Tensor, a_s: torch.Tensor, b_q: torch.Tensor, b_s: torch.Tensor, offs_E: torch.Tensor, gemm: str,
      out_dtype: torch.dtype) -> torch.Tensor:
    if gemm == "wgrad":
        return a_q.new_empty(offs_E.shape[0], a_q.shape[0], b_q.shape[0], dtype=out_dtype)
    return a_q.new_empty(a_q.shape[0], b_q.shape[1], dtype=out_dtype)


def quantize_per_expert(a: torch.Tensor, b: WeightBlocks | torch.Tensor, offs_E: torch.Tensor, gemm: str
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The e4m3 operands of `_per_expert`'s `gemm` from a [P, X] and b (fwd: W's blocks [E, N, K]; dgrad: W^T's
    blocks [E, K, N], `WeightBlocks.transposed`; wgrad: x [P, K]), with their scales laid out for its per-expert
    views: a's 1 x 128 scales in column-major blocks per group (`_grouped_col_major`, from the group ends offs_E on
    the device) and the weights' 128 x 128 ones padded per expert (fwd, dgrad); the weight gradient's two 1 x 128
    scales column-major. Outside the custom op, so that torch.compile fuses the quantisation and the layouts with
    their neighbours (inside it, every tile maximum, product and cast ran as its own eager kernel: a third of the
    blockwise FP8 step at the 671B shapes on an H200). The weight gradient quantises the whole 128-row tiles of a and
    b, which hold every group (groups end on multiples of 128); the tiles past the last group are their own and go
    unused."""
    if gemm == "wgrad":
        rows = a.shape[0] - a.shape[0] % BLOCK
        (a_q, a_s), (b_q, b_s) = (quantize_tiles(t.narrow(0, 0, rows).t(), 1, BLOCK) for t in (a, b))
        return a_q, _col_major(a_s), b_q, _col_major(b_s)
    a_q, a_s = quantize_tiles(a, 1, BLOCK)
    return a_q, _grouped_col_major(a_s, offs_E), b.q, _padded_blocks(b.scale)


def blockwise_grouped(a: torch.Tensor, b: WeightBlocks | torch.Tensor, offs_E: torch.Tensor,
                      host_offs_E: torch.Tensor, gemm: str) -> torch.Tensor:
    """The blockwise grouped experts' `gemm` (fwd, dgrad or wgrad, `_per_expert`; b as `quantize_per_expert` takes
    it) on one scaled_mm per expert: the group ends offs_E on the device lay out the scales, their copy on the host
    (`host_offs_E`) slices the groups."""
    return _per_expert_op(*quantize_per_expert(a, b, offs_E, gemm), host_offs_E, gemm, a.dtype)


def per_expert_blockwise(a: torch.Tensor, b: WeightBlocks | torch.Tensor, offs_E: torch.Tensor, ends: list[int],
                         gemm: str) -> torch.Tensor:
    """`blockwise_grouped` with the group ends also given as host ints, for fake CUDA tensors (the CPU layout tests):
    no custom op, and torch's checks in place of each GEMM (`_blockwise_into_checked`)."""
    return _per_expert(*quantize_per_expert(a, b, offs_E, gemm), ends, gemm, a.dtype, _blockwise_into_checked)
