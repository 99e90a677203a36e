"""Unit tests of the DeepSeek-V3 model math against independent references (hand computations, loops)."""

import math

import pytest
import torch
import torch.nn.functional as F

from core.token_dispatch import LocalTokenDispatcher
from models.deepseek_v3 import mtp_loss
from models.deepseek_v3.args import FLAVORS, ModelArgs
from models.deepseek_v3.flops import attention_flops_per_token, block_flops_per_token, block_gemms, count_params, \
    training_flops_per_token
from models.deepseek_v3.model import DeepSeekV3Model, document_causal_mask, rope_tables, yarn_inv_freq, \
    yarn_softmax_scale
from models.deepseek_v3.moe import GroupedExperts, MoE, Router, sequence_balance_loss, update_expert_bias
from quantization.fp8.config import fp8_block_modules

TINY = ModelArgs(vocab_size=64, dim=32, inter_dim=64, moe_inter_dim=16, n_layers=3, n_dense_layers=1, n_heads=2,
                 max_seq_len=32, n_routed_experts=8, n_shared_experts=1, n_activated_experts=2, q_lora_rank=0,
                 kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8)


def build(args: ModelArgs, seed: int = 0) -> DeepSeekV3Model:
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = DeepSeekV3Model(args)
    model.to_empty(device="cpu")
    model.init_weights(seed=seed)
    return model


def _randomize(module: torch.nn.Module, std: float = 0.02) -> None:
    """Random weights for a standalone sub-module (the model's own init needs the full model's names)."""
    with torch.no_grad():
        for p in module.parameters():
            torch.nn.init.trunc_normal_(p, std=std)
    if isinstance(module, MoE):
        module.reset_buffers()


# ------------------------------------------------------------------------------------------------ router

def _router(**kw) -> Router:
    args = TINY.replace(**kw)
    r = Router(args)
    return r


def test_router_sigmoid_bias_selects_but_weights_are_unbiased():
    r = _router(n_routed_experts=4, n_activated_experts=2, score_func="sigmoid", route_norm=False, route_scale=2.0)
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    with torch.no_grad():
        # a gate that reproduces `logits` for input e_0
        r.gate.weight.zero_()
        r.gate.weight[:, 0] = logits[0]
    x = torch.zeros(1, TINY.dim)
    x[0, 0] = 1.0
    bias = torch.tensor([0.0, 0.0, 5.0, 0.0])  # pushes expert 2 into the top-2 although its score is lower
    w, idx, scores = r(x, bias)
    assert sorted(idx[0].tolist()) == [0, 2]
    expected = {0: 2.0 * torch.sigmoid(torch.tensor(2.0)).item(), 2: 2.0 * 0.5}
    for j, e in enumerate(idx[0].tolist()):
        assert w[0, j].item() == pytest.approx(expected[e], rel=1e-6)
    assert torch.allclose(scores, torch.sigmoid(logits))


def test_router_route_norm_and_softmax():
    r = _router(n_routed_experts=4, n_activated_experts=2, score_func="softmax", route_norm=True, route_scale=1.5)
    torch.manual_seed(0)
    x = torch.randn(5, TINY.dim)
    w, idx, scores = r(x, None)
    ref_scores = F.softmax(x @ r.gate.weight.T, dim=-1)
    ref_w, ref_idx = ref_scores.topk(2, dim=-1)
    ref_w = ref_w / ref_w.sum(-1, keepdim=True) * 1.5
    assert torch.equal(idx.sort(-1).values, ref_idx.sort(-1).values)
    assert torch.allclose(w.sort(-1).values, ref_w.sort(-1).values, atol=1e-6)


def test_router_scores_in_fp32_under_autocast():
    r = _router(score_func="sigmoid")
    x = torch.randn(5, TINY.dim)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        w, idx, scores = r(x, None)
    ref_w, ref_idx, ref_scores = r(x, None)
    assert scores.dtype == torch.float32
    assert torch.equal(scores, ref_scores) and torch.equal(idx, ref_idx) and torch.equal(w, ref_w)


