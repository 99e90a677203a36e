"""FSDP2 gathering blockwise FP8 weights as e4m3 blocks (quantization/fp8/fsdp_all_gather.py), in one process: the
all-gather done by hand (each shard's pre-all-gather, the outputs concatenated as FSDP's all-gather concatenates
them, the post-all-gather), against the GEMMs quantising the gathered weight themselves. The multi-process runs
(loss parity, gathered bytes, resume) are in tests/test_parallel.py."""

import io
import types

import pytest
import torch

from quantization.fp8.fsdp_all_gather import Fp8GatheredWeight, Fp8WeightBlocks, gather_as_blocks, gathers_blocks
from quantization.fp8.gemms import Fp8GroupedMM, Fp8Linear, fp8_grouped_mm
from quantization.fp8.quantize import quantize_weight_blocks


def _gathered(w: torch.Tensor, ranks: int, param_dtype: torch.dtype) -> torch.Tensor:
    """What FSDP2 hands the module for the master weight `w` sharded on dim 0 over `ranks`: the parameter made of
    the gathered blocks."""
    policy = types.SimpleNamespace(param_dtype=param_dtype)
    inputs = [Fp8GatheredWeight(shard).fsdp_pre_all_gather(None, w.shape, w.stride(), None, policy)[0]
              for shard in w.chunk(ranks)]
    outputs = tuple(torch.cat(parts) for parts in zip(*inputs))
    blocks, inner = Fp8GatheredWeight(w).fsdp_post_all_gather(outputs, None, param_dtype)
    assert all(t is o for t, o in zip(inner, outputs))  # the buffers FSDP frees after use
    return torch.nn.Parameter(blocks)


def _run(fn, w, x, dy):
    """(y, dx, dW) of fn(x, w)."""
    x = x.detach().clone().requires_grad_()
    y = fn(x, w)
    y.backward(dy)
    return y.detach(), x.grad, w.grad


def test_shards_quantised_and_gathered_are_the_blocks_of_the_gathered_weight():
    """Each shard's blocks, concatenated, equal the blocks of the whole weight cast to FSDP's param dtype, bit for
    bit (the maxima are per block, and no block straddles two shards), for a linear's weight and a stack of
    experts' with an outlier block; the gathered parameter is nominally the param dtype and W's shape."""
    gen = torch.Generator().manual_seed(1)
    for shape, ranks in (((512, 384), 4), ((4, 256, 384), 2)):
        w = torch.randn(shape, generator=gen) * torch.logspace(-3, 3, shape[-1])
        w[..., :128, :128] *= 2.0 ** 60
        p = _gathered(w, ranks, torch.bfloat16)
        whole = quantize_weight_blocks(w.bfloat16())
        assert isinstance(p, Fp8WeightBlocks) and isinstance(p, torch.nn.Parameter)
        assert p.shape == w.shape and p.dtype == torch.bfloat16 and p.requires_grad
        assert torch.equal(p.q.view(torch.uint8), whole.q.view(torch.uint8)) and torch.equal(p.scale, whole.scale)


def test_a_lower_compute_dtype_quantises_the_weight_cast_to_it():
    """The routed experts compute in bf16 on CUDA and under compile whatever FSDP's param dtype: a wrapper of
    compute dtype bf16 (kept through the ops FSDP shards with) quantises the fp32 shard cast to bf16, the copy the
    GEMM would quantise, not the fp32 values."""
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(512, 256, generator=gen)
    shard = Fp8GatheredWeight(w, torch.bfloat16).chunk(2)[1]
    assert type(shard) is Fp8GatheredWeight and shard.compute_dtype == torch.bfloat16
    (q, scale), _ = shard.fsdp_pre_all_gather(None, w.shape, w.stride(), None,
                                               types.SimpleNamespace(param_dtype=None))
    want, plain = quantize_weight_blocks(w[256:].bfloat16()), quantize_weight_blocks(w[256:])
    assert torch.equal(q.view(torch.uint8), want.q.view(torch.uint8)) and torch.equal(scale, want.scale)
    assert not torch.equal(q.view(torch.uint8), plain.q.view(torch.uint8))  # fp32 values round otherwise


@pytest.mark.parametrize("shape, ranks, ok", [
    ((512, 256), 4, True), ((512, 256), 8, False),  # 4 blocks of rows: whole blocks over 4 ranks, not over 8
    ((384, 200), 2, False),  # K not a multiple of 128
    ((8, 256, 128), 8, True), ((8, 256, 128), 16, False),  # experts: whole experts per shard
    ((8, 192, 128), 2, False),  # N not a multiple of 128
    ((512, 256), 1, False),  # one rank: FSDP gathers nothing
])
def test_which_shards_hold_whole_blocks(shape, ranks, ok):
    assert gathers_blocks(shape, ranks) is ok


