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

import math

import pytest
import torch

from quantization.fp8.gemms import Fp8GroupedMM, Fp8Linear, fp8_grouped_mm
from quantization.fp8.quantize import E4M3_MAX, dequantize, quantize, quantize_segments

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


def test_round_trip_error_bound_on_random_values():
    """Arbitrary values: every element within the per-element bound 2^-4 |t| + 2^-10 s."""
    t = torch.randn(256, 512, generator=torch.Generator().manual_seed(1)) * torch.logspace(-3, 3, 512)
    q, scale = quantize(t, 1, 128)
    _assert_within(dequantize(q, scale, 1, 128), t, _elem_error(t, 1, 128), "1x128 round trip")


def test_segment_quantisation_is_per_row_and_segment():
    t = torch.randn(8, 10, generator=torch.Generator().manual_seed(2))
    t[:, 6:] *= 1e6  # segment 1 holds much larger values; segment 0 must not lose precision to them
    seg = torch.tensor([0] * 6 + [1] * 4)
    q, scale = quantize_segments(t, seg, 2)
    assert scale.shape == (8, 2)
    back = q.float() * scale.index_select(1, seg)
    for cols in (slice(0, 6), slice(6, 10)):
        ref_q, ref_s = quantize(t[:, cols], 1, t[:, cols].shape[1])
        assert torch.equal(back[:, cols], dequantize(ref_q, ref_s, 1, t[:, cols].shape[1]))


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
def test_backward_memory_of_fp8_gemms_is_what_the_memory_plan_adds(dtype):
    """`gemm_backward_extra_bytes` (the memory plan's FP8 term) against the exact tracker: linears whose largest
    operand is dY, x or the weight, and grouped experts of both recipes, within 1% (the scales and offsets)."""
    from quantization.fp8.accounting import gemm_backward_extra_bytes
    from quantization.fp8.gemms import _Fp8LinearFn

    a = torch.finfo(dtype).bits // 8
    gen = torch.Generator().manual_seed(0)
    for M, K, N in ((1024, 256, 1024), (1024, 1024, 256), (256, 1024, 1024)):
        x = torch.randn(M, K, generator=gen, dtype=dtype).requires_grad_()
        w = torch.randn(N, K, generator=gen, dtype=dtype).requires_grad_()
        got = _backward_peak_beyond_gradients(lambda: _Fp8LinearFn.apply(x, w, "blockwise"), [x, w],
                                              a * (M * K + N * K))
        assert got == pytest.approx(gemm_backward_extra_bytes("blockwise", M, K, N, a), rel=0.01), (M, K, N)
    E, K, N, P = 8, 256, 384, 4096
    offs = torch.arange(1, E + 1, dtype=torch.int32) * (P // E)
    for recipe in ("blockwise", "rowwise"):
        x = torch.randn(P, K, generator=gen, dtype=dtype).requires_grad_()
        w = torch.randn(E, N, K, generator=gen, dtype=dtype).requires_grad_()
        got = _backward_peak_beyond_gradients(lambda: fp8_grouped_mm(x, w, offs, recipe), [x, w, offs],
                                              a * (P * K + E * N * K))
        assert got == pytest.approx(gemm_backward_extra_bytes(recipe, P, K, N, a, E), rel=0.01), recipe