def test_router_group_limited_hand_case():
    # 8 experts in 4 groups of 2, keep 2 groups, top-2. Group scores = sum of its top-2 = sum of both.
    r = _router(n_routed_experts=8, n_activated_experts=2, n_expert_groups=4, n_limited_groups=2,
                score_func="sigmoid", route_norm=True, route_scale=1.0)
    # scores (after sigmoid) per expert; the single best expert (#6) sits in a weak group (6,7 -> 0.95+0.01)
    probs = torch.tensor([[0.60, 0.55, 0.50, 0.52, 0.10, 0.10, 0.95, 0.01]])
    logits = torch.log(probs / (1 - probs))
    with torch.no_grad():
        r.gate.weight.zero_()
        r.gate.weight[:, 0] = logits[0]
    x = torch.zeros(1, TINY.dim)
    x[0, 0] = 1.0
    w, idx, _ = r(x, torch.zeros(8))
    # group sums: g0=1.15, g1=1.02, g2=0.20, g3=0.96 -> keep g0, g1 -> top-2 experts 0 and 1, not expert 6
    assert sorted(idx[0].tolist()) == [0, 1]
    assert w[0].sum().item() == pytest.approx(1.0, abs=1e-6)


def test_router_group_max_for_v2():
    r = _router(n_routed_experts=8, n_activated_experts=2, n_expert_groups=4, n_limited_groups=1,
                score_func="sigmoid", group_score_func="max")
    probs = torch.tensor([[0.60, 0.55, 0.50, 0.52, 0.10, 0.10, 0.95, 0.01]])
    with torch.no_grad():
        r.gate.weight.zero_()
        r.gate.weight[:, 0] = torch.log(probs / (1 - probs))[0]
    x = torch.zeros(1, TINY.dim)
    x[0, 0] = 1.0
    _, idx, _ = r(x, None)
    assert sorted(idx[0].tolist()) == [6, 7]  # group 3 has the max expert


# ------------------------------------------------------------------------------------------------ experts

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("counts", [[5, 0, 7, 3], [40, 0, 33, 70]], ids=["small", "past_cpu_align"])
def test_grouped_mm_matches_loop_forward_and_backward(dtype, counts):
    torch.manual_seed(0)
    E, D, H = 4, 16, 32
    counts = torch.tensor(counts)  # an expert with zero tokens; groups longer than bf16's CPU row alignment
    ref = GroupedExperts(D, H, E, use_grouped_mm=False)
    _randomize(ref)
    fast = GroupedExperts(D, H, E, use_grouped_mm=True)
    fast.load_state_dict(ref.state_dict())
    ref, fast = ref.to(dtype), fast.to(dtype)
    x = torch.randn(int(counts.sum()), D, dtype=dtype)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y1, y2 = ref(x1, counts), fast(x2, counts)
    g = torch.randn_like(y1)
    y1.backward(g)
    y2.backward(g)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(y2, y1, **tol)
    torch.testing.assert_close(x2.grad, x1.grad, **tol)
    for name in ("w1", "w2", "w3"):
        torch.testing.assert_close(getattr(fast, name).grad, getattr(ref, name).grad, **tol)
    assert getattr(fast, "w1").grad[1].abs().sum() == 0  # the empty expert gets no gradient


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_mm_padding_rows_are_masked(dtype):
    torch.manual_seed(0)
    E, D, H = 2, 16, 16
    experts = GroupedExperts(D, H, E, use_grouped_mm=True)
    _randomize(experts)
    experts.to(dtype)
    counts = torch.tensor([3, 2])
    x = torch.randn(9, D, dtype=dtype, requires_grad=True)  # 4 padding rows past the last offset
    y = experts(x, counts)
    y.backward(torch.ones_like(y))
    assert torch.equal(y[5:], torch.zeros(4, D, dtype=dtype))
    assert torch.equal(x.grad[5:], torch.zeros(4, D, dtype=dtype))
    ref = GroupedExperts(D, H, E, use_grouped_mm=False).to(dtype)
    ref.load_state_dict(experts.state_dict())
    torch.testing.assert_close(y[:5], ref(x[:5].detach(), counts), atol=2e-2, rtol=2e-2)