def test_the_linear_on_gathered_blocks_quantises_no_weight_and_gives_the_same_bits(monkeypatch):
    """A blockwise FP8 linear (emulation) given the gathered blocks: output and both gradients equal, bit for bit,
    those of the weight FSDP would otherwise gather (the master weight cast to bf16), and the GEMMs quantise no
    weight, forward or backward; the weight's gradient is a plain bf16 tensor of its shape (what FSDP
    reduce-scatters)."""
    from test_fp8 import _Counted

    gen = torch.Generator().manual_seed(2)
    master = torch.randn(512, 256, generator=gen) * 0.05
    linear = torch.nn.Linear(256, 512, bias=False)
    module = Fp8Linear.from_linear(linear, "blockwise", kernels="emulated")
    x, dy = torch.randn(96, 256, generator=gen).bfloat16(), torch.randn(96, 512, generator=gen).bfloat16()
    counted = _Counted(monkeypatch)
    plain = torch.nn.Parameter(master.bfloat16())

    def call(x, w):
        return torch.func.functional_call(module, {"weight": w}, (x,))

    want = _run(call, plain, x, dy)
    assert counted.take() == 2  # W in forward, W^T in backward
    got = _run(call, _gathered(master, 4, torch.bfloat16), x, dy)
    assert counted.take() == 0
    assert type(got[2]) is torch.Tensor and got[2].dtype == torch.bfloat16 and got[2].shape == master.shape
    for g, w in zip(got, want):
        assert torch.equal(g, w)


@pytest.mark.parametrize("kernel", ["emulated", "scaled_mm per expert"])
def test_the_experts_on_gathered_blocks_give_the_same_bits(monkeypatch, kernel):
    """The routed experts' grouped GEMM on gathered blocks, on the emulation and on the per-expert real kernels
    (torch's FP8 GEMMs replaced by references that compute what their scales mean, tests/test_fp8.py): the same
    output and gradients as the bf16 weight, and no weight quantised."""
    from test_fp8 import _Counted, _grouped_case, _with_reference_gemms

    _with_reference_gemms(monkeypatch)
    x, master, dy, offs, _, _ = _grouped_case()
    master = master.repeat(2, 1, 1)[:4]  # 4 experts: whole experts over 2 ranks
    offs = torch.cat([offs, offs[-1:].repeat(4 - offs.shape[0])])
    x, dy = x.bfloat16(), dy.bfloat16()
    counted = _Counted(monkeypatch)

    def call(x, w):
        return fp8_grouped_mm(x, w, offs, "blockwise", kernel)

    want = _run(call, torch.nn.Parameter(master.bfloat16()), x, dy)
    counted.take()
    got = _run(call, _gathered(master, 2, torch.bfloat16), x, dy)
    assert counted.take() == 0
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def test_the_real_linear_kernels_on_gathered_blocks_give_the_same_bits(monkeypatch):
    from test_fp8 import _real_linear_case, _with_reference_gemms

    from quantization.fp8.gemms import _Fp8LinearFn

    _with_reference_gemms(monkeypatch)
    x, w, dy, real = _real_linear_case(3)
    master = w.float()
    want = _run(lambda a, b: _Fp8LinearFn.apply(a, b, "blockwise", real), torch.nn.Parameter(w), x, dy)
    got = _run(lambda a, b: _Fp8LinearFn.apply(a, b, "blockwise", real, False, b.q, b.scale),
               _gathered(master, 5, torch.bfloat16), x, dy)
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def test_the_master_weight_wrapper_computes_and_saves_as_a_plain_tensor():
    """Everything but the ops FSDP shards with sees the plain master weight: arithmetic, the optimizer's in-place
    updates (on the same storage), and saving (a checkpoint loads with weights_only, without this module)."""
    w = torch.randn(256, 128)
    p = Fp8GatheredWeight(w)
    assert type(p * 2) is torch.Tensor and torch.equal(p * 2, w * 2)
    assert type(p.chunk(2)[1]) is Fp8GatheredWeight and type(p.detach()) is Fp8GatheredWeight
    p.add_(1.0)
    assert torch.equal(w, p._tensor) and p._tensor.data_ptr() == w.data_ptr()
    buf = io.BytesIO()
    torch.save({"w": p}, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)["w"]
    assert type(loaded) is torch.Tensor and torch.equal(loaded, w)


