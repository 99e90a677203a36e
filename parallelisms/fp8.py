"""FP8 training: DeepSeek-V3's blockwise recipe and a rowwise one, applied as a model conversion.

`apply_fp8(model, fp8_cfg)` runs in the parallelize chain after expert parallelism and before activation
checkpointing, compile and FSDP. It converts the linears and grouped experts of the transformer blocks that the
`[fp8]` filters select; parameters keep their objects and names, so checkpoints hold the same high-precision
master weights whatever the recipe (a run can switch recipes across a resume).

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
Blockwise linears and the grouped experts (both recipes) run `_Fp8LinearFn` / `_Fp8GroupedMMFn` here: they
dequantise the quantised operands exactly and multiply them with `mm` / `torch._grouped_mm` in the compute dtype,
which accumulates in fp32 (see docs/fp8.md): the numerics of the recipe, not its speed.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from models.common.grouped_mm import QUANTIZED_MM
from trainer.config import option


@dataclass
class Fp8Section:
    """FP8 compute for the linears and routed experts of the transformer blocks (docs/fp8.md)."""

    recipe: str = option("none", choices=["none", "rowwise", "blockwise"])
    """e4m3 inputs for every GEMM of the selected modules: blockwise (DeepSeek-V3: 1x128 activation tiles,
    128x128 weight blocks) or rowwise (one scale per row; linears via torchao); none = high precision."""
    modules: list[str] = option(["attention", "feed_forward", "moe.experts", "moe.shared_experts"])
    """Modules inside the blocks whose linears (and grouped experts) convert: names or dotted parts of their
    block-relative names (e.g. attention, wo, moe.experts). Router gate, norms, attention core, embedding and
    output head always stay high precision."""
    exclude_modules: list[str] = option(["attention.wkv_a"])
    """Modules left out of modules, same naming (wkv_a's output, kv_lora_rank + qk_rope_head_dim = 576 in the
    DeepSeek flavors, is not a multiple of 128)."""
    dispatch: bool = True
    """With the blockwise recipe and FP8 routed experts, expert parallelism sends the experts' inputs as e4m3 with
    one scale per 1x128 tile, as DeepSeek-V3 does, where the comm backend supports it (the log says whether it
    does; combine and the backward stay in the compute dtype): about half the bytes of bf16, and the experts see
    the same values."""


__all__ = ["BLOCK", "E4M3_MAX", "Fp8Section", "RECIPES", "Fp8GroupedMM", "Fp8Linear", "apply_fp8", "dequantize",
           "dequantize_segments", "fp8_block_modules", "fp8_config_problem", "fp8_flops_per_token", "fp8_grouped_mm",
           "gemm_backward_extra_bytes", "is_selected", "quantize", "quantize_segments"]

logger = logging.getLogger(__name__)

RECIPES = ("none", "rowwise", "blockwise")
E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
BLOCK = 128
#: every dim of a rowwise GEMM operand must be a multiple of this (torch._scaled_mm's constraint on CUDA)
ROWWISE_ALIGN = 16
#: peak bytes per element that `_qdq` allocates besides its input, its result included: fp32 tiles + e4m3 copy
QDQ_WORK_BYTES = 5


# ----------------------------------------------------------------------------------------------- quantisation

def _pow2_scale(amax: torch.Tensor) -> torch.Tensor:
    """The smallest power of two s with amax / s <= 448 (1 where amax is 0), in fp32."""
    mantissa, exponent = torch.frexp(amax.float() / E4M3_MAX)
    # frexp gives m in [0.5, 1): s = m 2^e rounds up to 2^e, unless it already is a power of two (m = 0.5)
    exponent = exponent - (mantissa == 0.5).to(exponent.dtype)
    return torch.where(amax > 0, torch.ldexp(torch.ones_like(mantissa), exponent), 1.0)


def _tiles(t: torch.Tensor, tile_rows: int, tile_cols: int) -> torch.Tensor:
    """[R, C] as a new fp32 tensor of tiles [R / tile_rows, tile_rows, C / tile_cols, tile_cols], zero-padded at
    the ends. Always a fresh buffer (never `t` itself), so callers may scale it in place."""
    R, C = t.shape
    pad_r, pad_c = -R % tile_rows, -C % tile_cols
    out = t.new_zeros(R + pad_r, C + pad_c, dtype=torch.float32) if pad_r or pad_c else \
        t.new_empty(R, C, dtype=torch.float32)
    out[:R, :C] = t
    return out.view((R + pad_r) // tile_rows, tile_rows, -1, tile_cols)


def _tile_amax(tiles: torch.Tensor, keepdim: bool = False) -> torch.Tensor:
    """max |x| per tile; the inf-norm reduces without the tensor-sized temporary that abs().amax() makes."""
    return torch.linalg.vector_norm(tiles, ord=float("inf"), dim=(1, 3), keepdim=keepdim)


def quantize(t: torch.Tensor, tile_rows: int, tile_cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise a 2-D tensor [R, C] to e4m3 with one fp32 scale per tile of tile_rows x tile_cols.

    Returns (q [R, C] float8_e4m3fn, scale [ceil(R / tile_rows), ceil(C / tile_cols)] fp32) with
    t ~= q * scale of its tile. Partial tiles at the ends are scaled by the values they hold.
    """
    R, C = t.shape
    tiles = _tiles(t, tile_rows, tile_cols)
    scale = _pow2_scale(_tile_amax(tiles))
    q = tiles.div_(scale[:, None, :, None]).to(E4M3)
    return q.view(-1, q.shape[2] * tile_cols)[:R, :C], scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, tile_rows: int, tile_cols: int,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q * scale of its tile, in `dtype` (exact in fp32 and bf16: e4m3 values times a power of two)."""
    R, C = q.shape
    tiles = _tiles(q, tile_rows, tile_cols).to(dtype)
    return (tiles * scale[:, None, :, None].to(dtype)).view(-1, tiles.shape[2] * tile_cols)[:R, :C]


def quantize_segments(t: torch.Tensor, segment_C: torch.Tensor, num_segments: int
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise [R, C] with one fp32 scale per row and column segment (`segment_C[c]` in [0, num_segments)).

    The rowwise recipe's expert weight gradients contract over each expert's own tokens: one scale per output
    channel and expert. Returns (q [R, C] e4m3, scale [R, num_segments]).
    """
    # max |t| per segment from the segments' max and min: no tensor-sized abs() or float() copy of t
    index = segment_C.expand(t.shape)
    high = t.new_zeros(t.shape[0], num_segments).scatter_reduce_(1, index, t, "amax")
    low = t.new_zeros(t.shape[0], num_segments).scatter_reduce_(1, index, t, "amin")
    scale = _pow2_scale(torch.maximum(high, -low))
    scaled = scale.index_select(1, segment_C)  # one fp32 buffer: each element's scale, then the scaled value
    return torch.div(t, scaled, out=scaled).to(E4M3), scale


