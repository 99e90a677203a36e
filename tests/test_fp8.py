"""FP8 numerics (quantization/fp8/) against fp32 references, with bounds that e4m3 quantisation explains.

The bound used throughout. e4m3 keeps 3 mantissa bits: rounding a scaled value to nearest changes it by at most
2^-4 of itself in the normal range, and by at most 2^-10 (half the subnormal spacing 2^-9) below it, times the
tile's scale s < 2 amax / 448. So each quantised operand element is off by at most e = 2^-4 |t| + 2^-10 s, and
every element of a GEMM of quantised operands a^ b^T (accumulated in fp32) is off the exact a b^T by at most
    sum_k e_a |b^| + |a| e_b   (+ fp32 accumulation, K 2^-24 sum_k |a^||b^|).
The tiles in this bound are computed here independently of the implementation. Rounding errors of independent
elements average out: the normwise relative error of a GEMM of random operands stays near 2^-4 / sqrt(3) per
operand (about 0.04 for both), whatever K, far below the elementwise worst case.
"""

import collections
import json
import math

import pytest
import torch

from quantization.fp8.gemms import Fp8GroupedMM, Fp8Linear, fp8_grouped_mm
from quantization.fp8.quantize import (E4M3_MAX, dequantize, dequantize_row_segments, quantize,
                                       quantize_row_segments)

U = 2.0 ** -4


def _e4m3_values(n: int, gen: torch.Generator) -> torch.Tensor:
    """n finite e4m3 values (all bit patterns but NaN), as fp32."""
    bits = torch.randint(0, 256, (n,), generator=gen, dtype=torch.uint8)
    vals = bits.view(torch.float8_e4m3fn).float()
    return torch.where(torch.isnan(vals), 0.0, vals)


def _tile_amax(t: torch.Tensor, tile_rows: int, tile_cols: int) -> torch.Tensor:
    """Per-element amax of the element's tile, by explicit loops over the tiles (the independent reference)."""
    out = torch.empty_like(t)
    for r in range(0, t.shape[0], tile_rows):
        for c in range(0, t.shape[1], tile_cols):
            out[r:r + tile_rows, c:c + tile_cols] = t[r:r + tile_rows, c:c + tile_cols].abs().max()
    return out


def _elem_error(t: torch.Tensor, tile_rows: int, tile_cols: int) -> torch.Tensor:
    return U * t.abs() + 2.0 ** -10 * (2 * _tile_amax(t, tile_rows, tile_cols) / E4M3_MAX)


def _gemm_bound(a, ea, b, eb):
    """Elementwise bound on |a^ b^^T - a b^T| for a [M, K], b [N, K] with element errors ea, eb."""
    b_hat = b.abs() + eb
    acc = a.shape[1] * 2.0 ** -24 * (a.abs() + ea) @ b_hat.t()
    return ea @ b_hat.t() + a.abs() @ eb.t() + acc


def _assert_within(got, want, bound, name):
    excess = (got - want).abs() - bound
    assert excess.max() <= 0, f"{name}: error exceeds the quantisation bound by {excess.max():.3g}"


def _rel(got, want) -> float:
    return ((got - want).norm() / want.norm()).item()


# ----------------------------------------------------------------------------------------------- quantisation

@pytest.mark.parametrize("shape, tile", [((256, 384), (1, 128)), ((256, 384), (128, 128)), ((200, 300), (1, 128)),
                                         ((200, 300), (128, 128)), ((96, 256), (1, 256))],
                         ids=["1x128", "128x128", "1x128_partial", "128x128_partial", "rowwise"])
def test_round_trip_exact_on_block_boundaries(shape, tile):
    """Tiles of e4m3 values times a power of two (a different one per tile, 2^-40 .. 2^40) round-trip exactly:
    each tile's scale is chosen from its own amax only, and power-of-two scales make the scaling exact."""
    gen = torch.Generator().manual_seed(0)
    R, C = shape
    t = _e4m3_values(R * C, gen).view(R, C)
    tiles_r, tiles_c = math.ceil(R / tile[0]), math.ceil(C / tile[1])
    exps = torch.randint(-40, 41, (tiles_r, tiles_c), generator=gen).float()
    t = t * torch.exp2(exps).repeat_interleave(tile[0], 0)[:R].repeat_interleave(tile[1], 1)[:, :C]
    t[:tile[0], :tile[1]] = 0  # an all-zero tile
    q, scale = quantize(t, *tile)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (tiles_r, tiles_c)
    assert torch.equal(dequantize(q, scale, *tile), t)
    assert torch.equal(dequantize(q, scale, *tile, dtype=torch.bfloat16).float(), t)  # exact in bf16 too
    # scales are powers of two that put each tile's amax in (224, 448]
    assert torch.equal(torch.frexp(scale)[0], torch.full_like(scale, 0.5))
    tile_amax = _tile_amax(t, *tile)[::tile[0], ::tile[1]]
    nonzero = tile_amax > 0
    ratio = tile_amax[nonzero] / scale[nonzero]
    assert ratio.max() <= E4M3_MAX and ratio.min() > E4M3_MAX / 2
    assert scale[0, 0] == 1.0  # the zero tile


def test_power_of_two_scales_from_the_bits_match_their_definition():
    """The scale rule (computed on amax's bits, so that a compiler cannot approximate it) against its definition
    in float64, element by element: the smallest power of two s >= 2^-126 with amax / s <= 448, and 1 / s exactly;
    boundaries (448 * 2^k and its neighbours, 1.75 * 2^k), zero, subnormal and huge amax, random magnitudes."""
    from quantization.fp8.quantize import _pow2_scales

    gen = torch.Generator().manual_seed(0)
    k = torch.randint(-100, 100, (300,), generator=gen).float()
    edges = torch.cat([448 * torch.exp2(k), 1.75 * torch.exp2(k)])
    special = torch.tensor([0.0, 1e-45, 1e-40, 2.0 ** -126, 3e-36, 1.0, 448.0, 449.0, 3.3e38])
    random = torch.rand(20000, generator=gen) * 10 ** torch.randint(-30, 30, (20000,), generator=gen).float()
    amax = torch.cat([special, edges, torch.nextafter(edges, torch.zeros(())), torch.nextafter(edges, edges * 2),
                      random])
    scale, inverse = _pow2_scales(amax)
    a = amax.double()
    want = torch.exp2(torch.ceil(torch.log2(a / 448)).clamp_min(-126))
    want = torch.where(a / (want / 2) <= 448, want / 2, want).clamp_min(2.0 ** -126)  # log2's rounding, both ways
    want = torch.where(a / want > 448, want * 2, want)
    want = torch.where(a > 0, want, 1.0)
    assert torch.equal(scale.double(), want)
    assert torch.equal(inverse.double(), 1 / want)