def test_gathered_blocks_refuse_other_uses():
    """The gathered parameter holds no high-precision values: any op but an FP8 GEMM's is refused by name."""
    p = _gathered(torch.randn(256, 128), 2, torch.bfloat16)
    with pytest.raises(NotImplementedError, match="only FP8 GEMMs take them"):
        p + 1
    with pytest.raises(NotImplementedError, match="changes the shape"):
        p.view(128, 256)


def test_gather_as_blocks_wraps_only_what_the_shards_split_into_whole_blocks():
    """A module's parameter becomes the wrapper (same values, same requires_grad) where its shards hold whole
    blocks; otherwise, and a second time, nothing changes."""
    linear = torch.nn.Linear(128, 512, bias=False)
    before = linear.weight.detach().clone()
    assert gather_as_blocks(linear, "weight", 4)
    assert isinstance(linear.weight, torch.nn.Parameter) and type(linear.weight.data) is Fp8GatheredWeight
    assert torch.equal(linear.weight._tensor, before) and linear.weight.requires_grad
    assert not gather_as_blocks(linear, "weight", 4)
    assert not gather_as_blocks(torch.nn.Linear(128, 384, bias=False), "weight", 2)  # 3 blocks over 2 ranks


def test_deepgemm_experts_take_no_gathered_blocks():
    """DeepGEMM's grouped GEMM quantises W itself (torchao's autograd, other scales): its experts are not
    gathered as blocks; the emulation and the per-expert kernels are."""
    from quantization.fp8.kernels import Platform

    w = torch.empty(8, 2048, 7168, device="meta")
    hopper = Platform("cuda", (9, 0), blockwise_scaled_mm=True, deep_gemm=True)
    assert not Fp8GroupedMM("blockwise", platform=hopper).takes_blocks(w)
    assert Fp8GroupedMM("blockwise", platform=hopper.with_values(deep_gemm=False)).takes_blocks(w)
    assert Fp8GroupedMM("blockwise", kernels="emulated", platform=hopper).takes_blocks(w)
    assert Fp8GroupedMM("blockwise", platform=Platform("cpu")).takes_blocks(w)
    assert not Fp8GroupedMM("rowwise", platform=Platform("cpu")).takes_blocks(w)


@pytest.mark.slow
def test_all_gather_benchmark_smoke():
    """The benchmark's smoke layout (FSDP 2, bf16): gathering blocks delivers fewer bytes per step (the FP8 weights'
    1 byte and scales instead of 2; the embedding, head, norms, router and wkv_a stay bf16), with the same losses
    and gradient norms; the plan predicts a lower peak, and both peaks within 15% of the measured ones (at this size
    the measured peaks differ by less than their run-to-run spread, docs/fp8.md)."""
    from benchmarks.fp8_all_gather import run_benchmark

    [row] = run_benchmark(smoke=True)
    assert row["same_losses_and_grad_norms"] is True
    assert 0.45 < row["gathered_ratio"] < 0.6, row
    on, off = row["all_gather_on"], row["all_gather_off"]
    assert on["predicted_peak_MiB"] < off["predicted_peak_MiB"]
    for run in (on, off):
        assert abs(run["predicted_peak_MiB"] / run["peak_MiB"] - 1) <= 0.15, row


@pytest.mark.slow
def test_the_compiled_optimizer_step_updates_a_wrapped_master_weight_as_a_plain_one():
    """BF16-moment AdamW's fused step runs compiled on CUDA (`trainer.optimizer`), where FSDP hands it the wrapped
    master weight's shard: compiled here on CPU, it updates the wrapped weight in place exactly as a plain one,
    moments included."""
    from trainer.optimizer import _compiled_tensor_step

    gen = torch.Generator().manual_seed(3)
    n = 4096
    master, grad = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    hyper = dict(beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)

    def state(p):
        return (p, grad.clone(), torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16),
                torch.zeros(()), torch.tensor(1e-3), torch.zeros(()), torch.ones(()))

    want = state(master.clone())
    _compiled_tensor_step()(*want, **hyper)
    assert not torch.equal(want[0], master)
    inner = master.clone()
    got = state(Fp8GatheredWeight(inner).view(-1).detach())
    _compiled_tensor_step()(*got, **hyper)
    assert torch.equal(inner, want[0]) and torch.equal(got[2], want[2]) and torch.equal(got[3], want[3])