def _qdq(t: torch.Tensor, tile_rows: int, tile_cols: int, dtype: torch.dtype) -> torch.Tensor:
    """Quantise and dequantise [R, C] (the operand a GEMM emulating e4m3 inputs multiplies), in one pass over
    the tiles: `dequantize(*quantize(t, ...), ...)` without materialising the e4m3 tensor's layout twice.

    Memory beyond t: the fp32 tiles (4 bytes per element, scaled in place) and the e4m3 copy (1), then the e4m3
    copy and the result (at most 4): `QDQ_WORK_BYTES` per element at the peak (docs/fp8.md, "Memory"). Under torch.compile
    it is the custom op `_qdq_op`."""
    if torch.compiler.is_compiling():
        return _qdq_op(t, tile_rows, tile_cols, dtype)
    R, C = t.shape
    tiles = _tiles(t, tile_rows, tile_cols)
    scale = _pow2_scale(_tile_amax(tiles, keepdim=True))
    q = tiles.div_(scale).to(E4M3)
    del tiles  # freed before the dequantised copy exists
    deq = q.to(dtype).mul_(scale.to(dtype))
    return deq.view(-1, q.shape[2] * tile_cols)[:R, :C]


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


def _qdq_act(t: torch.Tensor, recipe: str, dtype: torch.dtype) -> torch.Tensor:
    """An activation-like operand [R, K] (input, output gradient), K last: 1 x 128 tiles or one scale per row."""
    return _qdq(t, 1, BLOCK if recipe == "blockwise" else t.shape[-1], dtype)


