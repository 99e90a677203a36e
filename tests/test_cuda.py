"""The CUDA-only paths: attention kernel choice, fused RMSNorm under autocast, the loss, fused AdamW, host syncs in a
training step, the process group's backends for async checkpoints.

Tests marked `cuda` are skipped with a reason on CPU (tests/conftest.py) and run on a GPU machine from the same
command (`./run_tests.sh -m cuda`, or benchmarks/gpu_session.sh). They are written against torch 2.11 and later.
Allocator metrics and snapshots are tested in tests/test_memory.py and tests/test_leak_detector.py, compile on the
GPU in tests/test_compile.py.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from models.deepseek_v3.args import ModelArgs
from models.deepseek_v3.model import DeepSeekV3Model, attention
from parallelisms.activation_checkpoint.policy import OpCounter
from parallelisms.clip import clip_grad_norm_
from trainer import device as devices
from trainer.optimizer import OptimizerSection
from core.loss import IGNORE_INDEX, cross_entropy_sum
from trainer.optimizer import build_optimizer

# dims multiple of 8: the CUDA grouped GEMM wants 16-byte aligned bf16 rows
TINY = ModelArgs(vocab_size=256, dim=64, inter_dim=128, moe_inter_dim=32, n_layers=3, n_dense_layers=1, n_heads=2,
                 max_seq_len=64, n_routed_experts=8, n_shared_experts=1, n_activated_experts=2, q_lora_rank=0,
                 kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16)
FUSED_SDPA = {f"aten._scaled_dot_product_{kernel}_attention.default" for kernel in ("flash", "efficient", "cudnn")}
SYNC_WARNING = "called a synchronizing CUDA operation"


def build_cuda(args: ModelArgs, seed: int = 0) -> DeepSeekV3Model:
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = DeepSeekV3Model(args)
    model.to_empty(device="cuda")
    model.init_weights(buffer_device=torch.device("cuda"), seed=seed)
    return model.train()


def test_cuda_process_group_has_a_cpu_backend_for_async_checkpoints(monkeypatch):
    """DCP's async_save refuses a process group without a CPU backend ("A CPU backend must be enabled for async
    save"): on CUDA the trainer's group is NCCL for CUDA tensors plus gloo for CPU tensors."""
    monkeypatch.setattr(devices, "device_type", lambda: "cuda")
    assert devices.backend() == "cuda:nccl,cpu:gloo"
    monkeypatch.setattr(devices, "device_type", lambda: "cpu")
    assert devices.backend() == "gloo"


@pytest.mark.cuda
def test_cuda_async_checkpoint_through_the_trainers_process_group(tmp_path):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group(devices.backend(), store=store, rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    try:
        weights = {"w": torch.randn(64, 64, device="cuda")}
        dcp.async_save(weights, checkpoint_id=str(tmp_path / "ckpt")).result()
        loaded = {"w": torch.zeros(64, 64, device="cuda")}
        dcp.load(loaded, checkpoint_id=str(tmp_path / "ckpt"))
        torch.testing.assert_close(loaded["w"], weights["w"], rtol=0, atol=0)
    finally:
        dist.destroy_process_group()


@pytest.mark.cuda
def test_cuda_bf16_attention_at_mla_head_dims_runs_a_fused_kernel():
    """MLA at the real head dims (q/k 192, v 128), bf16, causal: SDPA takes a fused kernel (flash, memory-efficient
    or cuDNN), never the math path that materialises the score matrix; forward and gradients as the fp64 math."""
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, 16, 256, 192, generator=gen) for _ in range(2))
    v, grad = (torch.randn(2, 16, 256, 128, generator=gen) for _ in range(2))
    results = {}
    for dtype, device in ((torch.bfloat16, "cuda"), (torch.float64, "cpu")):
        leaves = [t.to(device, dtype).requires_grad_() for t in (q, k, v)]
        counter = OpCounter()
        with counter:
            out = attention(*leaves, 192 ** -0.5, None)
            out.backward(grad.to(device, dtype))
        results[dtype] = [t.detach().cpu() for t in (out, *(leaf.grad for leaf in leaves))]
        if device == "cuda":
            fused = {op for op in counter.counts if op in FUSED_SDPA}
            assert len(fused) == 1, counter.counts
            assert not any("math" in op or op == "aten.bmm.default" for op in counter.counts), counter.counts
    for got, want in zip(results[torch.bfloat16], results[torch.float64]):
        assert got.shape == want.shape
        torch.testing.assert_close(got.double(), want, rtol=0, atol=3e-2 * want.abs().max().item())