def test_grouped_mm_under_autocast_computes_in_bf16_with_cpu_aligned_groups():
    """fp32 weights under autocast: the experts compute in bf16 and return bf16, like autocast's matmuls
    (`_grouped_mm` has no autocast rule of its own), on groups padded to multiples of the CPU row alignment."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from models.deepseek_v3.moe import CPU_GROUP_ALIGN

    class GroupedMmCalls(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.calls = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is torch.ops.aten._grouped_mm.default:
                offs = kwargs["offs"] if "offs" in kwargs else args[2]
                self.calls.append((args[0].dtype, offs.tolist()))
            return func(*args, **kwargs)

    torch.manual_seed(0)
    E, D, H = 4, 16, 32
    counts = torch.tensor([40, 0, 33, 70])
    ref = GroupedExperts(D, H, E, use_grouped_mm=False)
    _randomize(ref)
    fast = GroupedExperts(D, H, E, use_grouped_mm=True)
    fast.load_state_dict(ref.state_dict())
    x = torch.randn(int(counts.sum()), D)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y1 = ref(x1, counts)  # the loop's matmuls are autocast's
        with GroupedMmCalls() as spy:
            y2 = fast(x2, counts)
    g = torch.randn_like(y1)
    y1.backward(g)
    y2.backward(g.to(y2.dtype))
    assert y2.dtype == torch.bfloat16 and fast.w1.grad.dtype == torch.float32 and x2.grad.dtype == torch.float32
    assert len(spy.calls) == 3
    for dtype, offsets in spy.calls:
        assert dtype == torch.bfloat16
        assert all(o % CPU_GROUP_ALIGN == 0 for o in offsets), offsets
    tol = dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(y2.float(), y1, **tol)
    torch.testing.assert_close(x2.grad, x1.grad, **tol)
    for name in ("w1", "w2", "w3"):
        torch.testing.assert_close(getattr(fast, name).grad, getattr(ref, name).grad, **tol)


def test_gathering_the_padded_rows_back_copies_their_gradients_without_an_index_add():
    """`gather_rows` is index_select forward and backward (rows not gathered get zero), and its backward copies rows
    (`index_copy`) instead of adding them: inductor leaves a bf16 index_add to ATen's eager kernel, 7.4-8.0 ms of
    the FP8 steps at the 671B shapes on an H200. The FP8 experts' SwiGLU compiled (AOT autograd) has
    no index_add in its backward graph."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    from models.deepseek_v3.moe import _swiglu_quantized, gather_rows
    from quantization.fp8.gemms import Fp8GroupedMM

    gen = torch.Generator().manual_seed(0)
    t = torch.randn(12, 5, generator=gen, dtype=torch.bfloat16)
    rows = torch.tensor([7, 0, 3, 11, 4])
    g = torch.randn(5, 5, generator=gen, dtype=torch.bfloat16)
    grads = []
    for gather in (gather_rows, lambda a, i: a.index_select(0, i)):
        leaf = t.clone().requires_grad_()
        out = gather(leaf, rows)
        out.backward(g)
        assert torch.equal(out, t.index_select(0, rows))
        grads.append(leaf.grad)
    assert torch.equal(grads[0], grads[1]) and grads[0].count_nonzero() == g.count_nonzero()

    backward_ops = set()

    def keep_backward(gm, example_inputs):
        backward_ops.update(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return make_boxed_func(gm.forward)

    torch._dynamo.reset()
    mm = Fp8GroupedMM("rowwise", kernels="emulated")
    fn = torch.compile(lambda *args: _swiglu_quantized(*args, mm), fullgraph=True,
                       backend=aot_autograd(fw_compiler=lambda gm, _: make_boxed_func(gm.forward),
                                           bw_compiler=keep_backward))
    x = torch.randn(200, 128, dtype=torch.bfloat16, requires_grad=True)
    w1, w3 = (torch.randn(2, 64, 128, requires_grad=True) for _ in range(2))
    w2 = torch.randn(2, 128, 64, requires_grad=True)
    fn(x, w1, w2, w3, torch.tensor([150, 50])).float().sum().backward()
    assert "aten.index_copy.default" in backward_ops, sorted(backward_ops)
    assert not any("index_add" in op for op in backward_ops), sorted(backward_ops)


def test_local_dispatch_combine_is_weighted_sum():
    torch.manual_seed(0)
    T, K, E, D = 6, 2, 4, 8
    x = torch.randn(T, D)
    idx = torch.stack([torch.randperm(E)[:K] for _ in range(T)])
    w = torch.rand(T, K)
    counts = torch.bincount(idx.flatten(), minlength=E)
    disp = LocalTokenDispatcher(E)
    routed = disp.dispatch(x, idx, w, counts)
    # rows grouped by expert: row n belongs to the expert whose offset range contains n
    expert_of_row = torch.repeat_interleave(torch.arange(E), counts)
    scale = torch.arange(1, E + 1, dtype=torch.float32)
    y = routed.x_ND * scale[expert_of_row, None] * routed.weights_N[:, None]
    out = disp.combine(y, routed.state)
    ref = sum(x * (scale[idx[:, k]] * w[:, k])[:, None] for k in range(K))
    torch.testing.assert_close(out, ref)


# ------------------------------------------------------------------------------------------------ MoE layer

def _moe_reference(moe: MoE, x_TD: torch.Tensor) -> torch.Tensor:
    """Token-by-token loop, independent of the dispatcher and grouped GEMMs."""
    w, idx, _ = moe.router(x_TD, moe.expert_bias)
    out = torch.zeros_like(x_TD)
    for t in range(x_TD.shape[0]):
        for k in range(idx.shape[1]):
            e = idx[t, k]
            h = F.silu(x_TD[t] @ moe.experts.w1[e].T) * (x_TD[t] @ moe.experts.w3[e].T)
            out[t] += w[t, k] * (h @ moe.experts.w2[e].T)
    return out + moe.shared_experts(x_TD)


def test_moe_matches_token_loop():
    torch.manual_seed(0)
    args = TINY.replace(score_func="sigmoid", route_norm=True, route_scale=2.5, n_expert_groups=4,
                        n_limited_groups=2)
    moe = MoE(args)
    _randomize(moe)
    with torch.no_grad():
        moe.expert_bias.copy_(torch.randn(8) * 0.1)
    x = torch.randn(2, 5, args.dim, requires_grad=True)
    out, ref = moe(x).view(-1, args.dim), _moe_reference(moe, x.view(-1, args.dim))
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    # backward through dispatch, experts, routing weights and combine, against the loop's
    g = torch.randn_like(out)
    leaves = [x, *moe.parameters()]
    for got, want in zip(torch.autograd.grad(out, leaves, g), torch.autograd.grad(ref, leaves, g)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_token_counts_only_in_training_forward():
    torch.manual_seed(0)
    moe = MoE(TINY)
    _randomize(moe)
    x = torch.randn(2, 4, TINY.dim)
    moe.eval()
    moe(x)
    moe.train()
    with torch.no_grad():
        moe(x)
    assert moe.tokens_per_expert.sum() == 0
    moe(x)
    assert moe.tokens_per_expert.sum() == 2 * 4 * TINY.n_activated_experts


def test_token_counts_not_doubled_by_checkpoint_recompute():
    torch.manual_seed(0)
    moe = MoE(TINY)
    _randomize(moe)
    x = torch.randn(2, 4, TINY.dim, requires_grad=True)
    out = torch.utils.checkpoint.checkpoint(moe, x, use_reentrant=False)
    out.sum().backward()
    assert moe.tokens_per_expert.sum() == 2 * 4 * TINY.n_activated_experts


def test_expert_bias_update_rule():
    a, b = MoE(TINY), MoE(TINY)
    for m in (a, b):
        _randomize(m)
    a.tokens_per_expert.copy_(torch.tensor([10.0, 0, 0, 0, 0, 0, 0, 6]))  # mean 2
    b.tokens_per_expert.copy_(torch.full((8,), 3.0))  # balanced: sign(0) = 0
    counts = update_expert_bias([a, b], coeff=0.01)
    assert counts.shape == (2, 8)
    raw = 0.01 * torch.sign(torch.tensor([2.0 - 10, 2, 2, 2, 2, 2, 2, 2 - 6]))
    torch.testing.assert_close(a.expert_bias, raw - raw.mean())
    assert torch.equal(b.expert_bias, torch.zeros(8))
    assert a.tokens_per_expert.sum() == 0 and b.tokens_per_expert.sum() == 0


def test_sequence_balance_loss_hand_case():
    # one sequence, 2 tokens, 2 experts, top-1: both tokens choose expert 0
    scores = torch.tensor([[[0.75, 0.25], [0.5, 0.5]]])
    idx = torch.tensor([[[0], [0]]])
    # f = E/(K S) * counts = 2/2 * [2, 0] = [2, 0]; P = mean of normalised scores = [0.625, 0.375]
    assert sequence_balance_loss(scores, idx).item() == pytest.approx(2 * 0.625)


def test_aux_loss_gradient_matches_explicit_loss():
    torch.manual_seed(0)
    moe = MoE(TINY.replace(score_func="sigmoid"))
    _randomize(moe)
    moe.aux_loss_coeff, moe.aux_loss_grad_scale = 0.1, 0.25
    x = torch.randn(2, 4, TINY.dim)
    moe(x).sum().backward()
    attached = moe.router.gate.weight.grad.clone()
    moe.zero_grad()
    moe.aux_loss_coeff = 0.0
    out = moe(x)
    _, idx, scores = moe.router(x.view(-1, TINY.dim), moe.expert_bias)
    aux = 0.1 * 4 * sequence_balance_loss(scores.view(2, 4, -1), idx.view(2, 4, -1))
    (out.sum() + 0.25 * aux).backward()
    torch.testing.assert_close(attached, moe.router.gate.weight.grad)


# ------------------------------------------------------------------------------------------------ host syncs

def _moe_step_on_fake_tensors(args: ModelArgs, dtype: torch.dtype, autocast: bool):
    """One training forward + backward of an MoE layer on fake tensors (no values, static shapes, no ShapeEnv).

    Reading a value on the host (`.item()`, `.tolist()`, `bool(t)`) raises DataDependentOutputException there, and an
    op whose output shape depends on values (`nonzero`, boolean masks, `repeat_interleave` by counts)
    DynamicOutputShapeException: an MoE that gets through never waits for the device.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.func import functional_call

    moe = MoE(args).to(dtype)
    moe.aux_loss_coeff = 0.01  # the sequence-wise balance loss too
    mode = FakeTensorMode()
    state = {name: mode.from_tensor(t) for name, t in [*moe.named_parameters(), *moe.named_buffers()]}
    x = mode.from_tensor(torch.randn(2, 8, args.dim, dtype=dtype)).requires_grad_()
    with mode:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = functional_call(moe, state, (x,))
        out.sum().backward()
    return x, state


# fp32 without autocast cannot run on fake tensors: `_grouped_mm`'s shape function (torch 2.13) accepts bf16 only
@pytest.mark.parametrize("dtype,autocast", [(torch.bfloat16, False), (torch.float32, True)],
                         ids=["bf16", "fp32_autocast_bf16"])
def test_moe_without_ep_never_syncs_with_the_host(dtype, autocast):
    args = TINY.replace(score_func="sigmoid", route_norm=True, n_expert_groups=4, n_limited_groups=2)
    x, state = _moe_step_on_fake_tensors(args, dtype, autocast)
    assert x.grad.shape == x.shape
    assert state["experts.w1"].grad.shape == state["experts.w1"].shape


def test_fake_tensor_check_catches_a_host_sync():
    """The check above can fail: the per-expert loop reads the counts on the host."""
    from torch._subclasses.fake_tensor import DataDependentOutputException

    with pytest.raises(DataDependentOutputException):
        _moe_step_on_fake_tensors(TINY.replace(use_grouped_mm=False), torch.bfloat16, False)


# ------------------------------------------------------------------------------------------------ RoPE / YaRN / MLA

def test_rope_without_yarn_is_plain():
    args = TINY.replace(max_seq_len=16, original_seq_len=4096)
    assert not args.yarn_enabled
    d = args.qk_rope_head_dim
    expected = torch.tensor([10000.0 ** (-2 * i / d) for i in range(d // 2)])
    torch.testing.assert_close(yarn_inv_freq(args), expected)
    assert yarn_softmax_scale(args) == pytest.approx(args.qk_head_dim ** -0.5)


def test_yarn_blend_hand_computed():
    args = TINY.replace(qk_rope_head_dim=64, max_seq_len=8192, original_seq_len=1024, rope_factor=4.0,
                        beta_fast=32, beta_slow=1, mscale=1.0)
    assert args.yarn_enabled
    d, base = 64, 10000.0
    plain = [base ** (-2 * i / d) for i in range(d // 2)]
    # a dimension pair i turns orig_len * freq_i / (2 pi) times over the original context
    turns = [1024 * f / (2 * math.pi) for f in plain]
    got = yarn_inv_freq(args).tolist()
    for i, (f, n) in enumerate(zip(plain, turns)):
        if n > 33:  # fast: kept (a margin of one dim around the rounded ramp ends)
            assert got[i] == pytest.approx(f, rel=1e-6)
        elif n < 0.9:  # slow: interpolated by the factor
            assert got[i] == pytest.approx(f / 4.0, rel=1e-6)
        else:
            assert f / 4.0 * (1 - 1e-6) <= got[i] <= f * (1 + 1e-6)
    mscale = 0.1 * math.log(4.0) + 1
    assert yarn_softmax_scale(args) == pytest.approx(args.qk_head_dim ** -0.5 * mscale ** 2)
    cos, sin = rope_tables(args)
    assert cos.shape == (8192, 32) and torch.allclose(cos ** 2 + sin ** 2, torch.ones(()), atol=1e-5)


@pytest.mark.parametrize("flavor", sorted(FLAVORS))
def test_every_flavor_builds_on_meta_with_mla_shapes(flavor):
    args = FLAVORS[flavor]
    with torch.device("meta"):
        model = DeepSeekV3Model(args)
    attn = model.layers["0"].attention
    assert attn.wkv_a.weight.shape == (args.kv_lora_rank + args.qk_rope_head_dim, args.dim)
    assert attn.wkv_b.weight.shape == (args.n_heads * (args.qk_nope_head_dim + args.v_head_dim), args.kv_lora_rank)
    assert attn.wo.weight.shape == (args.dim, args.n_heads * args.v_head_dim)
    if args.q_lora_rank:
        assert attn.wq_b.weight.shape == (args.n_heads * args.qk_head_dim, args.q_lora_rank)
    else:
        assert attn.wq.weight.shape == (args.n_heads * args.qk_head_dim, args.dim)
    last = model.layers[str(args.n_layers - 1)]
    assert last.moe.experts.w1.shape == (args.n_routed_experts, args.moe_inter_dim, args.dim)
    assert sum(p.numel() for p in model.parameters()) == count_params(args).total
    assert all(p.device.type == "meta" for p in model.parameters())


def test_document_mask_blocks_attention_across_eos():
    args = TINY.replace(document_masking=True, eos_id=1)
    model = build(args).eval()
    tokens = torch.tensor([[5, 6, 1, 7, 8, 9]])
    other_first_doc = torch.tensor([[11, 12, 1, 7, 8, 9]])
    with torch.no_grad():
        a, b = model(tokens), model(other_first_doc)
    torch.testing.assert_close(a[:, 3:], b[:, 3:])
    assert not torch.allclose(a[:, :3], b[:, :3])
    mask = document_causal_mask(tokens, 1)[0, 0]
    assert mask[3, 2].item() is False and mask[2, 0].item() is True and mask[5, 3].item() is True


# ------------------------------------------------------------------------------------------------ MTP

def test_mtp_output_shape_loss_and_gradient():
    args = TINY.replace(num_mtp_layers=2, mtp_loss_weight=0.5)
    model = build(args)
    tokens = torch.randint(0, 64, (2, 10))
    labels = torch.roll(tokens, -1, 1)
    out = model(tokens)
    assert out.shape == (3, 2, 10, 64)
    loss = mtp_loss(out, labels, 0.5)
    main = F.cross_entropy(out[0].flatten(0, 1), labels.flatten(), reduction="sum")
    k1 = F.cross_entropy(out[1, :, :-1].flatten(0, 1), labels[:, 1:].flatten(), reduction="sum")
    k2 = F.cross_entropy(out[2, :, :-2].flatten(0, 1), labels[:, 2:].flatten(), reduction="sum")
    torch.testing.assert_close(loss, main + 0.25 * (k1 + k2))
    loss.backward()
    assert model.mtp.layers[1].eh_proj.weight.grad.abs().sum() > 0
    assert model.mtp.layers[0].block.moe.router.gate.weight.grad.abs().sum() > 0
    assert model.eval()(tokens).shape == (2, 10, 64)


# ------------------------------------------------------------------------------------------------ counts

def test_published_parameter_counts():
    # DeepSeek-V3: 671B total, 37B activated; V2: 236B / 21B; V2-Lite (our 16B flavor): 15.7B / 2.4B.
    # Published "activated" counts exclude the embedding table.
    for flavor, total, active in (("671B", 671e9, 37e9), ("236B", 236e9, 21e9), ("16B", 15.7e9, 2.4e9)):
        c = count_params(FLAVORS[flavor])
        assert c.total == pytest.approx(total, rel=0.005), flavor
        assert c.active - c.embedding == pytest.approx(active, rel=0.03), flavor


def test_layer_override_cuts_16b_to_the_h100_benchmark_model():
    """train_configs/h100_bench.toml: the 16B flavor's shapes with 4 layers (1 dense + 3 MoE), as issue 14 states
    them: 2.25B parameters, 3.49 GFLOP per token at seq 4096."""
    from models.deepseek_v3 import build_args
    from trainer.job_config import load_config, model_job

    cfg = load_config(["--job.config_file", "train_configs/h100_bench.toml"])
    args = build_args(model_job(cfg))
    assert args == FLAVORS["16B"].replace(n_layers=4, n_dense_layers=1)
    c = count_params(args)
    assert c.total == pytest.approx(2.25e9, rel=0.003)
    assert training_flops_per_token(args, 4096) == pytest.approx(3.49e9, rel=0.002)
    with torch.device("meta"):
        model = DeepSeekV3Model(args)
    assert [layer.moe_enabled for layer in model.layers.values()] == [False, True, True, True]
    assert sum(p.numel() for p in model.parameters()) == c.total
    # n_dense_layers alone, and both kept (0 / -1) leave the flavor as it is
    no_dense = model_job(load_config(["--model.flavor", "16B", "--model.n_dense_layers", "0"]))
    assert build_args(no_dense).n_dense_layers == 0
    assert build_args(model_job(load_config(["--model.flavor", "16B"]))) == FLAVORS["16B"]


def test_flops_per_token_formula():
    args = FLAVORS["debugmodel"]
    c = count_params(args)
    attn_full = 6 * 16 * (192 + 128) * 256 * 6
    assert training_flops_per_token(args, 256, causal=False) == 6 * (c.active - c.embedding) + attn_full
    assert training_flops_per_token(args, 256) == 6 * (c.active - c.embedding) + attn_full / 2


@pytest.mark.parametrize("flavor, mtp, dense", [("debugmodel", 0, None), ("debugmodel", 2, None), ("16B", 1, None),
                                               ("671B", 1, None), ("debugmodel", 2, 6), ("debugmodel", 1, 0)])
def test_block_flops_name_the_fp8_modules_and_add_up_to_the_flops(flavor, mtp, dense):
    """The per-module table holds the modules [fp8] finds in a real (meta) model's blocks, MTP blocks included; each
    entry is 6 x its parameters over the blocks (routed experts at top_k / E), and with 6 x the parameters outside
    those modules (head, eh_proj, router gates, norms; not the embedding, a lookup) it adds up exactly to the FLOPs
    but the attention scores; and the parameter count is the model's. The counts take blocks by kind (`dense`:
    every main layer dense, or none)."""
    args = FLAVORS[flavor].replace(num_mtp_layers=mtp)
    if dense is not None:
        args = args.replace(n_dense_layers=dense)
    with torch.device("meta"):
        model = DeepSeekV3Model(args)
    blocks = list(model.layers.values()) + ([m.block for m in model.mtp.layers] if mtp else [])
    table = block_flops_per_token(args)
    assert table.keys() == fp8_block_modules(blocks).keys()
    expected, inside = dict.fromkeys(table, 0), set()
    for block in blocks:
        for fqn, module in block.named_modules():
            if fqn in table:
                inside |= {id(p) for p in module.parameters()}
                params = sum(p.numel() for p in module.parameters())
                if fqn == "moe.experts":
                    params = params * args.n_activated_experts // args.n_routed_experts
                expected[fqn] += 6 * params
    assert table == expected
    outside = {name: p.numel() for name, p in model.named_parameters()
               if id(p) not in inside and name != "tok_embeddings.weight"}
    assert all(name == "output.weight" or name.endswith(("eh_proj.weight", "router.gate.weight", "norm.weight"))
               for name in outside), sorted(outside)
    parameter_part = training_flops_per_token(args, 4096) - attention_flops_per_token(args, 4096)
    assert parameter_part == sum(table.values()) + 6 * sum(outside.values())
    assert count_params(args).total == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("flavor", ["debugmodel", "236B"])
def test_block_gemm_shapes_are_the_weights(flavor):
    """`block_gemms` (the memory plan's FP8 shapes) names every FP8-eligible module of a dense and a MoE block, each
    with its weights' (in, out, copies): a linear's [out, in]; the experts' w1, w3 [E, hidden, dim], w2 [E, dim,
    hidden]."""
    args = FLAVORS[flavor].replace(n_layers=2, n_dense_layers=1)
    with torch.device("meta"):
        model = DeepSeekV3Model(args)
    for layer, block in model.layers.items():
        modules = fp8_block_modules([block])
        gemms = block_gemms(args, moe=int(layer) >= args.n_dense_layers)
        assert gemms.keys() == modules.keys()
        for fqn, module in modules.items():
            if isinstance(module, torch.nn.Linear):
                want = ((module.in_features, module.out_features, 1),)
            else:
                want = tuple((w.shape[2], w.shape[1], w.shape[0]) for w in (module.w1, module.w3, module.w2))
            assert gemms[fqn] == want, fqn


def test_model_trains_a_few_steps_on_one_batch():
    model = build(TINY)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens = torch.randint(0, 64, (2, 16))
    losses = []
    for _ in range(8):
        loss = F.cross_entropy(model(tokens).flatten(0, 1), torch.roll(tokens, -1, 1).flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 1.0


def test_rms_norm_weight_takes_the_input_dtype_under_autocast():
    """bf16 latents meet fp32 norm weights under autocast: no dtype mismatch (which keeps torch off its fused
    rms_norm kernel on CUDA, with a warning), values as the fp64 norm with the weight rounded to bf16."""
    import warnings

    model = build(TINY.replace(q_lora_rank=16, num_mtp_layers=1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(torch.randint(0, 64, (2, 16)))
        out.float().sum().backward()
    assert not [w for w in caught if "Mismatch dtype" in str(w.message)], [str(w.message) for w in caught]
    from models.deepseek_v3.norm import RMSNorm

    norms = [m for m in model.modules() if isinstance(m, torch.nn.RMSNorm)]
    # 4 per block (attention, ffn, q and kv latents) in 3 layers + 1 MTP block, the final norm, 3 more in MTP
    assert len(norms) == 4 * 4 + 1 + 3 and all(isinstance(m, RMSNorm) for m in norms)

    gen = torch.Generator().manual_seed(0)
    norm = RMSNorm(48, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(48, generator=gen))
    x = torch.randn(5, 48, generator=gen)
    xd, wd = x.bfloat16().double(), norm.weight.detach().bfloat16().double()
    want = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6) * wd
    got = norm(x.bfloat16())
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), want, rtol=2 ** -7, atol=0)
    plain = torch.nn.RMSNorm(48, eps=1e-6)
    plain.load_state_dict(norm.state_dict())
    assert torch.equal(norm(x), plain(x))  # fp32 input, fp32 weight: nothing changes


def test_bf16_attention_pads_v_for_the_flash_kernel_and_matches_the_reference():
    """MLA's unequal head dims in bf16 on CPU: zero-padded v on the flash kernel, outputs and grads as exact SDPA."""
    from models.deepseek_v3.model import attention
    from parallelisms.activation_checkpoint.policy import OpCounter

    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, 3, 40, 24, generator=gen) for _ in range(2))
    v, grad = (torch.randn(2, 3, 40, 16, generator=gen) for _ in range(2))
    results = {}
    for dtype in (torch.bfloat16, torch.float64):
        leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        counter = OpCounter()
        with counter:
            out = attention(*leaves, 0.2, None)
            out.backward(grad.to(dtype))
        results[dtype] = (out, *(t.grad for t in leaves))
        flash = counter.counts["aten._scaled_dot_product_flash_attention_for_cpu.default"]
        assert flash == (1 if dtype == torch.bfloat16 else 0), counter.counts
    for got, want in zip(results[torch.bfloat16], results[torch.float64]):
        assert got.shape == want.shape
        torch.testing.assert_close(got.double(), want, rtol=0, atol=3e-2 * want.abs().max().item())