def _qdq_weight(w: torch.Tensor, recipe: str, dtype: torch.dtype) -> torch.Tensor:
    """A weight operand [..., N, K], K last: 128 x 128 blocks or one scale per row (per matrix of a stack)."""
    w2 = w.reshape(-1, w.shape[-1])  # blocks never straddle two experts: N is a multiple of 128 (validated)
    if recipe == "blockwise":
        return _qdq(w2, BLOCK, BLOCK, dtype).view(w.shape)
    return _qdq(w2, 1, w.shape[-1], dtype).view(w.shape)


# ----------------------------------------------------------------------------------------------- linear

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
        return _qdq_act(x_MK, recipe, dtype) @ _qdq_weight(w_NK, recipe, dtype).t()

    @staticmethod
    def backward(ctx, dy_MN: torch.Tensor):
        x_MK, w_NK = ctx.saved_tensors
        recipe, dtype = ctx.recipe, x_MK.dtype
        dy_MN = dy_MN.to(dtype)
        dx = _qdq_act(dy_MN, recipe, dtype) @ _qdq_weight(w_NK.t(), recipe, dtype).t()
        # weight gradient: contraction over the tokens, so both operands are tiled along them
        dw = _qdq_act(dy_MN.t(), recipe, dtype) @ _qdq_act(x_MK.t(), recipe, dtype).t()
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


# ----------------------------------------------------------------------------------------------- grouped experts

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
        y = torch._grouped_mm(_qdq_act(x_PK, recipe, dtype), _qdq_weight(w_ENK, recipe, dtype).transpose(-2, -1),
                              offs=offs_E)
        return _zero_tail(y, offs_E)

    @staticmethod
    def backward(ctx, dy_PN: torch.Tensor):
        x_PK, w_ENK, offs_E = ctx.saved_tensors
        recipe, dtype = ctx.recipe, x_PK.dtype
        dy_PN = _zero_tail(dy_PN.to(dtype), offs_E)
        # dgrad contracts over N: W^T [E, K, N] is quantised along N (the same blocks as W for blockwise)
        w_EKN = _qdq_weight(w_ENK.transpose(-2, -1), recipe, dtype)
        dx = torch._grouped_mm(_qdq_act(dy_PN, recipe, dtype), w_EKN.transpose(-2, -1), offs=offs_E)
        dy_NP, x_KP = dy_PN.t(), x_PK.t()
        if recipe == "blockwise":
            a, b = _qdq_act(dy_NP, recipe, dtype), _qdq_act(x_KP, recipe, dtype)
        else:
            # one scale per channel and expert: the contraction runs over each expert's rows only
            seg_P, E = _segments(x_PK.shape[0], offs_E), offs_E.shape[0]
            a, b = (dequantize_segments(*quantize_segments(t, seg_P, E + 1), seg_P, dtype) for t in (dy_NP, x_KP))
        dw = torch._grouped_mm(a, b.t(), offs=offs_E)
        counts_E = torch.diff(offs_E, prepend=offs_E.new_zeros(1))
        dw = torch.where((counts_E > 0)[:, None, None], dw, 0)
        return _zero_tail(dx, offs_E), dw.to(w_ENK.dtype), None, None