def test_e4m3_decoding_and_the_quantise_dequantise_give_torchs_values():
    """`e4m3_to` (integer ops to fp16 on CPU) against torch's own conversion for all 256 codes: bit for bit for
    every number (signed zeros, subnormals), NaN for both NaN codes; and the emulation's quantise-dequantise against
    torch's conversion of `quantize`'s e4m3 values times their scales, on values with zeros, subnormal results, an
    infinity and a NaN."""
    from quantization.fp8.quantize import E4M3, e4m3_to, qdq_activation, qdq_weight

    codes = torch.arange(256, dtype=torch.uint8).view(E4M3)
    for dtype, bits in ((torch.float32, torch.int32), (torch.bfloat16, torch.int16)):
        want, got = codes.to(dtype), e4m3_to(codes, dtype)
        nan = want.isnan()
        assert nan.sum() == 2 and torch.equal(got.isnan(), nan)
        assert torch.equal(got[~nan].view(bits), want[~nan].view(bits))

    gen = torch.Generator().manual_seed(0)
    t = torch.randn(256, 384, generator=gen) * 10.0 ** torch.randint(-8, 8, (256, 1), generator=gen)
    t[0, :130] = 0.0
    t[1, 5] = 1e5  # the other values of its tile fall to e4m3 subnormals and zero
    t[2, 7], t[3, 9] = float("inf"), float("nan")
    for dtype in (torch.float32, torch.bfloat16):
        for tiles, got in (((1, 128), qdq_activation(t, "blockwise", dtype)),
                           ((128, 128), qdq_weight(t, "blockwise", dtype)),
                           ((1, 384), qdq_activation(t, "rowwise", dtype))):
            q, scale = quantize(t, *tiles)
            want = (q.float().view(-1, tiles[0], 384 // tiles[1], tiles[1]) * scale[:, None, :, None]).view(t.shape)
            assert torch.equal(got.isnan(), want.isnan()), (dtype, tiles)
            assert torch.equal(got.nan_to_num(), want.to(dtype).nan_to_num()), (dtype, tiles)


def test_round_trip_error_bound_on_random_values():
    """Arbitrary values: every element within the per-element bound 2^-4 |t| + 2^-10 s."""
    t = torch.randn(256, 512, generator=torch.Generator().manual_seed(1)) * torch.logspace(-3, 3, 512)
    q, scale = quantize(t, 1, 128)
    _assert_within(dequantize(q, scale, 1, 128), t, _elem_error(t, 1, 128), "1x128 round trip")


def test_row_segment_quantisation_is_per_column_and_segment():
    """`quantize_row_segments`: t^T with one scale per column of t and segment of its rows (whole 128-row tiles,
    a segment of two tiles among them), each segment quantised as if alone, so a segment of much larger values costs
    the others no precision; the result is laid out [C, P] row-major, the operand the weight gradient takes."""
    t = torch.randn(512, 10, generator=torch.Generator().manual_seed(2))
    t[128:384] *= 1e6
    t[200, 3] = -3e7  # the largest magnitude of its segment is negative, in the segment's second tile
    # all 512 rows, then 300 (a partial last tile, padded inside: the last segment ends within it)
    for P, segments in ((512, [0] * 128 + [1] * 256 + [2] * 128), (300, [0] * 128 + [1] * 172)):
        seg = torch.tensor(segments)
        q, scale = quantize_row_segments(t[:P], seg, 3)
        assert q.shape == (10, P) and q.is_contiguous() and scale.shape == (3, 10)
        back = dequantize_row_segments(q, scale, seg)
        for s in range(seg.max().item() + 1):
            rows = (seg == s).nonzero().flatten()
            part = t[rows].t()
            ref_q, ref_s = quantize(part, 1, part.shape[1])
            assert torch.equal(back[:, rows], dequantize(ref_q, ref_s, 1, part.shape[1])), (P, s)


# ----------------------------------------------------------------------------------------------- blockwise linear

def _linear_case(M=96, K=256, N=384, seed=3):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=gen)
    w = torch.randn(N, K, generator=gen) * 0.05
    dy = torch.randn(M, N, generator=gen)
    return x, w, dy


def test_blockwise_linear_within_quantisation_bound():
    """Output, input gradient and weight gradient of Fp8Linear (blockwise) against fp32, each within the bound of
    its own GEMM: forward x 1x128 / W 128x128 along K; dgrad dY 1x128 along N / W^T 128x128; wgrad dY^T and x^T
    in 1x128 tiles along the tokens (M = 96: one partial tile)."""
    x, w, dy = _linear_case()
    lin = Fp8Linear.from_linear(torch.nn.Linear(256, 384, bias=False))
    with torch.no_grad():
        lin.weight.copy_(w)
    xq = x.clone().requires_grad_()
    y = lin(xq)
    y.backward(dy)

    _assert_within(y, x @ w.t(), _gemm_bound(x, _elem_error(x, 1, 128), w, _elem_error(w, 128, 128)), "forward")
    wt = w.t().contiguous()
    _assert_within(xq.grad, dy @ w, _gemm_bound(dy, _elem_error(dy, 1, 128), wt, _elem_error(wt, 128, 128)),
                   "dgrad")
    dyt, xt = dy.t().contiguous(), x.t().contiguous()
    _assert_within(lin.weight.grad, dyt @ x, _gemm_bound(dyt, _elem_error(dyt, 1, 128), xt, _elem_error(xt, 1, 128)),
                   "wgrad")
    # and the errors average: normwise relative errors near 0.04, not the elementwise worst case
    for got, want in ((y, x @ w.t()), (xq.grad, dy @ w), (lin.weight.grad, dyt @ x)):
        assert 0 < _rel(got, want) < U


def test_blockwise_linear_under_autocast_and_3d_input():
    x, w, _ = _linear_case(M=64)
    lin = Fp8Linear.from_linear(torch.nn.Linear(256, 384, bias=False))
    with torch.no_grad():
        lin.weight.copy_(w)
    x3 = x.view(4, 16, 256)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = lin(x3)
    assert y.dtype == torch.bfloat16 and y.shape == (4, 16, 384)
    # dequantised e4m3 operands are exact in bf16 and the bf16 GEMM accumulates in fp32: the autocast run is the
    # fp32 run on bf16-rounded inputs and weight, up to the rounding of its output to bf16 (2^-9 relative)
    with torch.no_grad():
        lin.weight.copy_(w.bfloat16().float())
    y32 = lin(x3.bfloat16().float())
    assert ((y.float() - y32).abs() <= 2 ** -8 * y32.abs()).all()


def test_blockwise_linear_is_deterministic_for_recompute():
    """Quantising again (activation-checkpoint recompute, or backward re-quantising W) gives the same bits."""
    x, w, dy = _linear_case(M=32)
    lin = Fp8Linear.from_linear(torch.nn.Linear(256, 384, bias=False))
    with torch.no_grad():
        lin.weight.copy_(w)
    outs = []
    for _ in range(2):
        lin.weight.grad = None
        y = lin(x)
        y.backward(dy)
        outs.append((y.detach(), lin.weight.grad.clone()))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


# ----------------------------------------------------------------------------------------------- grouped experts

def _grouped_case(recipe_seed=4, tail_rows=16):
    """Three experts with 130, 0 and 5 rows, each group padded with zero rows to a multiple of 128, then
    `tail_rows` rows past the last group (non-zero: they must be ignored)."""
    gen = torch.Generator().manual_seed(recipe_seed)
    K, N, counts = 256, 128, [130, 0, 5]
    padded = [math.ceil(c / 128) * 128 for c in counts]
    starts = [sum(padded[:e]) for e in range(3)]
    P = sum(padded) + tail_rows
    x = torch.zeros(P, K)
    for e, c in enumerate(counts):
        # expert 0's rows are 1000x larger: a token tile straddling two experts would drown expert 2's values
        x[starts[e]:starts[e] + c] = torch.randn(c, K, generator=gen) * (1000.0 if e == 0 else 1.0)
    x[sum(padded):] = torch.randn(tail_rows, K, generator=gen)
    w = torch.randn(3, N, K, generator=gen) * 0.05
    # an outlier input channel: dgrad must scale W^T along N (per column of W), not along K (per row of W), or
    # the other channels of each row fall below e4m3's normal range
    w[:, :, 0] *= 1e6
    dy = torch.randn(P, N, generator=gen)
    offs = torch.tensor([s + p for s, p in zip(starts, padded)], dtype=torch.int32)
    return x, w, dy, offs, counts, starts


@pytest.mark.parametrize("recipe", ["blockwise", "rowwise"])
def test_fp8_grouped_mm_within_bound_zero_token_expert_and_padding(recipe):
    x, w, dy, offs, counts, starts = _grouped_case()
    xq, wq = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = fp8_grouped_mm(xq, wq, offs, recipe)
    y.backward(dy)
    end = int(offs[-1])
    # rows past the last group: zero output, zero gradient
    assert torch.equal(y[end:], torch.zeros_like(y[end:])) and torch.equal(xq.grad[end:], torch.zeros_like(x[end:]))
    assert torch.equal(wq.grad[1], torch.zeros_like(w[1]))  # the expert with no tokens
    for e, c in enumerate(counts):
        rows = slice(starts[e], int(offs[e]))  # the group with its zero padding rows
        if c == 0:
            continue
        xe, dye, we = x[rows], dy[rows], w[e]
        # tiles along each GEMM's K: forward K = 256, dgrad K = N = 128, wgrad K = the group's (padded) rows
        if recipe == "blockwise":
            act, weight, weight_t, tok = (1, 128), (128, 128), (128, 128), (1, 128)
        else:
            act, weight, weight_t, tok = (1, 256), (1, 256), (1, 128), (1, xe.shape[0])
        _assert_within(y[rows], xe @ we.t(), _gemm_bound(xe, _elem_error(xe, *act), we, _elem_error(we, *weight)),
                       f"forward e{e}")
        wet = we.t().contiguous()
        _assert_within(xq.grad[rows], dye @ we, _gemm_bound(dye, _elem_error(dye, 1, 128), wet,
                                                            _elem_error(wet, *weight_t)), f"dgrad e{e}")
        dyt, xt = dye.t().contiguous(), xe.t().contiguous()
        _assert_within(wq.grad[e], dyt @ xe, _gemm_bound(dyt, _elem_error(dyt, *tok), xt, _elem_error(xt, *tok)),
                       f"wgrad e{e}")
        assert _rel(wq.grad[e], dyt @ xe) < U


@pytest.mark.parametrize("recipe", ["blockwise", "rowwise"])
def test_grouped_experts_fp8_against_fp32_loop(recipe):
    """The SwiGLU experts (three grouped GEMMs) with a zero-token expert and padding rows past sum(counts),
    against the fp32 per-expert loop. Normwise relative errors of output and gradients below 2^-3: one GEMM of
    two quantised operands is off by about 0.04 (see the module docstring); the gate and up GEMMs' errors both
    enter the SwiGLU product (about 0.06 together), the down GEMM adds its own in quadrature (about 0.075), and
    backward chains as many. Measured: 0.067 (output), 0.07-0.08 (gradients), for both recipes: e4m3 is a float
    format, so a coarser tile changes the error only for values it pushes below the normal range (2^-6)."""
    from models.deepseek_v3.moe import GroupedExperts

    gen = torch.Generator().manual_seed(5)
    experts = GroupedExperts(dim=256, hidden_dim=128, num_experts=4, use_grouped_mm=True)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    reference = GroupedExperts(dim=256, hidden_dim=128, num_experts=4, use_grouped_mm=False)
    reference.load_state_dict(experts.state_dict())
    experts.quantized_mm = Fp8GroupedMM(recipe)
    counts = torch.tensor([150, 0, 37, 60])
    # channels of unequal magnitude (as activations have), so 1x128 tiles and whole rows get different scales
    x = torch.randn(int(counts.sum()) + 9, 256, generator=gen) * torch.logspace(-1, 1, 256)
    x[int(counts.sum()):] = 0  # padding rows, as a dispatcher leaves them
    dy = torch.randn(x.shape[0], 256, generator=gen)
    dy[int(counts.sum()):] = 0

    outs = []
    for module in (experts, reference):
        xi = x.clone().requires_grad_()
        y = module(xi, counts, padded=True)
        y.backward(dy)
        outs.append((y, xi.grad, [p.grad for p in module.parameters()]))
    (y, dx, dws), (y_ref, dx_ref, dws_ref) = outs
    assert torch.equal(y[int(counts.sum()):], torch.zeros_like(y[int(counts.sum()):]))
    assert _rel(y, y_ref) < 2 * U and _rel(dx, dx_ref) < 2 * U
    for dw, dw_ref in zip(dws, dws_ref):
        assert torch.equal(dw[1], torch.zeros_like(dw[1]))  # no tokens, no gradient
        assert _rel(dw, dw_ref) < 2 * U


# ----------------------------------------------------------------------------------------------- model conversion

def _tiny_model(recipe: str, ac_mode: str = "none", extra: list[str] = ()):
    """A 2-layer debug model (one dense, one MoE block) with the [fp8] and AC sections applied, initialised."""
    from models.deepseek_v3.args import FLAVORS
    from models.deepseek_v3.model import DeepSeekV3Model
    from models.deepseek_v3.parallelize import MODULE_DEFAULTS, checkpoint_model, named_blocks
    from quantization.fp8.config import fp8_selection
    from quantization.fp8.convert import apply_fp8
    from trainer.job_config import load_config

    cfg = load_config(["--fp8.recipe", recipe, "--activation_checkpoint.mode", ac_mode, *extra])
    with torch.device("meta"):
        model = DeepSeekV3Model(FLAVORS["debugmodel"].replace(n_layers=2))
    converted = apply_fp8(named_blocks(model), fp8_selection(cfg.fp8, MODULE_DEFAULTS))
    checkpoint_model(model, cfg.activation_checkpoint)
    model.to_empty(device="cpu")
    model.init_weights(buffer_device=torch.device("cpu"), seed=0)
    return model, converted


def _loss_and_grads(model, seed=0):
    tokens = torch.randint(0, 2048, (2, 65), generator=torch.Generator().manual_seed(seed))
    logits = model(tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    return loss.detach(), {n.replace("_checkpoint_wrapped_module.", ""): p.grad.clone()
                           for n, p in model.named_parameters()}


def test_conversion_keeps_names_and_high_precision_modules():
    from models.deepseek_v3.moe import Fp32Linear

    model, converted = _tiny_model("blockwise")
    plain, none_converted = _tiny_model("none")
    assert none_converted == [] and model.state_dict().keys() == plain.state_dict().keys()
    assert "layers.0.attention.wq" in converted and "layers.1.moe.experts" in converted
    blocks = {name: type(m) for name, m in model.named_modules()}
    assert blocks["layers.0.attention.wq"] is Fp8Linear and blocks["layers.1.moe.shared_experts.w2"] is Fp8Linear
    assert blocks["layers.0.attention.wkv_a"] is torch.nn.Linear  # excluded by default (576 outputs)
    assert blocks["output"] is torch.nn.Linear and blocks["layers.1.moe.router.gate"] is Fp32Linear
    assert model.layers["1"].moe.experts.quantized_mm.recipe == "blockwise"
    assert plain.layers["1"].moe.experts.quantized_mm is None
    assert all(type(m) is not Fp8Linear for m in plain.modules())


@pytest.mark.parametrize("ac_mode", ["full", "selective"])
def test_activation_checkpoint_recompute_requantises_identically(ac_mode):
    """A checkpointed FP8 model recomputes the same e4m3 operands: loss and every gradient equal bit for bit."""
    loss, grads = _loss_and_grads(_tiny_model("blockwise")[0])
    loss_ac, grads_ac = _loss_and_grads(_tiny_model("blockwise", ac_mode)[0])
    assert torch.equal(loss, loss_ac)
    assert grads.keys() == grads_ac.keys()
    for name, g in grads.items():
        assert torch.equal(g, grads_ac[name]), name


def test_fp8_model_close_to_high_precision():
    """One forward and backward of the whole model: loss within 1% and the gradient norm within 10% of fp32."""
    loss, grads = _loss_and_grads(_tiny_model("none")[0])
    loss8, grads8 = _loss_and_grads(_tiny_model("blockwise")[0])
    assert abs(loss8 / loss - 1) < 0.01
    norm = torch.stack([g.norm() for g in grads.values()]).norm()
    norm8 = torch.stack([g.norm() for g in grads8.values()]).norm()
    assert abs(norm8 / norm - 1) < 0.1


def test_rowwise_without_torchao_is_a_config_problem(monkeypatch):
    import importlib.util

    from models.deepseek_v3.args import FLAVORS
    from models.deepseek_v3.model import TransformerBlock
    from models.deepseek_v3.parallelize import MODULE_DEFAULTS
    from quantization.fp8.config import fp8_config_problem, fp8_selection
    from trainer.job_config import load_config

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with torch.device("meta"):
        blocks = [TransformerBlock(i, FLAVORS["debugmodel"]) for i in (0, 1)]  # dense, MoE
    cfg = load_config(["--fp8.recipe", "rowwise"])
    key, problem, _ = fp8_config_problem(fp8_selection(cfg.fp8, MODULE_DEFAULTS), blocks)
    assert key == "fp8.recipe" and "torchao" in problem
    # experts only: no torchao needed
    cfg = load_config(["--fp8.recipe", "rowwise", "--fp8.modules", "moe.experts"])
    assert fp8_config_problem(fp8_selection(cfg.fp8, MODULE_DEFAULTS), blocks) is None


def test_fp8_flops_are_those_of_the_selected_modules():
    """The FP8 share of a model's per-module FLOPs table follows the [fp8] filters as apply_fp8 does; none: 0."""
    from models.deepseek_v3.args import FLAVORS
    from models.deepseek_v3.flops import block_flops_per_token
    from models.deepseek_v3.parallelize import MODULE_DEFAULTS
    from quantization.fp8.accounting import fp8_flops_per_token
    from quantization.fp8.config import fp8_selection
    from trainer.job_config import load_config

    def selection(args):
        return fp8_selection(load_config(args).fp8, MODULE_DEFAULTS)

    table = block_flops_per_token(FLAVORS["debugmodel"])
    linears = sum(f for fqn, f in table.items() if fqn != "moe.experts")
    default = selection(["--fp8.recipe", "blockwise"])  # everything but attention.wkv_a
    assert fp8_flops_per_token(default, table) == sum(table.values()) - table["attention.wkv_a"]
    experts = selection(["--fp8.recipe", "rowwise", "--fp8.modules", "moe.experts"])
    assert fp8_flops_per_token(experts, table) == table["moe.experts"]
    no_experts = selection(["--fp8.recipe", "blockwise", "--fp8.exclude_modules", "experts"])
    assert fp8_flops_per_token(no_experts, table) == linears
    assert fp8_flops_per_token(selection([]), table) == 0


def test_rowwise_linears_are_torchaos_within_bound():
    """torchao's rowwise Float8Linear, as apply_fp8 converts it: forward and both gradients within the bound of
    one scale per row along each GEMM's K (so the wgrad tiles span all the tokens)."""
    pytest.importorskip("torchao")
    from quantization.fp8.convert import _convert_linear
    from quantization.fp8.kernels import Platform

    if not Platform.detect("cpu").cpu_rowwise_scaled_mm:
        pytest.skip(f"torch {torch.__version__}'s CPU _scaled_mm takes no rowwise scales: rowwise linears run the "
                    "emulation here (test_kernel_choice_by_shape_dtype_and_optional_dependencies)")

    x, w, dy = _linear_case(M=64)
    lin = torch.nn.Linear(256, 384, bias=False)
    with torch.no_grad():
        lin.weight.copy_(w)
    lin = _convert_linear(lin, "rowwise")
    assert type(lin).__name__ == "Float8Linear"
    xq = x.clone().requires_grad_()
    y = lin(xq)
    y.backward(dy)
    _assert_within(y, x @ w.t(), _gemm_bound(x, _elem_error(x, 1, 256), w, _elem_error(w, 1, 256)), "forward")
    wt = w.t().contiguous()
    _assert_within(xq.grad, dy @ w, _gemm_bound(dy, _elem_error(dy, 1, 384), wt, _elem_error(wt, 1, 384)), "dgrad")
    dyt, xt = dy.t().contiguous(), x.t().contiguous()
    _assert_within(lin.weight.grad, dyt @ x, _gemm_bound(dyt, _elem_error(dyt, 1, 64), xt, _elem_error(xt, 1, 64)),
                   "wgrad")


@pytest.mark.slow
def test_checkpoint_holds_master_weights_and_resumes_with_another_recipe(tmp_path):
    """A blockwise run's checkpoint has exactly the keys of a high-precision one, and a run resumes from it with
    recipe none (and would with any other)."""
    from torch.distributed.checkpoint import FileSystemReader

    from trainer.job_config import load_config
    from trainer.train import run

    base = ["--job.config_file", "train_configs/debug_model.toml", "--training.seq_len", "32",
            "--training.local_batch_size", "2", "--memory.track", "off", "--validation.enable", "false",
            "--metrics.enable_tensorboard", "false", "--checkpoint.enable", "true", "--checkpoint.interval", "1",
            "--job.dump_folder", str(tmp_path)]
    run(load_config(base + ["--fp8.recipe", "blockwise", "--training.steps", "1"]))
    losses = run(load_config(base + ["--fp8.recipe", "none", "--training.steps", "2"]))
    assert len(losses) == 1 and math.isfinite(losses[0])  # resumed at step 2

    def keys(step):
        return set(FileSystemReader(str(tmp_path / "checkpoint" / f"step-{step}")).read_metadata()
                   .state_dict_metadata)

    assert keys(1) == keys(2)


@pytest.mark.slow
def test_compiled_fp8_gemms_match_eager():
    """torch.compile (inductor, fullgraph) of the blockwise linear (fp32) and the FP8 grouped GEMM (bf16, the
    dtype compiled experts run in): output and both gradients equal eager bit for bit."""
    x, w, dy = _linear_case(M=64)
    lin = Fp8Linear.from_linear(torch.nn.Linear(256, 384, bias=False))
    wg = torch.randn(2, 128, 256, dtype=torch.bfloat16) * 0.05
    xg = torch.randn(384, 256, dtype=torch.bfloat16)  # the padded layout: 128-row groups, rows past the last
    offs = torch.tensor([128, 256], dtype=torch.int32)

    def grouped(a, b):
        return fp8_grouped_mm(a, b, offs, "blockwise")

    results = []
    for compiled in (False, True):
        lin_fn = torch.compile(lin, fullgraph=True) if compiled else lin
        grouped_fn = torch.compile(grouped, fullgraph=True) if compiled else grouped
        xi, xgi, wgi = (t.clone().requires_grad_() for t in (x, xg, wg))
        lin.weight.grad = None
        y = lin_fn(xi)
        y.backward(dy)
        yg = grouped_fn(xgi, wgi)
        yg.float().sum().backward()
        results.append([y, xi.grad, lin.weight.grad.clone(), yg, xgi.grad, wgi.grad])
    for eager, compiled in zip(*results):
        assert torch.equal(eager, compiled)


def test_default_names_valid_for_a_model_without_dense_layers():
    """The default filters name feed_forward; a model with no dense layer must still pass, recipe off or on, while
    a name that matches no block of either kind is refused."""
    from core.config import ConfigError
    from models.deepseek_v3 import build_args
    from trainer.job_config import load_config, model_job

    def args_of(*extra):
        return build_args(model_job(load_config(["--model.n_dense_layers", "0", *extra])))

    for recipe in ("none", "blockwise"):
        assert args_of("--fp8.recipe", recipe).n_dense_layers == 0
        assert args_of("--fp8.recipe", recipe, "--fp8.modules", "feed_forward,moe").n_dense_layers == 0
        with pytest.raises(ConfigError, match="fp8.modules: 'ffn' matches no linear"):
            args_of("--fp8.recipe", recipe, "--fp8.modules", "ffn")


def test_fp8_curves_benchmark_smoke(capsys):
    """benchmarks/fp8_curves.py on 2 tiny steps: the FP8 run starts from the same weights and batch (step-1 loss
    within 1% of none's, yet not equal: the GEMMs did take e4m3 inputs) and reports a validation loss."""
    from benchmarks.fp8_curves import main

    report = main(["--steps", "2", "--seq-len", "32", "--recipes", "none,blockwise", "--val-steps", "1"])
    none, fp8 = report["runs"]["none"], report["runs"]["blockwise"]
    assert none["loss"][0] != fp8["loss"][0] and abs(fp8["loss"][0] / none["loss"][0] - 1) < 0.01
    assert math.isfinite(fp8["final_val_loss"])
    assert report["final_val_loss_rel_diff"]["blockwise"] == pytest.approx(
        fp8["final_val_loss"] / none["final_val_loss"] - 1)


# ----------------------------------------------------------------------------------------------- memory

def _backward_peak_beyond_gradients(fn, inputs, grads_bytes: int) -> int:
    """Peak bytes of `fn`'s backward (exact tracker, from the end of its forward) beyond the two gradients that a
    high-precision GEMM's backward allocates."""
    from trainer.memory.tracker import _StepMemTracker

    cpu = torch.device("cpu")
    tracker = _StepMemTracker()
    tracker.track_external(*inputs)
    with tracker:
        y = fn()
        dy = torch.randn_like(y)
        tracker.reset_peak()
        before = tracker.get_tracker_snapshot("current")[cpu]["Total"]
        y.backward(dy)
        return tracker.get_tracker_snapshot("peak")[cpu]["Total"] - before - grads_bytes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weight", ["parameter", "cast_copy", "gathered"])
def test_backward_memory_of_fp8_gemms_is_what_the_memory_plan_adds(dtype, weight):
    """`gemm_backward_extra_bytes` (the memory plan's FP8 term) against the exact tracker: linears whose largest
    operand is dY, x or the weight, and grouped experts of both recipes, within 1% (the scales and offsets); with
    the weight the parameter itself, a copy cast for the call (blockwise then saves its forward's quantised weight
    and quantises no W^T), and blocks FSDP gathered (`fsdp_all_gather`: dequantised for the dgrad)."""
    from quantization.fp8.accounting import gemm_backward_extra_bytes
    from quantization.fp8.fsdp_all_gather import Fp8WeightBlocks
    from quantization.fp8.gemms import _EMULATED_LINEAR, _Fp8GroupedMMFn, _Fp8LinearFn
    from quantization.fp8.quantize import quantize_weight_blocks

    a = torch.finfo(dtype).bits // 8
    cast, gathered = weight == "cast_copy", weight == "gathered"
    gen = torch.Generator().manual_seed(0)

    def inputs(*shape):
        """(the weight the GEMM takes, its blocks' inputs, the tensors it holds)"""
        w = torch.randn(*shape, generator=gen, dtype=dtype)
        if not gathered:
            return w.requires_grad_(), (), [w]
        q, scale = quantize_weight_blocks(w)
        return torch.nn.Parameter(Fp8WeightBlocks(q, scale, dtype)), (q, scale), [q, scale]

    for M, K, N in ((1024, 256, 1024), (1024, 1024, 256), (256, 1024, 1024)):
        x = torch.randn(M, K, generator=gen, dtype=dtype).requires_grad_()
        w, blocks, held = inputs(N, K)
        got = _backward_peak_beyond_gradients(
            lambda: _Fp8LinearFn.apply(x, w, "blockwise", _EMULATED_LINEAR, cast, *blocks), [x, *held],
            a * (M * K + N * K))
        want = gemm_backward_extra_bytes("blockwise", M, K, N, a, weight_kept=cast, weight_gathered=gathered)
        assert got == pytest.approx(want, rel=0.01), (M, K, N)
    E, K, N, P = 8, 256, 384, 4096
    offs = torch.arange(1, E + 1, dtype=torch.int32) * (P // E)
    for recipe in ("blockwise",) if gathered else ("blockwise", "rowwise"):
        x = torch.randn(P, K, generator=gen, dtype=dtype).requires_grad_()
        w, blocks, held = inputs(E, N, K)
        got = _backward_peak_beyond_gradients(
            lambda: _Fp8GroupedMMFn.apply(x, w, offs, recipe, "emulated", None, cast, *blocks), [x, *held, offs],
            a * (P * K + E * N * K))
        want = gemm_backward_extra_bytes(recipe, P, K, N, a, E, weight_kept=cast and recipe == "blockwise",
                                         weight_gathered=gathered)
        assert got == pytest.approx(want, rel=0.01), recipe


# ----------------------------------------------------------------------------------------------- kernels

def _platform(capability, **deps):
    from quantization.fp8.kernels import Platform

    base = dict(blockwise_scaled_mm=True, scaled_grouped_mm=True, torchao=True, deep_gemm=False, torch_version="2.11")
    if capability:
        return Platform("cuda", capability, **{**base, **deps})
    return Platform("cpu", **{**dict(torchao=True, cpu_rowwise_scaled_mm=True), **deps})


@pytest.mark.parametrize("capability, linear, wgrad, rowwise_linear, rowwise_experts, blockwise_experts", [
    (None, "emulated", "emulated", "torchao Float8Linear", "emulated", "emulated"),  # no CUDA
    ((8, 0), "emulated", "emulated", "emulated", "emulated", "emulated"),  # A100: no FP8 tensor cores
    ((8, 9), "emulated", "emulated", "torchao Float8Linear", "emulated", "emulated"),  # L40: _scaled_mm only
    ((9, 0), "scaled_mm BlockWise1x128 x BlockWise128x128", "scaled_mm BlockWise1x128 x BlockWise1x128",
     "torchao Float8Linear", "_scaled_grouped_mm rowwise", "scaled_mm per expert"),
    ((10, 0), "emulated", "emulated", "torchao Float8Linear", "emulated", "emulated"),  # B200: not yet run there
], ids=["cpu", "sm80", "sm89", "sm90", "sm100"])
def test_kernel_choice_by_capability(capability, linear, wgrad, rowwise_linear, rowwise_experts, blockwise_experts):
    from quantization.fp8.kernels import blockwise_linear_kernels, grouped_kernel, rowwise_linear_kernel

    p = _platform(capability)
    k = blockwise_linear_kernels(p, torch.bfloat16, 8192, 2048, 3072)
    assert (k.fwd, k.dgrad, k.wgrad) == (linear, linear, wgrad)
    assert rowwise_linear_kernel(p) == rowwise_linear
    assert grouped_kernel(p, "rowwise", torch.bfloat16, 2048, 1408) == rowwise_experts
    assert grouped_kernel(p, "blockwise", torch.bfloat16, 2048, 1408) == blockwise_experts


def test_kernel_choice_by_shape_dtype_and_optional_dependencies():
    from quantization.fp8.kernels import (DEEPGEMM, EMULATED, PER_EXPERT, SCALED_MM_BLOCKS, blockwise_linear_kernels,
                                          grouped_kernel, rowwise_linear_kernel)

    h100 = _platform((9, 0))
    # tokens not a multiple of 128: only the weight gradient (its tiles run along the tokens) falls back
    k = blockwise_linear_kernels(h100, torch.bfloat16, 8190, 2048, 3072)
    assert (k.fwd, k.dgrad, k.wgrad) == (SCALED_MM_BLOCKS, SCALED_MM_BLOCKS, EMULATED)
    # a weight dim not a multiple of 128 (wkv_a's 576 outputs), or fp32 compute: all three emulated
    for dtype, n in ((torch.bfloat16, 576), (torch.float32, 3072)):
        assert set(vars(blockwise_linear_kernels(h100, dtype, 8192, 2048, n)).values()) == {EMULATED}
    assert grouped_kernel(h100, "blockwise", torch.bfloat16, 2048, 1376) == EMULATED  # 1376 = 86 x 16
    assert grouped_kernel(h100, "rowwise", torch.bfloat16, 2048, 1376) == "_scaled_grouped_mm rowwise"
    assert grouped_kernel(h100, "rowwise", torch.bfloat16, 2048, 1400) == EMULATED  # not a multiple of 16
    assert grouped_kernel(h100, "rowwise", torch.float32, 2048, 1408) == EMULATED
    # optional dependencies and the torch build
    assert grouped_kernel(h100.with_values(deep_gemm=True), "blockwise", torch.bfloat16, 2048, 1536) == DEEPGEMM
    assert grouped_kernel(h100, "blockwise", torch.bfloat16, 2048, 1536) == PER_EXPERT
    older = h100.with_values(blockwise_scaled_mm=False, scaled_grouped_mm=False)  # a torch without them
    assert grouped_kernel(older, "blockwise", torch.bfloat16, 2048, 1536) == EMULATED
    assert grouped_kernel(older, "rowwise", torch.bfloat16, 2048, 1536) == EMULATED
    assert blockwise_linear_kernels(older, torch.bfloat16, 8192, 2048, 3072).fwd == EMULATED
    assert rowwise_linear_kernel(h100.with_values(torchao=False)) == EMULATED
    # torch 2.11's CPU _scaled_mm takes per-tensor scales only: torchao's rowwise Float8Linear would fail there
    assert rowwise_linear_kernel(_platform(None, cpu_rowwise_scaled_mm=False)) == EMULATED


def test_kernel_log_line_and_this_machine():
    from quantization.fp8.kernels import Platform, describe

    here = Platform.detect()
    assert here.device == ("cuda" if torch.cuda.is_available() else "cpu")
    cpu = _platform(None)
    assert describe(cpu, "blockwise").startswith("fp8 blockwise kernels: emulated (CPU)")
    assert "torchao Float8Linear" in describe(cpu, "rowwise")
    assert "torchao" not in describe(cpu.with_values(cpu_rowwise_scaled_mm=False), "rowwise")
    line = describe(_platform((9, 0)), "blockwise")
    assert line.startswith("fp8 blockwise kernels: linears fwd/dgrad scaled_mm BlockWise1x128 x BlockWise128x128, "
                           "wgrad scaled_mm BlockWise1x128 x BlockWise1x128") and "grouped experts scaled_mm per " \
                           "expert" in line and "sm90" in line
    assert "grouped experts DeepGEMM (torchao)" in describe(_platform((9, 0), deep_gemm=True), "blockwise")
    assert "grouped experts _scaled_grouped_mm rowwise" in describe(_platform((9, 0)), "rowwise")
    assert "emulated (fp8.kernels = emulated" in describe(_platform((9, 0)), "blockwise", "emulated")


def test_apply_fp8_chooses_kernels_for_the_platform(caplog):
    """The conversion logs the kernels; rowwise linears are torchao's where _scaled_mm runs and our emulation on
    an sm80 GPU or with fp8.kernels = emulated; the modules keep the platform they were chosen for."""
    import logging

    from models.deepseek_v3.args import FLAVORS
    from models.deepseek_v3.model import DeepSeekV3Model
    from models.deepseek_v3.parallelize import MODULE_DEFAULTS, named_blocks
    from quantization.fp8.config import fp8_selection
    from quantization.fp8.convert import apply_fp8
    from trainer.job_config import load_config

    def convert(platform, *args):
        with torch.device("meta"):
            model = DeepSeekV3Model(FLAVORS["debugmodel"].replace(n_layers=2))
        apply_fp8(named_blocks(model), fp8_selection(load_config(list(args)).fp8, MODULE_DEFAULTS), platform)
        return model

    with caplog.at_level(logging.INFO, logger="quantization.fp8.convert"):
        model = convert(_platform((9, 0)), "--fp8.recipe", "blockwise")
    assert any(r.getMessage().startswith("fp8 blockwise kernels: linears fwd/dgrad scaled_mm") for r in caplog.records)
    assert model.layers["0"].attention.wq.platform.capability == (9, 0)
    assert model.layers["1"].moe.experts.quantized_mm.platform.capability == (9, 0)
    assert type(convert(_platform((9, 0)), "--fp8.recipe", "rowwise").layers["0"].attention.wq).__name__ == \
        "Float8Linear"
    for platform, extra in ((_platform((8, 0)), []), (_platform((9, 0)), ["--fp8.kernels", "emulated"])):
        wq = convert(platform, "--fp8.recipe", "rowwise", *extra).layers["0"].attention.wq
        assert type(wq) is Fp8Linear and wq.recipe == "rowwise"


def test_per_expert_experts_read_the_group_ends_once_per_forward_and_backward(monkeypatch):
    """The blockwise per-expert experts need the group ends on the host: on fake CUDA tensors, a forward and backward
    copies them to the host once (in the forward; the backward reuses the copy), reads no device scalar, and each
    of the three per-expert GEMMs (fwd, dgrad, wgrad) gets the host copy. The routed experts' three projections
    compiled (aot_eager, on CPU with the per-expert GEMMs stood in for) copy once for all three, in the forward
    graph: the partitioner saves the copy for the backward rather than copy again there."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode

    from quantization.fp8 import gemms
    from quantization.fp8.gemms import _Fp8GroupedMMFn
    from quantization.fp8.kernels import PER_EXPERT

    class Reads(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.to_host, self.scalars, self.gemm_offsets = 0, 0, []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is torch.ops.aten._local_scalar_dense.default:
                self.scalars += 1
            if func is torch.ops.aten._to_copy.default and args[0].is_cuda and kwargs.get("device") == \
                    torch.device("cpu"):
                self.to_host += 1
            if func is torch.ops.dsv3_fp8.blockwise_grouped_mm.default:
                self.gemm_offsets.append((args[5], args[4].device.type))
            return func(*args, **kwargs)

    class Ctx:  # the autograd engine would need a CUDA device: the Function's two halves are called directly
        def save_for_backward(self, *tensors):
            self.saved_tensors = tensors

    # zeroing the tail rows indexes a fake CUDA tensor, which this CPU build refuses; it reads nothing on the host
    monkeypatch.setattr(gemms, "_zero_tail", lambda t_PX, offs_E: t_PX)

    with FakeTensorMode(allow_non_fake_inputs=True):
        x, dy = (torch.empty(640, n, device="cuda", dtype=torch.bfloat16) for n in (2048, 640))
        w = torch.empty(3, 640, 2048, device="cuda", dtype=torch.bfloat16)
        offs = torch.empty(3, device="cuda", dtype=torch.int32)
        ctx = Ctx()
        with Reads() as reads:
            _Fp8GroupedMMFn.forward(ctx, x, w, offs, "blockwise", PER_EXPERT)
            _Fp8GroupedMMFn.backward(ctx, dy)
    assert (reads.to_host, reads.scalars) == (1, 0)
    assert sorted(reads.gemm_offsets) == [("dgrad", "cpu"), ("fwd", "cpu"), ("wgrad", "cpu")]

    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    from models.deepseek_v3.moe import _swiglu_quantized
    from quantization.fp8.kernels import Platform
    from quantization.fp8.quantize import WeightBlocks

    def on_cpu(a, b, offs, ends, gemm):  # the per-expert GEMMs' shapes, from what the CPU computes, using the ends
        assert ends.device.type == "cpu"
        used = (ends[-1] > 0).to(a.dtype)
        if gemm == "wgrad":
            return a.new_ones(ends.shape[0], a.shape[1], b.shape[1]) * used
        return a @ b.q[0].t() * used  # W's blocks (fwd), W^T's (dgrad): K last

    def blocks(w):  # the weights of 64 rows and columns stay as they are, with one scale (no 128 x 128 blocks)
        return WeightBlocks(w, w.new_ones(*w.shape[:-2], 1, 1))

    graphs = {}

    def keep(name):
        def compiler(gm, example_inputs):
            # copies to the host of the offsets (a recompute in the backward would be one too)
            graphs[name] = sum(n.target is torch.ops.aten._to_copy.default and n.kwargs.get("device") ==
                               torch.device("cpu") for n in gm.graph.nodes)
            return make_boxed_func(gm.forward)
        return compiler

    monkeypatch.setattr(gemms, "blockwise_grouped", on_cpu)
    monkeypatch.setattr(gemms, "quantize_weight_blocks", blocks)
    monkeypatch.setattr(gemms, "grouped_kernel", lambda *args: PER_EXPERT)  # as on a Hopper GPU
    mm = gemms.Fp8GroupedMM("blockwise", platform=Platform("cpu"))
    torch._dynamo.reset()
    fn = torch.compile(lambda *args: _swiglu_quantized(*args, mm), fullgraph=True,
                       backend=aot_autograd(fw_compiler=keep("fw"), bw_compiler=keep("bw")))
    x = torch.randn(200, 128, requires_grad=True)
    w1, w3 = (torch.randn(2, 64, 128, requires_grad=True) for _ in range(2))
    w2 = torch.randn(2, 128, 64, requires_grad=True)
    fn(x, w1, w2, w3, torch.tensor([150, 50])).sum().backward()
    assert (graphs["fw"], graphs["bw"]) == (1, 0)


def test_real_kernel_layouts_pass_torchs_checks():
    """Every real FP8 GEMM's operands and scales, on fake CUDA tensors: torch's own checks of scaled_mm (v2) and
    _scaled_grouped_mm (its meta kernels, which mirror the CUDA ones: row-major a, column-major b, the blockwise
    scales' shapes and strides) accept them; the layout the H200 refused ("scale_b must have strides (1, 16)")
    is refused here too."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from quantization.fp8.quantize import quantize_weight_blocks
    from quantization.fp8.scaled_gemms import (_mm_scales, _scaled_blockwise, blockwise_grouped, blockwise_mm,
                                               per_expert_blockwise, rowwise_grouped_mm, rowwise_grouped_wgrad)

    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    with FakeTensorMode(allow_non_fake_inputs=True):
        M, K, N, E, P = 256, 2048, 640, 3, 640  # K / 128 = 16 blocks, N / 128 = 5 (padding to 8 for 128 x 128)
        x, w, dy = torch.empty(M, K, **bf16), torch.empty(N, K, **bf16), torch.empty(M, N, **bf16)
        w_blocks = quantize_weight_blocks(w)
        assert blockwise_mm(x, w_blocks).shape == (M, N)  # forward
        # dgrad (contraction N: 5 blocks padded to 8): the forward's blocks transposed, or W^T quantised
        assert blockwise_mm(dy, w_blocks.transposed()).shape == (M, K)
        assert blockwise_mm(dy, quantize_weight_blocks(w.t())).shape == (M, K)
        assert blockwise_mm(dy.t(), x.t()).shape == (N, K)  # wgrad, 1 x 128 x 1 x 128 along the tokens
        xg, wg, dyg = torch.empty(P, K, **bf16), torch.empty(E, N, K, **bf16), torch.empty(P, N, **bf16)
        offs = torch.empty(E, device="cuda", dtype=torch.int32)
        assert rowwise_grouped_mm(xg, wg, offs).shape == (P, N)
        assert rowwise_grouped_mm(dyg, wg.transpose(-2, -1), offs).shape == (P, K)
        seg = torch.empty(P, device="cuda", dtype=torch.int64)
        assert rowwise_grouped_wgrad(dyg, xg, offs, seg).shape == (E, N, K)
        ends = [256, 256, 512]  # an empty expert, then rows past the last group
        wg_blocks = quantize_weight_blocks(wg)
        assert per_expert_blockwise(xg, wg_blocks, offs, ends, "fwd").shape == (P, N)
        assert per_expert_blockwise(dyg, wg_blocks.transposed(), offs, ends, "dgrad").shape == (P, K)
        assert per_expert_blockwise(dyg, quantize_weight_blocks(wg.transpose(-2, -1)), offs, ends,
                                    "dgrad").shape == (P, K)
        assert per_expert_blockwise(dyg, xg, offs, ends, "wgrad").shape == (E, N, K)
        # K and N of one 128 tile: one scale per row, each expert's block scales padded from 1 column to 4
        x1, w1, dy1 = torch.empty(P, 128, **bf16), torch.empty(E, 128, 128, **bf16), torch.empty(P, 128, **bf16)
        w1_blocks = quantize_weight_blocks(w1)
        assert per_expert_blockwise(x1, w1_blocks, offs, ends, "fwd").shape == (P, 128)
        assert per_expert_blockwise(dy1, w1_blocks.transposed(), offs, ends, "dgrad").shape == (P, 128)
        assert per_expert_blockwise(dy1, x1, offs, ends, "wgrad").shape == (E, 128, 128)
        # the custom op that the model calls, through its fake kernel
        assert blockwise_grouped(xg, wg_blocks, offs, offs, "fwd").shape == (P, N)
        assert blockwise_grouped(dyg, wg_blocks.transposed(), offs, offs, "dgrad").shape == (P, K)
        assert blockwise_grouped(dyg, xg, offs, offs, "wgrad").shape == (E, N, K)
        # a row count that is not a multiple of 128 (the emulation's case): padded inside the quantisation
        q300, s300 = quantize_row_segments(torch.empty(300, K, **bf16), torch.empty(300, device="cuda",
                                                                                   dtype=torch.int64), E + 1)
        assert q300.shape == (K, 300) and s300.shape == (E + 1, K)
        q = torch.empty(M, K, device="cuda", dtype=torch.float8_e4m3fn)
        wq = torch.empty(N, K, device="cuda", dtype=torch.float8_e4m3fn)
        a_s, w_s = torch.empty(M, K // 128, device="cuda"), torch.empty(N // 128, K // 128, device="cuda")
        import torch.nn.functional as F
        with pytest.raises(RuntimeError, match="scale b must have shape"):
            F.scaled_mm(q, wq.t(), a_s.t().clone().t(), F.ScalingType.BlockWise1x128, w_s.t(),
                        F.ScalingType.BlockWise128x128, output_dtype=torch.bfloat16)
        a_s, w_s = _mm_scales(a_s, w_s, True)
        assert _scaled_blockwise(q, a_s, wq, w_s, True, torch.bfloat16).shape == (M, N)


def test_per_expert_gemms_take_views_and_write_one_output():
    """The blockwise per-expert GEMMs, on fake CUDA tensors: each group's GEMM is one scaled_mm on views, writing
    its rows of one output, and nothing else runs per group. No e4m3 operand is copied: the weight gradient
    contracts over each expert's tokens, so its operands are column slices of dY^T [N, P] and x^T [K, P], which
    torch's scaled_mm takes with their leading stride (copying them took 8.3 ms of a 285 ms step on an H200). No
    scale is copied or padded per group: `quantize_per_expert` lays them out for every group at once (before, each
    GEMM copied its activation scales to column-major and padded its weight blocks, 2 small kernels per GEMM). No
    output is concatenated (the 18 concatenations took 5.0 ms there). A slice cuBLASLt could not take (start or
    leading stride not a multiple of 16 bytes, K not unit-stride) is copied to row-major."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode

    from quantization.fp8 import scaled_gemms
    from quantization.fp8.quantize import quantize_weight_blocks
    from quantization.fp8.scaled_gemms import _k_major, _per_expert, quantize_per_expert

    into = scaled_gemms._blockwise_into_checked  # each GEMM as torch's checks of it on fake tensors

    class Counted(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not func.is_view and func is not torch.ops.prim.device.default:
                self.ops[func.overloadpacket.__name__] += 1
            return func(*args, **(kwargs or {}))

    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    with FakeTensorMode(allow_non_fake_inputs=True):
        E, P, K, N = 4, 1024, 512, 384
        xg, wg, dyg = torch.empty(P, K, **bf16), torch.empty(E, N, K, **bf16), torch.empty(P, N, **bf16)
        offs = torch.empty(E, device="cuda", dtype=torch.int32)
        ends = [256, 256, 768, 896]  # an empty expert, experts starting inside the tensor, rows past the last
        shapes = {"fwd": (P, N), "dgrad": (P, K), "wgrad": (E, N, K)}
        w_blocks = quantize_weight_blocks(wg)
        for gemm, a, b in (("fwd", xg, w_blocks), ("dgrad", dyg, w_blocks.transposed()), ("wgrad", dyg, xg)):
            operands = quantize_per_expert(a, b, offs, gemm)
            with Counted() as counted:
                assert _per_expert(*operands, ends, gemm, torch.bfloat16, into).shape == shapes[gemm]
            # 3 non-empty groups; zeroed: the rows past the last group, or the empty expert's weight gradient
            assert counted.ops == {"new_empty": 1, "_scaled_mm_v2": 3, "zero_": 1}, (gemm, counted.ops)
        q = torch.empty(N, P, device="cuda", dtype=torch.float8_e4m3fn)
        view = q.narrow(1, 256, 512)
        assert _k_major(view) is view
        for unfit in (q.narrow(1, 8, 256), q.t(), torch.empty(N, 520, device="cuda",
                                                              dtype=torch.float8_e4m3fn).narrow(1, 0, 512)):
            assert _k_major(unfit).stride() == (unfit.shape[1], 1)
        # the output a GEMM writes into must be its product's shape
        e4m3, fp32 = dict(device="cuda", dtype=torch.float8_e4m3fn), dict(device="cuda", dtype=torch.float32)
        a_q, a_s = torch.empty(256, K, **e4m3), torch.empty(256, K // 128, **fp32)
        w_q, w_s = torch.empty(N, K, **e4m3), torch.empty(N // 128, K // 128, **fp32)
        a_s, w_s = scaled_gemms._mm_scales(a_s, w_s, True)
        with pytest.raises(RuntimeError, match="the product is"):
            scaled_gemms._blockwise_into_checked(torch.empty(128, N, **bf16), a_q, a_s, w_q, w_s, True)


def test_grouped_scales_give_each_group_its_column_major_block():
    """`_grouped_col_major` lays a grouped operand's 1 x 128 scales out so that every group's (and the rows past the
    last group's) [n, X] scales are a view with the strides scaled_mm takes, (1, n), holding that group's values:
    empty experts, one group, a group of one tile, groups ending before the last row."""
    from quantization.fp8.scaled_gemms import _group_scales, _grouped_col_major

    P, X = 1024, 5
    scale = torch.randn(P, X)
    for ends in ([256, 256, 768, 896], [1024], [0, 128, 1024], [128, 256, 384]):
        flat = _grouped_col_major(scale, torch.tensor(ends, dtype=torch.int32))
        assert flat.shape == (P * X,)
        for start, end in zip([0] + ends, ends + [P]):
            if end > start:
                group = _group_scales(flat, start, end - start, X)
                assert torch.equal(group, scale[start:end]) and group.stride() == (1, end - start), (ends, start)


def _expand(scale: torch.Tensor, rows: int, cols: int, tile_rows: int, tile_cols: int) -> torch.Tensor:
    return scale.repeat_interleave(tile_rows, 0)[:rows].repeat_interleave(tile_cols, 1)[:, :cols]


def _reference_scaled_mm(a, b, scale_a, recipe_a, scale_b, recipe_b, output_dtype):
    """What F.scaled_mm computes, by the documented meaning of its blockwise scales: a [M, K] with 1 x 128 scales
    [M, K/128]; b [K, N] with 128 x 128 scales [K/128 (padded to 4), N/128] or 1 x 128 scales [N, K/128]."""
    import torch.nn.functional as F

    M, K = a.shape
    N = b.shape[1]
    assert recipe_a == F.ScalingType.BlockWise1x128
    a_hp = a.float() * _expand(scale_a, M, K, 1, 128)
    if recipe_b == F.ScalingType.BlockWise128x128:
        b_hp = b.float() * _expand(scale_b[:K // 128], K, N, 128, 128)
    else:
        b_hp = b.float() * _expand(scale_b.t(), K, N, 128, 1)
    return (a_hp @ b_hp).to(output_dtype)


def _reference_scaled_mm_v2(a, b, scale_a, recipe_a, swizzle_a, scale_b, recipe_b, swizzle_b, bias, out_dtype,
                            contraction_dim=(), use_fast_accum=False, *, out=None):
    """`_reference_scaled_mm` through the op F.scaled_mm calls (scales and recipes as lists), with its out=."""
    import torch.nn.functional as F

    assert not swizzle_a and not swizzle_b and bias is None and out is not None
    got = _reference_scaled_mm(a, b, scale_a[0], F.ScalingType(recipe_a[0]), scale_b[0], F.ScalingType(recipe_b[0]),
                               out_dtype)
    return out.copy_(got)


def _reference_scaled_grouped_mm(a, b, scale_a, scale_b, offs, out_dtype):
    """What torch._scaled_grouped_mm computes with rowwise scales: 2D x 3D (a [P, K] scales [P]; b [E, K, N] scales
    [E, N]) or 2D x 2D over groups of the contraction (a [N, P] scales [E * N], b [P, K] scales [E * K])."""
    if b.dim() == 3:
        return torch._grouped_mm(a.float() * scale_a[:, None], b.float() * scale_b[:, None, :], offs=offs).to(
            out_dtype)
    E = offs.shape[0]
    sa, sb = scale_a.view(E, -1), scale_b.view(E, -1)
    starts = [0] + offs.tolist()[:-1]
    return torch.stack([(a[:, s:t].float() * sa[e][:, None]) @ (b[s:t].float() * sb[e][None, :])
                        for e, (s, t) in enumerate(zip(starts, offs.tolist()))]).to(out_dtype)


def _with_reference_gemms(monkeypatch) -> None:
    """torch's FP8 GEMMs (no CPU kernels) replaced by references that compute what their scales mean."""
    import torch.nn.functional as F

    monkeypatch.setattr(F, "scaled_mm", _reference_scaled_mm)
    monkeypatch.setattr(torch, "_scaled_mm_v2", _reference_scaled_mm_v2)  # the per-expert GEMMs' out= form
    monkeypatch.setattr(torch, "_scaled_grouped_mm", _reference_scaled_grouped_mm)


def _real_linear_case(seed: int):
    """x [256, 384] with channels of unequal scale, W [640, 384], dY, in bf16, and every GEMM's real kernel."""
    from quantization.fp8.kernels import SCALED_MM_BLOCKS, SCALED_MM_TILES, LinearKernels

    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(256, 384, generator=gen) * torch.logspace(-1, 1, 384)).bfloat16()
    w = (torch.randn(640, 384, generator=gen) * 0.05).bfloat16()
    dy = torch.randn(256, 640, generator=gen).bfloat16()
    return x, w, dy, LinearKernels(SCALED_MM_BLOCKS, SCALED_MM_BLOCKS, SCALED_MM_TILES)


def _outputs_and_gradients(fn, x, w, dy) -> tuple:
    """(y, dx, dW) of y = fn(x, w) with upstream gradient dy."""
    xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = fn(xi, wi)
    y.backward(dy)
    return y.detach(), xi.grad, wi.grad


@pytest.mark.parametrize("kernel", ["linear", "_scaled_grouped_mm rowwise", "scaled_mm per expert"])
def test_real_kernel_paths_against_the_emulation_with_reference_gemms(monkeypatch, kernel):
    """The real-kernel paths' bookkeeping (which operand, which tiles, slices per expert, scale layouts, empty
    experts, rows past the last group) on CPU: torch's FP8 GEMMs replaced by references that compute what their
    scales mean; forward and both gradients equal the emulation's to bf16 rounding (the e4m3 operands are the
    same bits; only the GEMMs' output rounding differs)."""
    from quantization.fp8.gemms import _EMULATED_LINEAR, _Fp8LinearFn

    _with_reference_gemms(monkeypatch)
    if kernel == "linear":
        x, w, dy, real = _real_linear_case(6)
        fns = tuple(lambda a, b, k=k: _Fp8LinearFn.apply(a, b, "blockwise", k) for k in (_EMULATED_LINEAR, real))
    else:
        x, w, dy, offs, _, _ = _grouped_case()
        x, w, dy = x.bfloat16(), w.bfloat16(), dy.bfloat16()
        recipe = "rowwise" if "rowwise" in kernel else "blockwise"
        fns = tuple(lambda a, b, k=k: fp8_grouped_mm(a, b, offs, recipe, k) for k in ("emulated", kernel))
    results = [_outputs_and_gradients(fn, x, w, dy) for fn in fns]
    for got, want in zip(results[1], results[0]):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert _rel(got.float(), want.float()) < 2 ** -8
    if kernel != "linear":
        assert torch.equal(results[1][2][1], torch.zeros_like(w[1]))  # the expert with no tokens
        tail = results[1][0][int(offs[-1]):]
        assert torch.equal(tail, torch.zeros_like(tail))


def test_weight_blocks_transposed_are_the_blocks_of_the_transpose():
    """W^T's 128 x 128 blocks are W's transposed: the e4m3 values and scales of `WeightBlocks.transposed` are those
    of quantising W^T, bit for bit, for a linear's weight and a stack of experts' (an outlier block included); and
    the emulation's dequantised W^T is its dequantised W transposed, partial tiles at the ends included."""
    from quantization.fp8.quantize import qdq_weight, quantize_weight_blocks

    gen = torch.Generator().manual_seed(11)
    for shape in ((384, 256), (3, 256, 640)):
        w = (torch.randn(shape, generator=gen) * torch.logspace(-3, 3, shape[-1])).bfloat16()
        w[..., :128, :128] *= 2.0 ** 100
        kept, again = quantize_weight_blocks(w).transposed(), quantize_weight_blocks(w.transpose(-2, -1))
        assert kept.q.is_contiguous() and kept.q.shape == again.q.shape
        assert torch.equal(kept.q.view(torch.uint8), again.q.view(torch.uint8)), shape
        assert torch.equal(kept.scale, again.scale), shape
    w = torch.randn(200, 300, generator=gen).bfloat16()
    assert torch.equal(qdq_weight(w.t(), "blockwise", torch.bfloat16), qdq_weight(w, "blockwise", torch.bfloat16).t())


class _Counted:
    """Calls of the weight quantisations `quantization.fp8.gemms` makes (emulated `qdq_weight`, real-kernel
    `quantize_weight_blocks`), by pass."""

    def __init__(self, monkeypatch):
        from quantization.fp8 import gemms

        self.calls = 0
        for name in ("qdq_weight", "quantize_weight_blocks"):
            monkeypatch.setattr(gemms, name, self._counting(getattr(gemms, name)))

    def _counting(self, fn):
        def counted(*args, **kwargs):
            self.calls += 1
            return fn(*args, **kwargs)
        return counted

    def take(self) -> int:
        calls, self.calls = self.calls, 0
        return calls


def test_a_cast_weight_is_quantised_once_per_pass_with_the_same_gradients(monkeypatch):
    """A blockwise FP8 linear and the routed experts under bf16 autocast with float32 weights (one process: the
    weight each GEMM gets is a copy cast for it) quantise the weight in the forward only, and the dgrad multiplies
    the forward's quantised weight: output and both gradients equal, bit for bit, those of quantising W^T again in
    the backward (what a weight that is the parameter itself, FSDP2's bf16 one, still does, as the control shows).
    Rowwise scales W^T along the other dimension: quantised again."""
    from quantization.fp8.gemms import _EMULATED_LINEAR, _Fp8GroupedMMFn, _Fp8LinearFn

    counted = _Counted(monkeypatch)
    gen = torch.Generator().manual_seed(12)
    linear = torch.nn.Linear(256, 384, bias=False)
    torch.nn.init.normal_(linear.weight, std=0.05, generator=gen)
    fp8 = Fp8Linear.from_linear(linear, "blockwise", kernels="emulated")
    x, dy = torch.randn(64, 256, generator=gen), torch.randn(64, 384, generator=gen).bfloat16()

    def run(fn, dy, *inputs):
        """(weight quantisations in forward, in backward, [y, input gradients])"""
        leaves = [t.detach().clone().requires_grad_() for t in inputs]
        y = fn(*leaves)
        forward = counted.take()
        y.backward(dy)
        return forward, counted.take(), [y.detach()] + [t.grad for t in leaves]

    with torch.autocast("cpu", dtype=torch.bfloat16):
        kept = run(lambda x, w: torch.func.functional_call(fp8, {"weight": w}, (x,)), dy, x, fp8.weight)
    again = run(lambda x, w: _Fp8LinearFn.apply(x.bfloat16(), w.bfloat16(), "blockwise", _EMULATED_LINEAR), dy, x,
                fp8.weight)
    assert (kept[0], kept[1]) == (1, 0) and (again[0], again[1]) == (1, 1)
    for got, want in zip(kept[2], again[2]):
        assert got.dtype == want.dtype and torch.equal(got, want)
    # partial blocks (the emulation pads them): saving the dequantised slice would hold its padded buffer
    partial = run(lambda x, w: _Fp8LinearFn.apply(x, w, "blockwise", _EMULATED_LINEAR, True),
                  torch.randn(64, 300, generator=gen).bfloat16(), torch.randn(64, 200, generator=gen).bfloat16(),
                  torch.randn(300, 200, generator=gen).bfloat16())
    assert partial[:2] == (1, 1)

    xg, w, dy, offs, _, _ = _grouped_case()
    xg, dy = xg.bfloat16(), dy.bfloat16()
    for recipe, backward_calls in (("blockwise", 0), ("rowwise", 1)):
        kept = run(lambda x, w: fp8_grouped_mm(x, w, offs, recipe), dy, xg, w)  # float32 w: a cast copy
        again = run(lambda x, w: _Fp8GroupedMMFn.apply(x, w.bfloat16(), offs, recipe), dy, xg, w)
        assert (kept[0], kept[1]) == (1, backward_calls) and (again[0], again[1]) == (1, 1), recipe
        for got, want in zip(kept[2], again[2]):
            assert got.dtype == want.dtype and torch.equal(got, want), recipe
    assert run(lambda x, w: fp8_grouped_mm(x, w, offs, "blockwise"), dy, xg, w.bfloat16())[:2] == (1, 1)


@pytest.mark.parametrize("kernel", ["linear", "scaled_mm per expert"])
def test_real_kernel_paths_with_the_forwards_weight_kept_give_the_same_bits(monkeypatch, kernel):
    """The real blockwise kernels' dgrad on the forward's e4m3 weight blocks, transposed (a weight cast for the
    call), against quantising W^T again (a weight that is the parameter): the same e4m3 operands, so the same
    output and gradients bit for bit (torch's FP8 GEMMs replaced by references on CPU, as above); the weight is
    quantised once, in the forward."""
    from quantization.fp8.gemms import _Fp8GroupedMMFn, _Fp8LinearFn
    from quantization.fp8.kernels import PER_EXPERT

    _with_reference_gemms(monkeypatch)
    counted = _Counted(monkeypatch)
    if kernel == "linear":
        x, w, dy, real = _real_linear_case(13)
        fns = [lambda a, b, cast=cast: _Fp8LinearFn.apply(a, b, "blockwise", real, cast) for cast in (False, True)]
    else:
        x, w, dy, offs, _, _ = _grouped_case()
        x, w, dy = x.bfloat16(), w.bfloat16(), dy.bfloat16()
        fns = [lambda a, b, cast=cast: _Fp8GroupedMMFn.apply(a, b, offs, "blockwise", PER_EXPERT, None, cast)
               for cast in (False, True)]
    results, calls = [], []
    for fn in fns:
        results.append(_outputs_and_gradients(fn, x, w, dy))
        calls.append(counted.take())
    assert calls == [2, 1]
    for got, want in zip(results[1], results[0]):
        assert torch.equal(got, want)


@pytest.mark.slow
@pytest.mark.parametrize("kernel, weight", [("linear", "bf16"), ("_scaled_grouped_mm rowwise", "bf16"),
                                            ("scaled_mm per expert", "bf16"), ("linear", "cast"),
                                            ("scaled_mm per expert", "cast"), ("linear", "gathered"),
                                            ("scaled_mm per expert", "gathered")])
def test_real_kernel_paths_trace_under_compile(kernel, weight):
    """torch.compile (fullgraph, AOT autograd: forward and backward traced with torch's meta checks of the FP8
    GEMMs' layouts) accepts every real-kernel path, blockwise's dgrad on the forward's weight blocks (`cast`: a
    float32 weight cast for the call) and on the blocks FSDP gathered (`gathered`: the tensor subclass as a graph
    input) included; what fails here is only running it, as torch has no CPU kernel for these GEMMs. (It found the
    rowwise weight gradient's operand traced column-major, which _scaled_grouped_mm refuses, where eager code gave a
    row-major one.)"""
    from torch._dynamo.exc import TorchDynamoException

    from quantization.fp8.fsdp_all_gather import Fp8WeightBlocks
    from quantization.fp8.gemms import _weight_and_blocks, _Fp8LinearFn
    from quantization.fp8.kernels import SCALED_MM_BLOCKS, SCALED_MM_TILES, LinearKernels
    from quantization.fp8.quantize import quantize_weight_blocks

    def make_weight(*shape):
        w = torch.randn(*shape, dtype=torch.float32 if weight == "cast" else torch.bfloat16)
        if weight == "gathered":
            return torch.nn.Parameter(Fp8WeightBlocks(*quantize_weight_blocks(w), torch.bfloat16))
        return w.requires_grad_()

    torch._dynamo.reset()
    if kernel == "linear":
        real = LinearKernels(SCALED_MM_BLOCKS, SCALED_MM_BLOCKS, SCALED_MM_TILES)
        inputs = [torch.randn(256, 384, dtype=torch.bfloat16), make_weight(640, 384)]

        def fn(a, b):
            w, blocks = _weight_and_blocks(b, a.dtype)
            return _Fp8LinearFn.apply(a, w, "blockwise", real, b.dtype != a.dtype, *blocks)
    else:
        offs = torch.tensor([256, 256, 384], dtype=torch.int32)
        inputs = [torch.randn(512, 256, dtype=torch.bfloat16), make_weight(3, 384, 256)]
        recipe = "rowwise" if "rowwise" in kernel else "blockwise"

        def fn(a, b):
            return fp8_grouped_mm(a, b, offs, recipe, kernel)
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    try:
        compiled(inputs[0].requires_grad_(), inputs[1])
    except TorchDynamoException as e:
        pytest.fail(f"tracing failed: {str(e)[:500]}")
    except (NotImplementedError, ValueError) as e:  # the CPU run: torch's own refusal of these GEMMs on CPU
        assert "CPU" in str(e) or "Invalid scaling configuration" in str(e), e
    else:
        pytest.fail("ran on CPU: an FP8 GEMM with no CPU kernel in torch 2.13 ran")


def test_fp8_kernels_benchmark_reports_what_ran_when_stopped(monkeypatch, capsys):
    """A SIGTERM during the candidates (gpu_session.sh's time limit) ends the run with the report of the candidates
    that finished and `stopped` set, not with nothing; the process's SIGTERM handler is restored afterwards."""
    import os
    import signal

    import benchmarks.fp8_kernels as bench
    from quantization.fp8.kernels import Platform

    def run_jobs(jobs, args, results, emulated):
        results.append({"gemm": "671b wq_b", "kind": "linear", "recipe": "none", "candidate": "bf16 mm",
                        "fwd_ms": 1.0, "fwd_bwd_ms": 3.0})
        try:  # as a candidate runs: its own errors are recorded and the run goes on, a SIGTERM is not one of them
            os.kill(os.getpid(), signal.SIGTERM)
        except Exception:
            results.append({"gemm": "never", "kind": "linear", "recipe": "none", "candidate": "caught as an error"})
        results.append({"gemm": "never", "kind": "linear", "recipe": "none", "candidate": "after the signal"})

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(Platform, "detect", staticmethod(lambda device=None: _platform((9, 0))))
    monkeypatch.setattr(bench, "_run_jobs", run_jobs)
    monkeypatch.setattr(bench, "machine_info", dict)
    before = signal.getsignal(signal.SIGTERM)
    report = bench.main(["--shapes", "671b"])
    assert signal.getsignal(signal.SIGTERM) is before
    assert report["stopped"].startswith("SIGTERM")
    assert [r["candidate"] for r in report["results"]] == ["bf16 mm"]
    assert json.loads(capsys.readouterr().out)["stopped"] == report["stopped"]


def test_fp8_kernels_benchmark_needs_cuda(capsys):
    """benchmarks/fp8_kernels.py measures on a GPU only: here one line on stderr, no report (exit code 1 as a
    script), and a bad shape set is refused by name."""
    if torch.cuda.is_available():
        pytest.skip("a CUDA machine runs the benchmark itself (benchmarks/gpu_session.sh)")
    from benchmarks.fp8_kernels import main

    assert main(["--shapes", "671b"]) is None
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["benchmarks/fp8_kernels.py needs a CUDA GPU (torch.cuda.is_available() is False): nothing measured"]
    with pytest.raises(SystemExit) as bad:
        main(["--shapes", "7b"])
    assert bad.value.code == 2 and "--shapes: unknown 7b; allowed: 16b, 671b" in capsys.readouterr().err


class _Fp8Block(torch.nn.Module):
    """The routed experts (benchmarks/fp8_traffic.py) and a blockwise linear on their real-kernel paths, float32
    master weights as parameters."""

    def __init__(self, recipe: str, experts: int, dim: int, inter: int, rows: int):
        import benchmarks.fp8_traffic as traffic

        super().__init__()
        gen = torch.Generator().manual_seed(3)
        self.experts = traffic.SwiGLU(experts, dim, inter, traffic.Experts(recipe), torch.full((experts,), rows), gen)
        self.out = torch.nn.Parameter(torch.randn(dim, dim, generator=gen) * 0.02)

    def forward(self, x):
        from quantization.fp8.gemms import _Fp8LinearFn
        from quantization.fp8.kernels import SCALED_MM_BLOCKS, SCALED_MM_TILES, LinearKernels

        real = LinearKernels(SCALED_MM_BLOCKS, SCALED_MM_BLOCKS, SCALED_MM_TILES)
        return _Fp8LinearFn.apply(self.experts(x), self.out.to(x.dtype), "blockwise", real)


@pytest.mark.parametrize("recipe", ["rowwise", "blockwise"])
def test_compiled_real_fp8_paths_save_no_quantised_weight_for_the_backward(monkeypatch, tmp_path, recipe):
    """The dgrad quantises W^T, which depends on the weight only: torch.compile's partitioner may compute it in the
    forward and save the e4m3 copy for the backward. Under FSDP that holds 1 byte per element of every layer's
    unsharded weights until the backward, the memory trap of torchao's Float8Linear with FSDP (pytorch/ao#562).
    The partitioner treats parameters as free to save (`treat_parameters_as_free_to_save`), so with our weights as
    parameters it quantises W^T again in the backward: with FSDP2's bf16 parameters nothing weight-sized is saved
    in e4m3 (compiled with the partitioner inductor uses, `aot_eager_decomp_partition`; torch's FP8 GEMMs stand in
    as zeros, benchmarks/fp8_traffic.py). The control: the same experts with their weights passed as plain tensors
    save e4m3 weights, so the check sees what it looks for."""
    import datetime

    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import benchmarks.fp8_traffic as traffic
    from models.deepseek_v3.moe import _experts_grouped_mm

    for owner, name, stand_in in traffic.stand_ins():
        monkeypatch.setattr(owner, name, stand_in)
    E, D, F, rows = 2, 384, 384, 128  # no activation has a weight's element count (E * D * F, D * D)

    def saved_e4m3(fn, *args) -> set[int]:
        """Element counts of the e4m3 tensors saved for the backward of fn(*args)."""
        saved = set()

        def pack(t):
            if t.dtype == torch.float8_e4m3fn:
                saved.add(t.numel())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = fn(*args)
        y.float().sum().backward()
        return saved

    weight_sizes = {E * D * F, D * D}
    x = torch.randn(E * rows, D, dtype=torch.bfloat16, requires_grad=True)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    try:
        torch._dynamo.reset()
        block = _Fp8Block(recipe, E, D, F, rows)
        block.compile(fullgraph=True, backend="aot_eager_decomp_partition")
        fully_shard(block, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
        saved = saved_e4m3(block, x)
        assert saved and not saved & weight_sizes, saved  # e4m3 activations only
    finally:
        dist.destroy_process_group()
    torch._dynamo.reset()
    experts = _Fp8Block(recipe, E, D, F, rows).experts
    weights = [w.detach().requires_grad_() for w in (experts.w1, experts.w2, experts.w3)]
    control = torch.compile(lambda x, *w: _experts_grouped_mm(x, *w, experts.counts, quantized_mm=experts.experts_mm),
                            fullgraph=True, backend="aot_eager_decomp_partition")
    assert saved_e4m3(control, x, *weights) & weight_sizes


@pytest.mark.slow
def test_fp8_traffic_benchmark_counts_the_generated_kernels_only(monkeypatch):
    """benchmarks/fp8_traffic.py's measurement at small widths, rowwise: it counts inductor's generated kernels
    (the stood-in GEMMs and other extern kernels left out) forward and backward, each with the buffers it reads and
    writes; the weights' quantisation is one of them, a kernel that reads a master weight."""
    import benchmarks.fp8_traffic as traffic

    for owner, name, value in traffic.stand_ins() + traffic.compile_settings():
        monkeypatch.setattr(owner, name, value)
    run = traffic._measure("rowwise", rows_per_expert=128, experts=2, dim=256, inter=128, seed=0)
    assert run["rows"] == 256
    for pass_ in ("forward", "backward"):
        assert run[pass_]["kernels"] > 3 and run[pass_]["bytes"] > 0
    kernels = run["largest"]
    assert sum(k["bytes"] for k in kernels) == run["forward"]["bytes"] + run["backward"]["bytes"]
    assert all(k["bytes"] > 0 and k["writes"] for k in kernels)
    weight_bytes = 2 * 128 * 256 * 4  # one float32 master weight read whole
    assert any(k["bytes"] >= weight_bytes and any(r.startswith("primals") for r in k["reads"]) for k in kernels)


def test_fp8_traffic_benchmark_splits_rows_from_weights_only_where_the_bytes_grow():
    """The benchmark parts each run's bytes into rows and weights by the line through its two row counts, and
    refuses to where a pass moved fewer bytes at more rows (a run measured on 2026-11-29 gave -0.25 B per activation
    element that way): then only the totals stand."""
    from benchmarks.fp8_traffic import _split

    def runs(forward, backward):
        return [{"rows": rows, "forward": {"bytes": f}, "backward": {"bytes": b}}
                for rows, f, b in zip((1024, 2048), forward, backward)]

    assert _split(runs((1000, 1512), (3000, 3512))) == {"bytes_per_row": 1.0, "weight_bytes": 2976}
    assert _split(runs((2391, 2358), (1421, 1694))) is None


def test_per_expert_host_time_benchmark_smoke(capsys):
    """benchmarks/per_expert_host_time.py runs the per-expert loop on CPU with the GEMM a no-op, reports a time per
    expert GEMM, and gives torch its real `_scaled_mm_v2` and its thread count back."""
    import benchmarks.per_expert_host_time as bench

    real, threads = torch._scaled_mm_v2, torch.get_num_threads()
    report = bench.main(["--experts", "2", "--repeats", "2", "--loops", "1"])
    assert torch._scaled_mm_v2 is real and torch.get_num_threads() == threads
    assert report["us_per_expert_gemm"] > 0 and len(report["repeats_us"]) == 2
    assert json.loads(capsys.readouterr().out)["config"]["experts"] == 2