@pytest.mark.cuda
def test_cuda_loss_on_bf16_logits_matches_an_fp64_reference():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 64, 1000, generator=gen) * 3
    labels = torch.randint(0, 1000, (2, 64), generator=gen)
    labels[0, :5] = IGNORE_INDEX
    x = logits.to("cuda", torch.bfloat16).requires_grad_()
    loss = cross_entropy_sum(x, labels.cuda())
    loss.backward()
    assert loss.dtype == torch.float32 and x.grad.dtype == torch.bfloat16
    # the reference: the same bf16-rounded logits, log-softmax by hand in fp64
    ref_logits = x.detach().cpu().double().requires_grad_()
    valid = labels != IGNORE_INDEX
    logp = ref_logits - ref_logits.logsumexp(-1, keepdim=True)
    ref = -logp[valid].gather(-1, labels[valid].unsqueeze(-1)).sum()
    ref.backward()
    torch.testing.assert_close(loss.double().cpu(), ref.detach(), rtol=1e-5, atol=0)
    torch.testing.assert_close(x.grad.double().cpu(), ref_logits.grad, rtol=0, atol=1e-2)
    assert x.grad[0, :5].abs().sum() == 0  # ignored labels get no gradient


@pytest.mark.cuda
def test_cuda_fused_adamw_runs_the_fused_kernel_and_matches_the_reference():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 8))
    reference = copy.deepcopy(model)
    model.cuda()
    cfg = OptimizerSection(lr=1e-2, implementation="fused")
    opt = build_optimizer([model], cfg)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                                weight_decay=cfg.weight_decay, foreach=False)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(32, 64, generator=gen)
        for m, o, inp in ((model, opt, x.cuda()), (reference, ref_opt, x)):
            m(inp).square().mean().backward()
            counter = OpCounter()
            with counter:
                o.step()
            o.zero_grad()
            if m is model:
                assert counter.counts.get("aten._fused_adamw_.default") == 1, counter.counts
    for p, r in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.detach().cpu(), r.detach(), rtol=1e-4, atol=1e-5)


@pytest.mark.cuda
def test_cuda_rms_norms_run_the_fused_kernel_under_autocast():
    """Every RMSNorm of a bf16-autocast forward (MLA's latent norms get bf16 inputs, the block norms fp32 ones)
    dispatches torch's fused rms_norm kernel, never the decomposed ops."""
    model = build_cuda(TINY.replace(q_lora_rank=32))
    counter = OpCounter()
    with counter, torch.autocast("cuda", dtype=torch.bfloat16):
        model(torch.randint(0, TINY.vocab_size, (2, 32), device="cuda"))
    norms = sum(isinstance(m, torch.nn.RMSNorm) for m in model.modules())
    assert counter.counts["aten._fused_rms_norm.default"] == norms, counter.counts
    assert counter.counts["aten.rsqrt.default"] == 0, counter.counts


def _count_syncs(fn) -> int:
    """How many synchronizing CUDA operations `fn()` performs (torch's sync debug mode, one warning each)."""
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fn()
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    return sum(SYNC_WARNING in str(w.message) for w in caught)


@pytest.mark.cuda
def test_cuda_training_step_without_ep_never_syncs_with_the_host():
    """Forward (bf16 autocast), loss, backward, gradient clipping, fused AdamW and zero_grad of a MoE model without
    expert parallelism: no host-device synchronisation (the counter itself is checked on a `.item()`)."""
    model = build_cuda(TINY)
    for moe in model.moe_layers():
        moe.aux_loss_coeff = 1e-3
    opt = build_optimizer([model], OptimizerSection(implementation="fused"))
    params = list(model.parameters())
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, TINY.vocab_size, (2, 33), generator=gen).cuda() for _ in range(3)]

    def step(tokens):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(tokens[:, :-1])
        loss = cross_entropy_sum(out, tokens[:, 1:]) / tokens[:, 1:].numel()
        loss.backward()
        clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    step(batches[0])  # warm-up: optimizer state, cuBLAS handles and workspaces
    torch.cuda.synchronize()
    assert _count_syncs(lambda: [step(b) for b in batches[1:]]) == 0
    assert _count_syncs(lambda: step(batches[0]).item()) == 1