def dequantize_segments(q: torch.Tensor, scale: torch.Tensor, segment_C: torch.Tensor,
                        dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The inverse of `quantize_segments`, in `dtype`."""
    # exact in place: e4m3 values times a power of two are representable in bf16 as in fp32
    return q.to(dtype).mul_(scale.index_select(1, segment_C))


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
    """`fp8_grouped_mm` with a fixed recipe, as the routed experts call it (`models.common.grouped_mm`).

    Groups start on multiples of 128 rows, and the row count is one: the token tiles of the weight gradients'
    quantisation must not straddle two experts.
    """

    row_align = BLOCK

    def __init__(self, recipe: str):
        self.recipe = recipe

    def __call__(self, x_PK: torch.Tensor, w_ENK: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
        return fp8_grouped_mm(x_PK, w_ENK, offs_E, self.recipe)


# ----------------------------------------------------------------------------------------------- memory

def gemm_backward_extra_bytes(recipe: str, rows: int, in_features: int, out_features: int, act_bytes: int,
                              experts: int = 0) -> int:
    """Peak bytes the backward of one emulated FP8 GEMM allocates beyond the high-precision GEMM's backward (whose
    peak is its two gradients), for the memory plan.

    x [rows, in], W [out, in] (a linear, `experts` = 0) or [experts, out, in] (grouped), dY [rows, out], in the
    compute dtype of `act_bytes` per element. The peak is the largest of the backward's phases, in the order
    `_Fp8LinearFn.backward` / `_Fp8GroupedMMFn.backward` run them: each quantise-dequantise of an operand peaks at
    `QDQ_WORK_BYTES` per element (its result included), while the copies made before it are still held. Measured
    against the exact tracker within 1% (docs/fp8.md, "Memory"). Rowwise linears are torchao's; they are planned
    as ours.
    """
    a, qdq = act_bytes, QDQ_WORK_BYTES
    x, dy = rows * in_features, rows * out_features
    w = max(experts, 1) * in_features * out_features
    if not experts:
        phases = (qdq * dy,  # dgrad: dY quantised
                  a * dy + qdq * w,  # W^T quantised, dY's copy held
                  a * (dy + w + x),  # the dgrad GEMM: both copies and dx
                  a * x + qdq * dy,  # wgrad: dY^T quantised, dx held
                  a * (x + dy) + qdq * x,  # x^T quantised
                  a * (2 * x + dy + w))  # the wgrad GEMM: both copies, dx and dW
    else:
        # the rowwise experts' wgrad quantises per expert segment: its working memory comes on top of its result
        wq = qdq if recipe == "blockwise" else qdq + a
        held = a * (dy + w)  # the zero-tailed dY and W^T's dequantised copy, held throughout
        phases = (a * dy + (a + qdq) * w,  # W^T: reshaped into a copy, then quantised
                  held + qdq * dy,  # dgrad: dY quantised
                  held + a * (dy + x),  # the dgrad GEMM
                  held + a * x + wq * dy,  # wgrad: dY^T quantised, dx held
                  held + a * (x + dy) + wq * x,  # x^T quantised
                  held + a * (dy + 2 * x + 2 * w),  # the wgrad GEMM, and dW with its empty experts zeroed
                  held + a * (dy + 3 * x + w))  # dx with its padding rows zeroed
    return max(phases) - a * (x + w)


# ----------------------------------------------------------------------------------------------- selection

def _blocks(model: nn.Module) -> list[nn.Module]:
    blocks = list(model.layers.values())
    if getattr(model, "mtp", None) is not None:
        blocks += [mod.block for mod in model.mtp.layers]
    return blocks


def _eligible(module: nn.Module) -> bool:
    """A plain linear (not the router's Fp32Linear) or a grouped-experts module that supports FP8."""
    return type(module) is nn.Linear or hasattr(module, QUANTIZED_MM)


def _matches(fqn: str, name: str) -> bool:
    """`name`'s dotted components appear as a contiguous run of `fqn`'s ("attention" ~ "attention.wq")."""
    return f".{name}." in f".{fqn}."


def fp8_block_modules(blocks: Iterable[nn.Module]) -> dict[str, nn.Module]:
    """Block-relative FQN -> one module with that name, of every FP8-eligible module in `blocks`."""
    found: dict[str, nn.Module] = {}
    for block in blocks:
        for fqn, module in block.named_modules():
            if fqn and _eligible(module):
                found.setdefault(fqn, module)
    return found


def is_selected(fqn: str, fp8_cfg) -> bool:
    """Whether the `[fp8]` filters convert the module with block-relative name `fqn` (when a recipe is on)."""
    return (any(_matches(fqn, n) for n in fp8_cfg.modules)
            and not any(_matches(fqn, n) for n in fp8_cfg.exclude_modules))


def fp8_flops_per_token(fp8_cfg, module_flops: Mapping[str, float]) -> float:
    """The training FLOPs per token that the `[fp8]` section runs as FP8 GEMMs: the sum over the modules its filters
    select of a model's {block-relative FQN: FLOPs per token} table (a `ModelSpec.module_flops`); 0 for recipe
    none."""
    if fp8_cfg.recipe == "none":
        return 0.0
    return sum(flops for fqn, flops in module_flops.items() if is_selected(fqn, fp8_cfg))


def _dims(module: nn.Module) -> tuple[int, ...]:
    if isinstance(module, nn.Linear):
        return (module.in_features, module.out_features)
    return tuple(module.w1.shape[1:])  # (hidden, dim) of every expert


def fp8_config_problem(fp8_cfg, blocks: Iterable[nn.Module], grouped_mm: bool = True,
                       vocabulary: Iterable[nn.Module] | None = None) -> tuple[str, str, str] | None:
    """The first mistake of the `[fp8]` section for a model with these blocks, as (key, problem, allowed).

    Names in `modules` and `exclude_modules` must each match an FP8-eligible module (a linear inside a block, or
    the routed experts; the embedding, the head, the router gate, the norms and the attention core always stay
    high precision) of the `vocabulary` blocks (default: `blocks`; a model family passes one block of every kind
    it can build, so that the default names stay valid for a model without, say, dense layers). With a recipe on,
    every selected module of `blocks` must have dims that are multiples of its tile (128 for blockwise, 16 for
    rowwise), the experts need the grouped GEMM, and rowwise linears need torchao.
    """
    known = fp8_block_modules(blocks if vocabulary is None else vocabulary)
    names = ", ".join(known)
    for key in ("modules", "exclude_modules"):
        for name in getattr(fp8_cfg, key):
            if not any(_matches(fqn, name) for fqn in known):
                return (f"fp8.{key}", f"{name!r} matches no linear or grouped experts inside the blocks (the router "
                        "gate, norms, attention core, embedding and head stay high precision)",
                        f"names or dotted parts of: {names}")
    if fp8_cfg.recipe == "none":
        return None
    align = BLOCK if fp8_cfg.recipe == "blockwise" else ROWWISE_ALIGN
    selected = {fqn: m for fqn, m in fp8_block_modules(blocks).items() if is_selected(fqn, fp8_cfg)}
    for fqn, module in selected.items():
        if any(d % align for d in _dims(module)):
            return ("fp8.modules", f"{fqn} has dims {_dims(module)}, not multiples of {align} as the "
                    f"{fp8_cfg.recipe} recipe needs", f"add {fqn!r} to fp8.exclude_modules, or recipe none")
    if not grouped_mm and any(not isinstance(m, nn.Linear) for m in selected.values()):
        return ("moe.use_grouped_mm", "false, but FP8 experts run on the grouped GEMM",
                "true with fp8.recipe != none, or exclude moe.experts in fp8.exclude_modules")
    needs_torchao = fp8_cfg.recipe == "rowwise" and any(isinstance(m, nn.Linear) for m in selected.values())
    if needs_torchao and importlib.util.find_spec("torchao") is None:
        return ("fp8.recipe", "rowwise linears run on torchao's Float8Linear, and torchao is not installed",
                "none or blockwise, or pip install '.[fp8]'")
    return None


@functools.cache
def _torchao_rowwise_config():
    from torchao.float8 import Float8LinearConfig  # optional dependency: only the rowwise recipe needs it

    return Float8LinearConfig.from_recipe_name("rowwise")


def _convert_linear(linear: nn.Linear, recipe: str) -> nn.Module:
    if recipe == "blockwise":
        return Fp8Linear.from_linear(linear)
    from torchao.float8.float8_linear import Float8Linear  # optional dependency, see _torchao_rowwise_config

    return Float8Linear.from_float(linear, config=_torchao_rowwise_config())


def apply_fp8(model: nn.Module, fp8_cfg) -> list[str]:
    """Convert the selected modules of every block of `model` (a model or pipeline stage) in place.

    Linears are replaced by an FP8 linear holding the same weight Parameter; grouped experts get an
    `Fp8GroupedMM` of the recipe as their quantized grouped GEMM. Returns the converted block-relative FQNs,
    prefixed by the block's key.
    A no-op returning [] for recipe "none".
    """
    if fp8_cfg.recipe == "none":
        return []
    converted = []
    for block_name, block in zip(_block_names(model), _blocks(model)):
        for fqn, module in list(block.named_modules()):
            if not (fqn and _eligible(module) and is_selected(fqn, fp8_cfg)):
                continue
            if isinstance(module, nn.Linear):
                parent_name, _, leaf = fqn.rpartition(".")
                parent = block.get_submodule(parent_name) if parent_name else block
                parent.register_module(leaf, _convert_linear(module, fp8_cfg.recipe))
            else:
                setattr(module, QUANTIZED_MM, Fp8GroupedMM(fp8_cfg.recipe))
            converted.append(f"{block_name}.{fqn}")
    logger.info("fp8 %s: %d modules converted (%s, ...)", fp8_cfg.recipe, len(converted),
                ", ".join(converted[:4]))
    return converted


def _block_names(model: nn.Module) -> list[str]:
    names = [f"layers.{k}" for k in model.layers]
    if getattr(model, "mtp", None) is not None:
        names += [f"mtp.layers.{i}.block" for i in range(len(model.mtp.layers))]
    return names
